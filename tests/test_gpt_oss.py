"""gpt-oss (`gpt_oss`) against transformers' GptOssForCausalLM: sliding-window and full
layers, attention sinks, YaRN, biased experts with the clamped SwiGLU; offloaded runs
against the plain run; and an MXFP4 checkpoint written here read exactly."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from offload.api.llm import LLM
from offload.core.config import ModelConfig
from offload.core.errors import UserError
from offload.core.presets import PRESETS
from offload.core.sampling import SamplingParams
from offload.io.tiers import Tier
from offload.kernels.formats import Compression
from offload.models import moe, mxfp4
from offload.models.checkpoint import CheckpointSource
from offload.policies.policy import Placement, Policy
from tests.tiny_models import assert_prefill_logits_match, save_byte_tokenizer

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21, 22], [30, 31, 32, 33, 34, 35], [9]]
NEW = 10
EXPERTS, INTER, HIDDEN = 8, 32, 64
# each layer's experts on all three tiers, the KV over all three, two micro-batches
SPLIT = Policy(
    gpu_batch_size=2,
    num_gpu_batches=2,
    weights=Placement(0.5, 0.3, 0.2),
    kv_cache=Placement(0.25, 0.25, 0.5),
)


def _config(**extra) -> GptOssConfig:
    """4 layers: sliding (window 4, shorter than the prompts) and full alternating;
    YaRN with a small original context so its ramp touches every band."""
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16}  # fmt: skip
    return GptOssConfig(
        vocab_size=320, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=EXPERTS,
        num_experts_per_tok=2, sliding_window=4, max_position_embeddings=256,
        rope_parameters=rope, swiglu_limit=1.0, eos_token_id=None, **extra,
    )  # fmt: skip


def _model() -> GptOssForCausalLM:
    """Random weights of sizes that make every term count: sinks, biases and norms far
    from their init, the clamp (limit 1) cutting many gate and up values."""
    torch.manual_seed(0)
    model = GptOssForCausalLM(_config()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or name.endswith("sinks"):
                p.add_(torch.randn_like(p) * 0.5)
            if name.endswith("router.weight"):
                p.mul_(10)
            if "experts" in name and not name.endswith("bias"):
                p.normal_(0, 0.3)
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):
                p.normal_(0, 1)
            if "self_attn" in name and name.endswith("proj.weight"):
                p.normal_(0, HIDDEN**-0.5)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpt_oss")
    model = _model()
    model.save_pretrained(directory)
    save_byte_tokenizer(directory)
    return directory, model


def _reference(model, prompts=PROMPTS) -> list[list[int]]:
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            tokens = model.generate(ids, attention_mask=torch.ones_like(ids),
                                    max_new_tokens=NEW, do_sample=False)  # fmt: skip
        out.append(tokens[0, len(prompt) :].tolist())
    return out


def _tokens(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_new_tokens=NEW))]


def test_config_reads_every_gpt_oss_field(checkpoint):
    directory, _ = checkpoint
    cfg = LLM(str(directory), device="cpu", dtype="float32").config
    assert cfg.window_layers == (True, False, True, False) and cfg.sliding_window == 4
    assert cfg.attention_sinks and cfg.o_bias and cfg.qkv_bias and cfg.expert_bias
    assert cfg.router == "topk_softmax" and cfg.swiglu_limit == 1.0
    assert cfg.rope_scaling.rope_type == "yarn" and not cfg.rope_scaling.truncate


def test_logits_and_greedy_tokens_match_transformers(checkpoint):
    directory, model = checkpoint
    llm = LLM(str(directory), device="cpu", dtype="float32", batch_size=4)
    assert_prefill_logits_match(llm, model, PROMPTS, "gpt_oss")
    want = _reference(model)
    assert len({t for row in want for t in row}) > 10, "degenerate reference: nothing tested"
    assert _tokens(llm) == want


def test_without_sinks_or_clamp_the_tokens_differ(checkpoint, monkeypatch):
    """The sinks and the clamp change this model's tokens: the match above tests them."""
    directory, model = checkpoint
    want = _reference(model)
    llm = LLM(str(directory), device="cpu", dtype="float32", batch_size=4)
    monkeypatch.setattr(moe, "swiglu", lambda cfg: (1e9, cfg.swiglu_alpha))
    assert _tokens(llm) != want
    monkeypatch.undo()
    from offload.models import attention

    plain = attention.attend_sinks
    monkeypatch.setattr(attention, "attend_sinks", lambda q, k, v, b, s: plain(q, k, v, b, s - 1e4))
    assert _tokens(llm) != want


@pytest.mark.parametrize("compression", [None, Compression(4, 32)], ids=["fp32", "int4-g32"])
def test_offloaded_plans_give_the_plain_tokens(checkpoint, compression, tmp_path):
    """Experts on the GPU, in pinned memory and on disk, the KV over all three, fetched by
    module and in the dense schedule: the plain run's tokens (int4: the plain run of the
    same compressed weights)."""
    from offload.executor.runner import PlainRunner

    directory, _ = checkpoint
    plain = LLM(str(directory), device="cpu", dtype="float32", batch_size=8)
    if compression is not None:
        with plain.spec.open_weights() as source:
            plain.runner = PlainRunner(source, torch.float32, plain.device,
                                       weight_compression=compression)  # fmt: skip
        plain.loop.runner = plain.runner
    want = _tokens(plain)
    policy = dataclasses.replace(SPLIT, weight_compression=compression)
    with LLM(str(directory), device="cpu", dtype="float32", policy=policy, nvme=tmp_path) as llm:
        homes = next(iter(llm.runner.experts.homes.values()))
        assert {homes.tier(e) for e in range(homes.span.count)} == {Tier.GPU, Tier.CPU, Tier.DISK}
        assert _tokens(llm) == want
        llm.runner.experts.dense = True
        assert _tokens(llm) == want


@pytest.mark.parametrize(
    "change",
    [{"attention_on_cpu": True}, {"kv_compression": Compression(4, 64)}, {"cpu_experts": 0.5}],
)
def test_a_policy_on_a_path_without_sinks_or_biased_experts_is_refused(checkpoint, change):
    directory, _ = checkpoint
    policy = dataclasses.replace(SPLIT, **change)
    with pytest.raises(UserError, match="gpt_oss cannot run"):
        LLM(str(directory), device="cpu", dtype="float32", policy=policy)


# -- MXFP4 ------------------------------------------------------------------------------
def _write_mxfp4(model, directory) -> dict[str, torch.Tensor]:
    """The model's checkpoint with its experts as random MXFP4 blocks and scales (as
    gpt-oss ships them) and quantization_config; returns the blocks and scales."""
    gen = torch.Generator().manual_seed(7)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    packed = {}
    for layer in range(model.config.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts."
        for name, (rows, cols) in (("gate_up_proj", (2 * INTER, HIDDEN)),
                                   ("down_proj", (HIDDEN, INTER))):  # fmt: skip
            del tensors[p + name]
            groups = cols // 32
            packed[p + name + "_blocks"] = torch.randint(
                0, 256, (EXPERTS, rows, groups, 16), generator=gen, dtype=torch.uint8
            )
            # exponents 2^-6 .. 2^-2 (a value up to 6 x 2^-2)
            packed[p + name + "_scales"] = torch.randint(
                121, 126, (EXPERTS, rows, groups), generator=gen, dtype=torch.uint8
            )
    save_file({**tensors, **packed}, str(directory / "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (directory / "config.json").write_text(json.dumps(config))
    save_byte_tokenizer(directory)
    return packed


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory, checkpoint):
    directory = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    _, model = checkpoint
    packed = _write_mxfp4(model, directory)
    # transformers' model on transformers' own dequantization of those experts
    dequantized = GptOssForCausalLM(_config()).eval()
    state = dict(model.state_dict())
    for name in list(packed):
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            state[base] = convert_moe_packed_tensors(
                packed[name], packed[base + "_scales"], dtype=torch.float32
            )
    dequantized.load_state_dict(state)
    return directory, dequantized, packed


def test_mxfp4_experts_are_read_as_transformers_dequantizes_them(mxfp4_checkpoint):
    """The experts stay MXFP4 blocks and scales (the stage's own bytes), and dequantized
    they are transformers' conversion of the checkpoint bit for bit, in bf16 and fp32."""
    directory, _, packed = mxfp4_checkpoint
    cfg = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    assert cfg.mxfp4_experts
    with CheckpointSource(directory, cfg) as source:
        w = source.layer(1, torch.float32, torch.device("cpu"))
    assert w["experts.3.mlp_in.blocks"].dtype == torch.uint8
    p = "model.layers.1.mlp.experts."
    for dtype in (torch.bfloat16, torch.float32):
        gate_up = convert_moe_packed_tensors(
            packed[p + "gate_up_proj_blocks"], packed[p + "gate_up_proj_scales"], dtype=dtype
        )  # [E, hidden, 2I]: gate columns even, up odd
        down = convert_moe_packed_tensors(
            packed[p + "down_proj_blocks"], packed[p + "down_proj_scales"], dtype=dtype
        )  # [E, I, hidden]
        for e in range(EXPERTS):
            mlp_in, mlp_out = moe.expert_weights(w, e)
            ours_in = mlp_in.weight.dequantize(dtype)
            assert torch.equal(ours_in[:INTER], gate_up[e][:, 0::2].T)
            assert torch.equal(ours_in[INTER:], gate_up[e][:, 1::2].T)
            assert torch.equal(mlp_out.weight.dequantize(dtype), down[e].T)


def test_mxfp4_generation_matches_transformers_on_the_dequantized_weights(mxfp4_checkpoint):
    directory, reference, _ = mxfp4_checkpoint
    llm = LLM(str(directory), device="cpu", dtype="float32", batch_size=4)
    assert _tokens(llm) == _reference(reference)


@pytest.mark.parametrize("compression", [None, Compression(4, 32)], ids=["fp32", "int4-g32"])
def test_mxfp4_experts_offloaded_give_the_plain_tokens(mxfp4_checkpoint, compression, tmp_path):
    """MXFP4 experts on every tier cross as their blocks and scales: the plain tokens.
    With int4 weights the attention's matrices are compressed and the experts stay
    MXFP4 (the plain run of the same weights)."""
    from offload.executor.runner import PlainRunner

    directory, _, _ = mxfp4_checkpoint
    plain = LLM(str(directory), device="cpu", dtype="float32", batch_size=8)
    if compression is not None:
        with plain.spec.open_weights() as source:
            plain.runner = PlainRunner(source, torch.float32, plain.device,
                                       weight_compression=compression)  # fmt: skip
        plain.loop.runner = plain.runner
    want = _tokens(plain)
    policy = dataclasses.replace(SPLIT, weight_compression=compression)
    with LLM(str(directory), device="cpu", dtype="float32", policy=policy, nvme=tmp_path) as llm:
        homes = next(iter(llm.runner.experts.homes.values()))
        assert {homes.tier(e) for e in range(homes.span.count)} == {Tier.GPU, Tier.CPU, Tier.DISK}
        mlp_in, _ = homes.resident(homes.expert_in[0])  # slot 0: on the GPU
        assert isinstance(mlp_in.weight, mxfp4.MXFP4)
        assert _tokens(llm) == want


def test_another_quantization_of_gpt_oss_is_refused_by_name():
    hf = {**PRESETS["gpt-oss-20b"], "quantization_config": {"quant_method": "bitsandbytes"}}
    with pytest.raises(UserError, match="'bitsandbytes' is not read"):
        ModelConfig.from_hf(hf)


def test_dummy_mxfp4_experts_have_unit_scale_outputs():
    """The presets' dummy experts are MXFP4 bytes whose values give outputs of about unit
    variance over unit inputs, as the other dummy matrices."""
    hf = {**PRESETS["gpt-oss-20b"], "num_hidden_layers": 2, "hidden_size": 256}
    hf.update({"intermediate_size": 128, "num_local_experts": 4, "vocab_size": 320})
    hf["layer_types"] = hf["layer_types"][:2]  # (transformers' class checks their count)
    cfg = ModelConfig.from_hf(hf)
    from offload.models.weights import DummySource

    w = DummySource(cfg).layer(0, torch.float32, torch.device("cpu"))
    mlp_in, _ = moe.expert_weights(w, 2)
    assert isinstance(mlp_in.weight, mxfp4.MXFP4)
    std = (torch.randn(512, 256) @ mlp_in.weight.dequantize(torch.float32).T).std().item()
    assert 0.5 < std < 2.0, std


def test_offload_plan_prices_mxfp4_experts(tmp_path, capsys):
    """offload-plan gives gpt-oss-120b at --gpu-mem 24GB a plan and a prediction, its
    experts priced as MXFP4 bytes (4.25 bits a value, and their biases)."""
    from offload.cli.plan import main as plan_main
    from tests.test_moe import _profile

    profile = tmp_path / "hw.json"
    profile.write_text(_profile().to_json())
    args = ["--model", "gpt-oss-120b", "--gpu-mem", "24GB", "--cpu-mem", "120GB"]
    assert plan_main([*args, "--profile", str(profile), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    expert = 3 * 2880 * 2880 * 4.25 / 8 + 2 * (2 * 2880 + 2880)  # blocks, scales, biases
    assert facts["experts"]["layers"] == 36
    assert abs(facts["experts"]["expert_bytes"] - expert) < 3 * 4096, facts["experts"]
    assert facts["predicted"]["total_tok_s"] > 0


def test_sink_attention_in_slices_of_rows_or_tokens_is_the_whole(monkeypatch):
    """`attend_sinks` bounds its scores by taking batch rows, or one row's query tokens,
    a slice at a time: the same context (up to the matmuls' float32 rounding)."""
    from offload.models import attention

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(s, generator=gen) for s in ((5, 4, 7, 16), (5, 2, 9, 16), (5, 2, 9, 16)))
    bias, sinks = torch.randn(5, 1, 7, 9, generator=gen), torch.randn(4, generator=gen)
    whole = attention.attend_sinks(q, k, v, bias, sinks)
    for tokens in (3, 20):  # 3 query tokens a slice; 20: two rows a slice
        monkeypatch.setattr(attention, "SINK_SCORE_BYTES", 4 * 10 * 4 * tokens)
        parts = attention.attend_sinks(q, k, v, bias, sinks)
        torch.testing.assert_close(parts, whole, rtol=0, atol=1e-6)
