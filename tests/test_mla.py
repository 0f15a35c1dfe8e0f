"""Latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight: `models.mla`) against
transformers' own classes, offloaded against the plain run, and its latent cache as the
planner counts it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
)

from offload.api.llm import LLM
from offload.core.config import ModelConfig
from offload.core.errors import UserError
from offload.core.presets import PRESETS
from offload.core.sampling import SamplingParams
from offload.executor.runner import PlainRunner
from offload.kernels.formats import Compression
from offload.policies.policy import Placement, Policy
from tests import tiny_models

# R = 16 latent channels and P = 8 RoPE channels a token; 4 heads of 8 + 8 query
# channels and 12 value channels; experts 32 wide, the dense first layer 96
_DIMS = {
    "vocab_size": tiny_models.VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
}
_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}
MLA_CASES = {
    # DeepSeek-V2 with a query low rank: softmax, top 2 within the best 2 of 4 groups
    "deepseek-v2-groups": (
        DeepseekV2ForCausalLM,
        DeepseekV2Config(**_DIMS, q_lora_rank=24, n_shared_experts=2, n_group=4, topk_group=2,
                         topk_method="group_limited_greedy", routed_scaling_factor=1.5,
                         rope_parameters=_YARN),
    ),
    # DeepSeek-V2-Lite's shape: no query low rank, plain greedy top k
    "deepseek-v2-lite-like": (
        DeepseekV2ForCausalLM,
        DeepseekV2Config(**_DIMS, q_lora_rank=None, n_shared_experts=1, topk_method="greedy"),
    ),
    # DeepSeek-V3: sigmoid scores and their correction bias, noaux_tc's groups, YaRN
    "deepseek-v3": (
        DeepseekV3ForCausalLM,
        DeepseekV3Config(**_DIMS, q_lora_rank=24, n_shared_experts=1, n_group=4, topk_group=2,
                         routed_scaling_factor=2.5, rope_parameters=_YARN),
    ),
    # Moonlight's shape: DeepSeek-V3's classes, no query low rank, one group
    "moonlight-like": (
        DeepseekV3ForCausalLM,
        DeepseekV3Config(**_DIMS, q_lora_rank=None, n_shared_experts=2, n_group=1, topk_group=1,
                         routed_scaling_factor=2.446),
    ),
}  # fmt: skip

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21, 22], [30, 31, 32, 33, 34, 35], [7, 8]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{case: (directory, transformers model)} saved as sharded safetensors."""
    root = tmp_path_factory.mktemp("mla")
    out = {}
    for name, case in MLA_CASES.items():
        tiny_models.CASES[name] = case
        try:
            out[name] = tiny_models.save(name, root / name)
        finally:
            del tiny_models.CASES[name]
    return out


PARAMS = SamplingParams(max_new_tokens=10)


def _tokens(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("case", list(MLA_CASES))
def test_logits_and_greedy_tokens_match_transformers(case, checkpoints):
    """Prefill logits of a left-padded batch and greedy tokens (decode steps in the
    absorbed form over the latent cache) against transformers' expanded attention."""
    directory, model = checkpoints[case]
    llm = LLM(str(directory), device="cpu", dtype="float32", batch_size=4)
    assert llm.config.kv_lora_rank == 16 and llm.config.num_kv_heads == 1
    tiny_models.assert_prefill_logits_match(llm, model, PROMPTS, case)
    for prompt, ours in zip(PROMPTS, _tokens(llm), strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False
            )[0, len(prompt) :].tolist()
        assert ours == ref[: len(ours)], f"{case}: prompt {prompt}: ours {ours} vs {ref}"


def test_the_configs_routers_and_rope_are_read_as_written(checkpoints):
    """Each case's config maps onto the fields the decoder reads: the routers, the
    dense first layer, the shared experts' width and YaRN's parameters."""
    cfgs = {case: LLM(str(d), device="cpu", dtype="float32").config for case, (d, _) in
            checkpoints.items()}  # fmt: skip
    v2, lite, v3 = cfgs["deepseek-v2-groups"], cfgs["deepseek-v2-lite-like"], cfgs["deepseek-v3"]
    assert (v2.router, v2.router_groups, v2.router_topk_groups) == ("softmax_groups", 4, 2)
    assert (lite.router, lite.router_groups, lite.q_lora_rank) == ("softmax_groups", 1, 0)
    assert (v3.router, v3.router_groups, v3.norm_topk_prob) == ("sigmoid", 4, True)
    assert v3.dense_layers == (0,) and v3.moe_layers == [1, 2]
    assert v2.shared_expert_intermediate_size == 64
    rope = v3.rope_scaling
    assert (rope.rope_type, rope.factor, rope.mscale_all_dim) == ("yarn", 4.0, 0.8)


@pytest.mark.parametrize(
    "changes",
    [{"mscale": 0.9}, {"truncate": False, "beta_fast": 16.0}, {"mscale": 0, "factor": 8.0}],
)
def test_yarn_tables_match_transformers(changes):
    """Our YaRN inverse frequencies and attention factor against transformers' own."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from offload.models import ops

    hf = DeepseekV3Config(**_DIMS, q_lora_rank=24, rope_parameters={**_YARN, **changes})
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    cfg = ModelConfig.from_hf(hf.to_dict())
    rotary = ops.Rotary.of(cfg)
    assert torch.allclose(rotary.inv_freq, want_freq, rtol=1e-6, atol=0)
    assert rotary.attention_factor == pytest.approx(want_factor, rel=1e-12)


def test_yarn_on_a_llama_model_matches_transformers(tmp_path):
    """YaRN is every rotary family's (Qwen2.5's long-context configs set it), without
    latent attention's softmax scale: a Llama's prefill logits against transformers'."""
    from transformers import LlamaConfig, LlamaForCausalLM

    yarn = {**_YARN, "truncate": False, "mscale": 0, "mscale_all_dim": 0}
    case = (LlamaForCausalLM, LlamaConfig(**tiny_models._llama_dims, rope_parameters=yarn))
    tiny_models.CASES["llama-yarn"] = case
    try:
        directory, model = tiny_models.save("llama-yarn", tmp_path)
    finally:
        del tiny_models.CASES["llama-yarn"]
    llm = LLM(str(directory), device="cpu", dtype="float32")
    assert llm.config.rope_scaling.rope_type == "yarn" and not llm.config.rope_scaling.truncate
    tiny_models.assert_prefill_logits_match(llm, model, PROMPTS, "llama-yarn")


# -- offloaded: weights on every tier, the latent cache on the GPU ------------------------
SPLIT = Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Placement(0.5, 0.3, 0.2))
INT4 = Compression(bits=4, group_size=32, symmetric=False)


@pytest.mark.parametrize("compression", [None, INT4], ids=["fp32", "int4-g32"])
@pytest.mark.parametrize("case", ["deepseek-v2-groups", "deepseek-v3"])
def test_weights_on_every_tier_give_the_plain_tokens(case, compression, checkpoints, tmp_path):
    """Weights on the GPU, in pinned memory and on disk (the store built in pieces,
    experts fetched by module; int4: the fused down projection's and the experts'
    codes cross), two micro-batches: the plain run's tokens."""
    directory, _ = checkpoints[case]
    plain = LLM(str(directory), device="cpu", dtype="float32", batch_size=8)
    if compression is not None:
        with plain.spec.open_weights() as source:
            plain.runner = PlainRunner(
                source, torch.float32, plain.device, weight_compression=compression
            )
        plain.loop.runner = plain.runner
    want = _tokens(plain)
    policy = dataclasses.replace(SPLIT, weight_compression=compression)
    with LLM(str(directory), device="cpu", dtype="float32", policy=policy, nvme=tmp_path) as llm:
        assert _tokens(llm) == want, case


def test_a_layer_is_made_in_pieces_as_the_whole(checkpoints, monkeypatch):
    """A mixture of experts' layer made a few experts at a time (dense part first) is the
    image made whole, for a checkpoint and for dummy weights."""
    from offload.io import layout
    from offload.kernels.quant import QTensor
    from offload.models.checkpoint import CheckpointSource
    from offload.models.weights import DummySource

    directory, _ = checkpoints["deepseek-v3"]
    cfg = LLM(str(directory), device="cpu", dtype="float32").config
    monkeypatch.setattr(layout, "EXPERTS_A_PIECE", 3)  # 8 experts: 3 + 3 + 2
    assert [len(p) for p in layout.stage_pieces(cfg, "layer.1")[1:]] == [6, 6, 4]
    for source in (CheckpointSource(directory, cfg), DummySource(cfg)):
        whole = source.stage("layer", 1, torch.float32, torch.device("cpu"))
        for names in layout.stage_pieces(cfg, "layer.1"):
            made = source.stored_named("layer", 1, names, torch.float32, torch.device("cpu"))
            assert list(made) == names
            for name in names:
                assert not isinstance(made[name], QTensor)
                assert torch.equal(made[name], whole[name]), name


# -- the latent cache as the planner counts it ---------------------------------------------
def test_the_kv_bytes_a_token_are_the_latent_rows(checkpoints):
    """Layers x (kv_lora_rank + qk_rope_head_dim) x the dtype's bytes a token: the config,
    the layout, the memory plan and the cache the runner allocates agree."""
    from offload.io.layout import KVLayout
    from offload.models.attention import LayerKV
    from offload.policies.memory import plan_memory

    directory, _ = checkpoints["deepseek-v3"]
    cfg = LLM(str(directory), device="cpu", dtype="float32").config
    layers, width = cfg.num_layers, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert cfg.kv_bytes_per_token == layers * width * 2  # (at 2 bytes an element)
    for dtype in (torch.float32, torch.bfloat16):
        slots, rows, elt = 40, 3, dtype.itemsize
        kv = KVLayout(cfg, dtype, slots)
        assert kv.gpu_bytes(rows) == rows * slots * width * elt
        assert LayerKV(rows, cfg, slots, dtype, "cpu").nbytes == kv.gpu_bytes(rows)
        policy = Policy(gpu_batch_size=rows, num_gpu_batches=2)
        plan = plan_memory(cfg, policy, dtype, 30, 10)
        assert plan.detail["kv_gpu"] == layers * 2 * rows * slots * width * elt
    v3 = ModelConfig.from_hf(PRESETS["deepseek-v3"], "deepseek-v3")
    assert v3.kv_bytes_per_token == 61 * 576 * 2 == 70272


@pytest.mark.parametrize(
    "change, named",
    [
        ({"kv_cache": Placement(0.5, 0.5, 0.0)}, "CPU memory"),
        ({"attention_on_cpu": True}, "attention on the CPU"),
        ({"kv_compression": Compression(4, 64, False)}, "compressed KV cache"),
    ],
)
def test_a_latent_cache_off_the_gpu_is_refused_before_the_load(change, named, checkpoints):
    """KV tiers and kernels built for K and V per head take no latent: a policy asking
    for them is refused by name."""
    directory, _ = checkpoints["deepseek-v3"]
    policy = dataclasses.replace(Policy(gpu_batch_size=2), **change)
    with pytest.raises(UserError, match=named):
        LLM(str(directory), device="cpu", dtype="float32", policy=policy)


def test_kv_compression_alone_is_refused_for_a_latent_cache():
    """--kv-compress int4 (no uncompressed format left to choose) names the flag, before
    any profile is measured; auto (None among the formats) plans uncompressed."""
    from offload.policies.choose import choose_policy

    cfg = ModelConfig.from_hf(PRESETS["deepseek-v2-lite"], "deepseek-v2-lite")
    int4 = Compression(4, 64, False)
    with pytest.raises(UserError, match="--kv-compress"):
        choose_policy(cfg, "bfloat16", 8 * 10**9, 60 * 10**9, None, 512, 32,
                      kv_compressions=(int4,))  # fmt: skip


def test_the_search_offers_no_plan_a_latent_cache_cannot_run():
    """DeepSeek-V3 at --gpu-mem 24GB --cpu-mem 120GB with a disk: the searched plan keeps
    the latent cache on the GPU, uncompressed, attended there, with every layer's
    experts counted; no candidate offers another KV home or format."""
    from offload.policies.caps import Caps
    from offload.policies.search import candidates, search
    from tests.test_policies import PROFILE

    cfg = ModelConfig.from_hf(PRESETS["deepseek-v3"], "deepseek-v3")
    caps = Caps(24 * 10**9, 120 * 10**9, nvme=True)
    int4 = Compression(4, 64, False)
    offered = list(candidates(cfg, torch.bfloat16, PROFILE, caps, None, (None,), (None, int4)))
    assert offered and all(p.kv_compression is None and not p.attention_on_cpu for p in offered)
    best = search(cfg, torch.bfloat16, 512, 32, PROFILE, caps)
    assert best.policy.kv_cache == Placement(1.0, 0.0, 0.0)
    assert best.experts["layers"] == 58 and best.experts["experts"] == 256
    assert best.memory.detail["kv_gpu"] == best.policy.block_size * 544 * 61 * 576 * 2
    assert best.gpu_peak_bytes <= caps.gpu_bytes and best.cpu_peak_bytes <= caps.cpu_bytes
