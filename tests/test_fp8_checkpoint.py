"""FP8 block-scaled checkpoints (DeepSeek-V3's and Kimi-K2's format) read as shipped:
the dequantized weights bit for bit transformers' own (its CPU load where it loads the
checkpoint, the documented formula where its sides are not multiples of the block),
the tokens of transformers' class computing with them, plain and offloaded, the plan
counting fp8's bytes, --compress int4 converting from the dequantized values, and a
format offload cannot read refused by name before the load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from offload.api.llm import LLM
from offload.api.plan_formats import weight_formats
from offload.core.errors import UserError
from offload.core.sampling import SamplingParams
from offload.io.layout import stage_image_bytes, stage_layout
from offload.kernels.formats import Compression
from offload.kernels.quant import QTensor, dequantize
from offload.models.checkpoint import CheckpointSource
from offload.models.resolve import resolve_model
from offload.policies.cost_moe import streamed_bytes
from offload.policies.memory import weight_plan
from offload.policies.policy import Placement, Policy
from tests import fp8_checkpoints
from tests.tiny_models import hf_logits, prefill_logits

ROOT = Path(__file__).resolve().parent.parent
FP8 = Compression(8, 128, True, head=False, fp8=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34], [300, 1, 2, 250]]
STEPS = 8
PARAMS = SamplingParams(max_tokens=STEPS)
_dims = {"vocab_size": 320, "hidden_size": 256, "num_attention_heads": 4,
         "num_key_value_heads": 2, "num_hidden_layers": 2, "tie_word_embeddings": False}  # fmt: skip
CASES = {
    # every side a multiple of 128: transformers' own CPU load reads it
    "llama": (LlamaForCausalLM, LlamaConfig(**_dims, intermediate_size=384)),
    # gate | up of 320 rows and down's 320 columns end in partial blocks; qkv biases
    "qwen2-edges": (Qwen2ForCausalLM, Qwen2Config(**_dims, intermediate_size=320)),
    # experts of 192: partial blocks; the router ships in bfloat16
    "mixtral": (
        MixtralForCausalLM,
        MixtralConfig(**_dims, intermediate_size=192, num_local_experts=4, num_experts_per_tok=2),
    ),
}


def _build(case: str) -> torch.nn.Module:
    cls, config = CASES[case]
    torch.manual_seed(67)
    model = cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn_like(param) * 0.1)
            if name.endswith("block_sparse_moe.gate.weight"):  # clear margins between experts
                param.mul_(10)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{case: (fp8 directory, dense directory of its dequantized values, the values)}."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for case in CASES:
        directory, dense = root / case, root / f"{case}-dequantized"
        out[case] = directory, dense, fp8_checkpoints.write(_build(case), directory, dense)
    return out


def _reference(dense) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()


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


def _layer(directory, dtype):
    spec = resolve_model(str(directory))
    with CheckpointSource(directory, spec.config) as source:
        return source.layer(0, dtype, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantized_weights_are_transformers_own(dtype, checkpoints):
    """transformers loads the checkpoint on the CPU by dequantizing it to the model's
    dtype; ours are those tensors bit for bit (q | k | v and gate | up fused)."""
    directory, _, _ = checkpoints["llama"]
    theirs = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).model.layers[0]
    ours = _layer(directory, dtype)
    assert all(isinstance(ours[n], QTensor) and ours[n].config == FP8
               for n in ("qkv.weight", "o.weight", "mlp_in.weight", "mlp_out.weight"))  # fmt: skip
    attn, mlp = theirs.self_attn, theirs.mlp
    expected = {
        "qkv.weight": torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
        "o.weight": attn.o_proj.weight,
        "mlp_in.weight": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
        "mlp_out.weight": mlp.down_proj.weight,
    }
    for name, want in expected.items():
        got = dequantize(ours[name])
        assert got.dtype == want.dtype == dtype
        assert torch.equal(got, want), name


@pytest.mark.parametrize("case", ["qwen2-edges", "mixtral"])
def test_partial_blocks_dequantize_by_the_formula(case, checkpoints):
    """Sides that are not multiples of 128 (which transformers' CPU load refuses): each
    value is the code times its block's scale, computed block by block in the test."""
    directory, _, values = checkpoints[case]
    ours = _layer(directory, torch.bfloat16)
    p = "model.layers.0."
    if case == "mixtral":
        e = p + "block_sparse_moe.experts.1."
        pairs = {"experts.1.mlp_in.weight": [e + "w1.weight", e + "w3.weight"],
                 "experts.1.mlp_out.weight": [e + "w2.weight"]}  # fmt: skip
        assert not isinstance(ours["router.weight"], QTensor)  # shipped in bfloat16
    else:
        pairs = {"mlp_in.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                 "mlp_out.weight": [p + "mlp.down_proj.weight"]}  # fmt: skip
    for name, hf_names in pairs.items():
        want = torch.cat([values[n] for n in hf_names]).to(torch.bfloat16)
        assert torch.equal(dequantize(ours[name]), want), name


@pytest.mark.parametrize("case", list(CASES))
def test_the_checkpoint_runs_transformers_dequantized_tokens(case, checkpoints):
    """float32 logits within 1e-5 of transformers' class on the dequantized weights,
    greedy tokens equal."""
    directory, dense, _ = checkpoints[case]
    reference = _reference(dense)
    llm = LLM(str(directory), device="cpu", dtype="float32", batch_size=4)
    ours, batch = prefill_logits(llm, PROMPTS)
    ref = hf_logits(reference, batch.prompt_ids, batch.key_valid[:, : batch.prompt_len])
    for row, prompt in enumerate(PROMPTS):
        real = slice(batch.prompt_len - len(prompt), batch.prompt_len)
        error = (ours[row, real] - ref[row, real]).norm() / ref[row, real].norm()
        assert error <= 1e-5, f"prompt {row}: relative logit error {error:.2e}"
    want = _greedy(reference, PROMPTS, STEPS)
    for out, theirs in zip(llm.generate(PROMPTS, PARAMS), want, strict=True):
        assert out.token_ids == theirs[:STEPS], f"ours {out.token_ids}, theirs {theirs}"


@pytest.mark.parametrize("case", ["qwen2-edges", "mixtral"])
def test_offloaded_runs_stream_the_fp8_codes(case, checkpoints, tmp_path):
    """Weights split three ways (the disk's part from the store, in fp8) and the KV on
    the CPU give the plain run's tokens; the plan counts a byte a value and float32
    scales a row and block, not fp16's two bytes."""
    directory, _, _ = checkpoints[case]
    plain = LLM(str(directory), device="cpu", dtype="float32", batch_size=8)
    want = [o.token_ids for o in plain.generate(PROMPTS, PARAMS)]
    policies = [
        Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Placement(0.3, 0.4, 0.3),
               weight_compression=FP8),
        Policy(gpu_batch_size=2, num_gpu_batches=2, kv_cache=Placement(0, 1, 0),
               attention_on_cpu=True, weight_compression=FP8),
    ]  # fmt: skip
    for policy in policies:
        with LLM(
            str(directory), device="cpu", dtype="float32", policy=policy, nvme=tmp_path
        ) as llm:
            assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == want, policy
            cfg = llm.config
    slots = {t.name: t.nbytes for t in stage_layout(cfg, "layer.0", torch.bfloat16, FP8)}
    big = "experts.0.mlp_out.weight" if case == "mixtral" else "mlp_out.weight"
    out_rows, in_cols = cfg.hidden_size, 320 if case == "qwen2-edges" else 192
    assert slots[big] == out_rows * in_cols
    assert slots[big + ".scale"] == 4 * out_rows * -(-in_cols // 128)
    head = {t.name: t.nbytes for t in stage_layout(cfg, "head", torch.bfloat16, FP8)}
    assert head["lm_head.weight"] == 2 * cfg.vocab_size * cfg.hidden_size  # dense
    # the memory plan holds those images; the cost model streams a layer at 0.53 of bf16
    plan = weight_plan(cfg, policies[0], torch.bfloat16)
    held = sum(plan[f"weights_{tier}"] for tier in ("gpu", "cpu", "disk"))
    assert held == sum(stage_image_bytes(cfg, torch.bfloat16, FP8))
    fp8_layer, bf16_layer = (streamed_bytes(cfg, torch.bfloat16, c)[1] for c in (FP8, None))
    assert fp8_layer < 0.55 * bf16_layer


def test_compress_int4_converts_from_the_dequantized_values(checkpoints, tmp_path):
    """--compress int4 (a policy in int4) on the fp8 checkpoint: the run of the dense
    checkpoint of its dequantized values in int4, logits and tokens alike."""
    directory, dense, _ = checkpoints["qwen2-edges"]
    int4 = Compression(4, 64)
    policy = Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Placement(0.5, 0.2, 0.3),
                    weight_compression=int4)  # fmt: skip
    runs = []
    for source in (directory, dense):
        with LLM(str(source), device="cpu", dtype="float32", policy=policy,
                 nvme=tmp_path / source.name) as llm:  # fmt: skip
            ours, _ = prefill_logits(llm, PROMPTS)
            runs.append((ours, [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]))
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]
    # --compress int4 plans int4; none and auto keep the checkpoint's fp8
    assert weight_formats(FP8, "int4", (int4,)) == (int4,)
    assert (
        weight_formats(FP8, "none", (None,)) == weight_formats(FP8, "auto", (None, int4)) == (FP8,)
    )


def _edited(directory, tmp_path, change) -> str:
    out = tmp_path / "edited"
    out.mkdir()
    for item in directory.iterdir():
        (out / item.name).symlink_to(item)
    config = json.loads((directory / "config.json").read_text())
    change(config["quantization_config"])
    (out / "config.json").unlink()
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda q: q.update(fmt="e5m2"), "fmt 'e5m2'"),
        (lambda q: q.pop("weight_block_size"), "without weight_block_size"),
        (lambda q: q.update(weight_block_size=[64, 64]), r"weight_block_size \[64, 64\]"),
        (lambda q: q.update(activation_scheme="static"), "activation_scheme 'static'"),
    ],
)
def test_a_format_offload_cannot_read_is_refused_in_one_line(change, named, checkpoints, tmp_path):
    directory, _, _ = checkpoints["llama"]
    edited = _edited(directory, tmp_path, change)
    with pytest.raises(UserError, match=named) as refused:
        resolve_model(edited)  # the model's resolution, before any weight is read
    assert "\n" not in str(refused.value)
    with pytest.raises(UserError, match=named):
        LLM(edited, device="cpu", dtype="float32")


def test_fp8_kernels_match_their_reference_interpreted():
    """The Triton matmul and dequantization (`tests/fp8_cases.py`) under the interpreter,
    in a subprocess: TRITON_INTERPRET is read at import."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "tests.fp8_cases"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


@pytest.mark.gpu
def test_fp8_kernels_match_their_reference_compiled(monkeypatch):
    """The same cases compiled, bfloat16 too; on FP8 GPUs both decodings of e4m3."""
    from offload.kernels import fp8
    from tests import fp8_cases

    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    failed = fp8_cases.dequant_cases("cuda", dtypes) + fp8_cases.matmul_cases("cuda", dtypes)
    assert failed == []
    if fp8.native(torch.device("cuda")):
        monkeypatch.setattr(fp8, "native", lambda device: False)
        assert (
            fp8_cases.dequant_cases("cuda", dtypes) + fp8_cases.matmul_cases("cuda", dtypes) == []
        )


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["qwen2-edges", "mixtral"])
def test_cuda_runs_compute_with_the_fp8_codes(case, checkpoints, tmp_path):
    """On CUDA the kernel multiplies the checkpoint's codes: float32 logits within 1e-4
    of transformers' class on the dequantized weights, bfloat16 within 2e-2; streamed
    weights (a split with its disk part) give the plain CUDA run's tokens."""
    directory, dense, _ = checkpoints[case]
    reference = _reference(dense)
    for dtype, bound in (("float32", 1e-4), ("bfloat16", 2e-2)):
        llm = LLM(str(directory), device="cuda", dtype=dtype, batch_size=4)
        assert isinstance(llm.runner.layer_w[0]["qkv.weight"], QTensor)
        ours, batch = prefill_logits(llm, PROMPTS)
        ref = hf_logits(reference, batch.prompt_ids, batch.key_valid[:, : batch.prompt_len])
        for row, prompt in enumerate(PROMPTS):
            real = slice(batch.prompt_len - len(prompt), batch.prompt_len)
            error = (ours[row, real] - ref[row, real]).norm() / ref[row, real].norm()
            assert error <= bound, f"{dtype} prompt {row}: relative logit error {error:.2e}"
        llm.close()
    plain = LLM(str(directory), device="cuda", dtype="bfloat16", batch_size=8)
    want = [o.token_ids for o in plain.generate(PROMPTS, PARAMS)]
    plain.close()
    policy = Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Placement(0.3, 0.4, 0.3),
                    weight_compression=FP8)  # fmt: skip
    with LLM(str(directory), device="cuda", dtype="bfloat16", policy=policy, nvme=tmp_path) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == want
