"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized) read into our
int4 format without requantizing: the tokens of transformers' own model class computing
with the dequantized weights ((code - zero) x scale), plain and offloaded.

transformers' own quantizers for these formats need gptqmodel (GPTQ, AWQ) or
compressed-tensors, which CI does not install; the reference is therefore the model
class with the dequantized weights, whose values ours are exactly (`models.prequant`):
fp32 logits within 1e-5 of its, greedy tokens equal."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from offload.api.llm import LLM
from offload.core.errors import UserError
from offload.core.sampling import SamplingParams
from offload.io.layout import stage_layout
from offload.kernels.formats import Compression
from offload.kernels.quant import QTensor
from offload.policies.policy import Placement, Policy
from tests import quantized_checkpoints, tiny_models
from tests.test_policies import PROFILE
from tests.tiny_models import hf_logits, prefill_logits

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34], [300, 1, 2, 250]]
PARAMS = SamplingParams(max_new_tokens=8)
SYMMETRIC = Compression(4, quantized_checkpoints.GROUP, False, head=False)
ZERO_POINTS = Compression(4, quantized_checkpoints.GROUP, False, head=False, zero_point=True)
# (method, symmetric, family case)
CASES = [
    ("gptq", True, "qwen2-bias"),
    ("gptq", False, "llama-gqa"),
    ("gptq-v2", False, "phi3-longrope"),
    ("awq", False, "llama-gqa"),
    ("awq", False, "falcon-40b-like"),
    ("compressed-tensors", True, "qwen3"),
    ("compressed-tensors", False, "llama-gqa"),
]
IDS = [f"{method}-{'sym' if sym else 'asym'}-{case}" for method, sym, case in CASES]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{(method, symmetric, case): (directory, reference model)}."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for method, symmetric, case in CASES:
        directory = root / f"{method}-{symmetric}-{case}"
        model = tiny_models.build(case)
        out[method, symmetric, case] = (
            directory,
            quantized_checkpoints.write(model, directory, method, symmetric),
        )
    return out


def _greedy(model, prompts, steps) -> list[list[int]]:
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            tokens = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False
            )
        out.append(tokens[0, len(prompt) :].tolist())
    return out


@pytest.mark.parametrize(("method", "symmetric", "case"), CASES, ids=IDS)
def test_the_checkpoint_runs_transformers_dequantized_tokens(method, symmetric, case, checkpoints):
    directory, reference = checkpoints[method, symmetric, case]
    llm = LLM(str(directory), device="cpu", dtype="float32", batch_size=4)
    layer = llm.runner.layer_w[0]
    assert all(isinstance(layer[name], QTensor) for name in ("qkv.weight", "mlp_out.weight"))
    assert layer["qkv.weight"].config == (SYMMETRIC if symmetric else ZERO_POINTS)
    assert not isinstance(llm.runner.head_w["lm_head.weight"], QTensor)  # shipped dense
    ours, batch = prefill_logits(llm, PROMPTS)
    ref = hf_logits(reference, batch.prompt_ids, batch.key_valid[:, : batch.prompt_len])
    bound = 1e-5
    for row, prompt in enumerate(PROMPTS):
        real = slice(batch.prompt_len - len(prompt), batch.prompt_len)
        error = (ours[row, real] - ref[row, real]).norm() / ref[row, real].norm()
        assert error <= bound, f"prompt {row}: relative logit error {error:.2e}"
    want = _greedy(reference, PROMPTS, 8)
    for out, ref in zip(llm.generate(PROMPTS, PARAMS), want, strict=True):
        assert out.token_ids == ref[: len(out.token_ids)], f"ours {out.token_ids}, theirs {ref}"


@pytest.mark.parametrize(
    ("method", "symmetric", "case"), [CASES[1], CASES[4], CASES[6]], ids=[IDS[1], IDS[4], IDS[6]]
)
def test_offloaded_runs_keep_the_checkpoints_codes(method, symmetric, case, checkpoints, tmp_path):
    """Weights split three ways (the disk's part from the store) and the KV on the CPU:
    the plain run's tokens; the plan counts the format's bytes, not fp16's."""
    directory, _ = checkpoints[method, symmetric, case]
    fmt = SYMMETRIC if symmetric else ZERO_POINTS
    want = [o.token_ids for o in LLM(str(directory), device="cpu", dtype="float32",
                                     batch_size=8).generate(PROMPTS, PARAMS)]  # fmt: skip
    policies = [
        Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Placement(0.3, 0.4, 0.3),
               weight_compression=fmt),
        Policy(gpu_batch_size=2, num_gpu_batches=2, kv_cache=Placement(0, 1, 0),
               attention_on_cpu=True, weight_compression=fmt),
    ]  # fmt: skip
    for policy in policies:
        with LLM(
            str(directory), device="cpu", dtype="float32", policy=policy, nvme=tmp_path
        ) as llm:
            assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == want, policy
            cfg = llm.config
    # what the plan counts for a layer: the checkpoint's codes (half a byte a weight)
    # and fp16 group parameters, a dense head
    slots = {t.name: t.nbytes for t in stage_layout(cfg, "layer.0", torch.float16, fmt)}
    groups = cfg.qkv_out_features * cfg.hidden_size // quantized_checkpoints.GROUP
    assert slots["qkv.weight"] == cfg.qkv_out_features * cfg.hidden_size // 2
    assert slots["qkv.weight.scale"] == slots["qkv.weight.min"] == 2 * groups
    head = {t.name: t.nbytes for t in stage_layout(cfg, "head", torch.float16, fmt)}
    assert head["lm_head.weight"] == 2 * cfg.vocab_size * cfg.hidden_size


def _edited(directory, tmp_path, change) -> str:
    out = tmp_path / "edited"
    out.mkdir()
    for item in directory.iterdir():
        (out / item.name).symlink_to(item)
    config = json.loads((directory / "config.json").read_text())
    change(config)
    (out / "config.json").unlink()
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda c: c["quantization_config"].update(quant_method="fp8"), "fp8"),
        (lambda c: c["quantization_config"].update(quant_method="bitsandbytes"), "bitsandbytes"),
        (lambda c: c["quantization_config"].update(bits=8), "8 bits"),
        (lambda c: c["quantization_config"].update(group_size=-1), "per-channel"),
    ],
)
def test_formats_that_are_other_math_are_refused_by_name(change, named, checkpoints, tmp_path):
    directory, _ = checkpoints["gptq", False, "llama-gqa"]
    with pytest.raises(UserError, match=named):
        LLM(_edited(directory, tmp_path, change), device="cpu", dtype="float32")


def test_act_order_is_refused_where_it_reorders_groups(checkpoints, tmp_path):
    """desc_act with g_idx in order (static groups) loads; a g_idx that scatters channels
    across groups is refused with its reason before anything runs."""
    from safetensors.torch import load_file, save_file

    directory, _ = checkpoints["gptq", False, "llama-gqa"]
    tensors = load_file(directory / "model.safetensors")
    name = next(n for n in tensors if n.endswith("q_proj.g_idx"))
    tensors[name] = tensors[name].flip(0).contiguous()
    out = tmp_path / "act-order"
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"]["desc_act"] = True
    (out / "config.json").write_text(json.dumps(config))
    tiny_models.save_byte_tokenizer(out)
    with pytest.raises(UserError, match="act-order"):
        LLM(str(out), device="cpu", dtype="float32").generate(PROMPTS[:1], PARAMS)


def test_another_weight_format_is_refused(checkpoints, tmp_path):
    directory, _ = checkpoints["awq", False, "llama-gqa"]
    with pytest.raises(UserError, match="already quantized"):
        LLM(str(directory), device="cpu", dtype="float32", compress="int8", nvme=tmp_path)
    policy = Policy(gpu_batch_size=2, weight_compression=Compression(4, 64))
    with pytest.raises(UserError, match="pre-quantized"):
        LLM(str(directory), device="cpu", dtype="float32", policy=policy, nvme=tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("method", "symmetric", "case"), [CASES[0], CASES[3], CASES[6]], ids=[IDS[0], IDS[3], IDS[6]]
)
def test_cuda_runs_compute_the_dequantized_weights(method, symmetric, case, checkpoints, tmp_path):
    """On CUDA the Triton kernel (zero points: its float32 dequantization) multiplies the
    checkpoint's codes: float32 logits within 1e-4 of the reference, float16 within 2e-2;
    streamed weights (a split with its disk part) give the plain CUDA run's tokens."""
    directory, reference = checkpoints[method, symmetric, case]
    for dtype, bound in (("float32", 1e-4), ("float16", 2e-2)):
        llm = LLM(str(directory), device="cuda", dtype=dtype, batch_size=4)
        ours, batch = prefill_logits(llm, PROMPTS)
        ref = hf_logits(reference, batch.prompt_ids, batch.key_valid[:, : batch.prompt_len])
        for row, prompt in enumerate(PROMPTS):
            real = slice(batch.prompt_len - len(prompt), batch.prompt_len)
            error = (ours[row, real] - ref[row, real]).norm() / ref[row, real].norm()
            assert error <= bound, f"{dtype} prompt {row}: relative logit error {error:.2e}"
    fmt = SYMMETRIC if symmetric else ZERO_POINTS
    plain = LLM(str(directory), device="cuda", dtype="float16", batch_size=8)
    want = [o.token_ids for o in plain.generate(PROMPTS, PARAMS)]
    policy = Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Placement(0.3, 0.4, 0.3),
                    weight_compression=fmt)  # fmt: skip
    with LLM(str(directory), device="cuda", dtype="float16", policy=policy, nvme=tmp_path) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == want


def test_offload_plan_and_convert_keep_the_checkpoints_format(checkpoints, tmp_path, capsys):
    """offload-plan plans the checkpoint's format, and offload-convert writes a store in
    it (a run reading its disk part: `test_offloaded_runs_keep_the_checkpoints_codes`)."""
    from offload.cli import convert, plan

    directory, _ = checkpoints["awq", False, "llama-gqa"]
    profile = tmp_path / "profile.json"
    profile.write_text(
        dataclasses.replace(
            PROFILE, has_gpu=False, gpu_context_bytes=0, process_base_bytes=0
        ).to_json()
    )
    rc = plan.main(
        ["--model", str(directory), "--gpu-mem", "2GB", "--cpu-mem", "3GB", "--json",
         "--prompt-len", "8", "--gen-len", "4", "--num-prompts", "8", "--profile", str(profile)]
    )  # fmt: skip
    assert rc == 0
    chosen = json.loads(capsys.readouterr().out)["policy"]["weight_compression"]
    assert Compression(**chosen) == ZERO_POINTS
    assert convert.main(["--model", str(directory), "--nvme", str(tmp_path), "--quiet"]) == 0
    stores = list(tmp_path.glob("*-int4-g32-zp-dense-head"))
    assert len(stores) == 1, list(tmp_path.iterdir())
    capsys.readouterr()
    assert convert.main(["--model", str(directory), "--nvme", str(tmp_path), "--compress", "int8"])
    assert "already quantized" in capsys.readouterr().err
