"""CPU decode attention (the C kernel of `kernels/cpu_attention.py` and the torch path
it falls back to) against its references: torch SDPA over the full-precision cache,
SDPA over the dequantized compressed cache (`kv_attention.decode_attention_reference`).

Bound (the kernel cases'): the error against a float64 truth is within 2x the error of
torch's own SDPA at the dtype, plus a floor of 1e-6 of the output's scale.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from offload.kernels import cpu_attention, native
from offload.kernels.formats import Compression
from offload.kernels.kv_attention_cpu import decode_attention_cpu, decode_attention_cpu_torch
from offload.kernels.kv_cache import QuantKV
from offload.models.attention import attend

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parent.parent
dense_runs = pytest.mark.skipif(
    not cpu_attention.available(compressed=False),
    reason="the C kernel does not run here for a full-precision cache (no compiler or AVX-512)",
)
quant_runs = pytest.mark.skipif(
    not cpu_attention.available(compressed=True), reason="no C compiler with OpenMP here"
)


def _sdpa(q, keys, values, bias):
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, enable_gqa=True)
    return out.transpose(1, 2).flatten(2)


def _bias(batch, heads, slots, dtype, gen):
    """Random additive bias, the first third of row 0 masked (left padding)."""
    bias = torch.randn(batch, heads, 1, slots, generator=gen)
    bias[0, ..., : slots // 3] = torch.finfo(dtype).min
    return bias.to(dtype)


def _within_bound(ours, q, keys, values, bias, exact=None) -> str | None:
    """None if `ours` is within the bound, else what differs; `exact`: the float64 K/V
    the dtype's keys/values were rounded from (a compressed cache's)."""
    exact = exact or (keys.double(), values.double())
    truth = _sdpa(q.double(), *exact, bias.double())
    torch_err = (_sdpa(q, keys, values, bias).double() - truth).abs().max().item()
    our_err = (ours.double() - truth).abs().max().item()
    bound = 2 * torch_err + 1e-6 * truth.abs().max().item()
    if ours.shape != truth.shape or ours.dtype != q.dtype or not our_err <= bound:
        return f"{tuple(ours.shape)} {ours.dtype}: error {our_err:.3g} > bound {bound:.3g}"
    return None


# (batch, query heads, KV heads, head_dim, slots, per-head bias): grouped and plain
# heads (8 query heads a KV head: Llama-2-70B's), head_dim 80 (5 vectors), contexts
# not a multiple of the 64-token block, one past a split (SPLIT_TOKENS)
DENSE_SHAPES = [
    (2, 8, 2, 64, 150, False),
    (3, 4, 4, 80, 64, True),
    (1, 12, 4, 128, 70, True),
    (2, 6, 1, 32, 17, False),
    (2, 16, 2, 128, 200, False),
    (1, 4, 2, 32, 1100, False),
]


@dense_runs
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dense_decode_attention_matches_sdpa(dtype):
    gen = torch.Generator().manual_seed(1)
    failures = []
    for batch, heads, kv_heads, dim, slots, per_head in DENSE_SHAPES:
        keys = (torch.randn(batch, kv_heads, slots, dim, generator=gen) * 2).to(dtype)
        values = torch.randn(batch, kv_heads, slots, dim, generator=gen).to(dtype)
        q = torch.randn(batch, heads, 1, dim, generator=gen).to(dtype)
        bias = _bias(batch, heads if per_head else 1, slots, dtype, gen)
        ours = cpu_attention.decode_attention_dense(q, keys, values, bias)
        failure = _within_bound(ours, q, keys, values, bias)
        if failure:
            failures.append(f"B{batch} H{heads}/{kv_heads} D{dim} S{slots}: {failure}")
    assert failures == []


@dense_runs
def test_dense_decode_attention_reads_the_executors_views():
    """The executor's homes: a CPU home is a prefix of a larger buffer, a disk home a
    permuted slot-major view; attend (the decode branch) runs the kernel over both."""
    gen = torch.Generator().manual_seed(2)
    batch, heads, kv_heads, dim, slots, end = 3, 8, 2, 64, 300, 213
    home = torch.randn(batch, kv_heads, slots, dim, generator=gen).half()
    disk = torch.randn(slots, batch, kv_heads, dim, generator=gen).half()
    q = torch.randn(batch, heads, 1, dim, generator=gen).half()
    bias = _bias(batch, 1, end, torch.float16, gen)
    keys, values = home[:, :, :end], disk[:end].permute(1, 2, 0, 3)
    ours = attend(q, keys, values, bias)
    assert _within_bound(ours, q, keys.contiguous(), values.contiguous(), bias) is None


@dense_runs
def test_results_depend_on_neither_batch_nor_threads():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(4, 2, 1500, 64, generator=gen)
    values = torch.randn(4, 2, 1500, 64, generator=gen)
    q = torch.randn(4, 8, 1, 64, generator=gen)
    bias = torch.zeros(4, 1, 1, 1500)
    threads = torch.get_num_threads()
    whole = cpu_attention.decode_attention_dense(q, keys, values, bias)
    try:
        torch.set_num_threads(1)
        alone = cpu_attention.decode_attention_dense(q[2:3], keys[2:3], values[2:3], bias[2:3])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole[2:3], alone)


# (batch, query heads, KV heads, head_dim, token group, slots, prefill length,
# per-head bias): the kernel cases' shapes (a head_dim of 80: value units of 16
# channels; groups of 16: key units of 8 bytes) and Llama-2-70B's 8 heads a KV head
QUANT_SHAPES = [
    (2, 8, 2, 64, 64, 150, 100, False),
    (3, 4, 4, 80, 32, 64, 64, True),
    (1, 12, 4, 128, 64, 70, 1, True),
    (2, 6, 1, 32, 16, 17, 9, False),
    (1, 16, 2, 128, 128, 300, 290, False),
    (1, 4, 2, 32, 16, 1100, 1090, False),
]


def _quant_failures(attention, bits, symmetric, slot_major=False) -> list[str]:
    """`attention` over a compressed cache filled by a prefill then token by token,
    at the first and last steps and around group boundaries, fp32 and fp16."""
    failures = []
    gen = torch.Generator().manual_seed(bits * 10 + symmetric)
    for dtype in (torch.float32, torch.float16):
        for batch, heads, kv_heads, dim, group, slots, prefill, per_head in QUANT_SHAPES:
            config = Compression(bits, group, symmetric)
            cache = QuantKV(batch, kv_heads, dim, slots, config, dtype, CPU, slot_major=slot_major)
            k = (torch.randn(batch, kv_heads, slots, dim, generator=gen) * 2).to(dtype)
            k[..., 1] *= 8  # an outlier channel, as rotary keys have
            v = torch.randn(batch, kv_heads, slots, dim, generator=gen).to(dtype)
            bias = _bias(batch, heads if per_head else 1, slots, dtype, gen)
            cache.write(k[:, :, :prefill], v[:, :, :prefill], 0)
            for end in range(prefill + 1, slots + 1):
                cache.write(k[:, :, end - 1 : end], v[:, :, end - 1 : end], end - 1)
                if end not in (prefill + 1, slots) and end % group not in (0, 1):
                    continue
                q = torch.randn(batch, heads, 1, dim, generator=gen).to(dtype)
                ours = attention(q, cache, bias, end)
                exact = cache.dequantized(end, torch.float64)
                keys, values = cache.dequantized(end)
                failure = _within_bound(ours, q, keys, values, bias[..., :end], exact)
                if failure:
                    failures.append(
                        f"int{bits} sym={symmetric} {dtype} B{batch} H{heads}/{kv_heads} "
                        f"D{dim} g{group} end {end}: {failure}"
                    )
    return failures


@quant_runs
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_quant_decode_attention_matches_reference(bits, symmetric):
    assert _quant_failures(cpu_attention.decode_attention_quant, bits, symmetric) == []


@quant_runs
def test_quant_decode_attention_reads_the_slot_major_layout():
    assert _quant_failures(cpu_attention.decode_attention_quant, 4, False, slot_major=True) == []


@pytest.mark.parametrize("bits", [4, 8])
def test_torch_fallback_matches_reference(bits):
    assert _quant_failures(decode_attention_cpu_torch, bits, False) == []


def test_offload_native_0_runs_the_torch_paths(monkeypatch):
    monkeypatch.setenv("OFFLOAD_NATIVE", "0")
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 1, 64, generator=gen)
    keys, values = torch.randn(2, 2, 2, 40, 64, generator=gen)
    bias = torch.zeros(2, 1, 1, 40)
    assert cpu_attention.decode_attention_dense(q, keys, values, bias) is None
    cache = QuantKV(2, 2, 64, 40, Compression(4, 16), torch.float32, CPU)
    cache.write(keys, values, 0)
    assert cpu_attention.decode_attention_quant(q, cache, bias, 40) is None
    assert _within_bound(attend(q, keys, values, bias), q, keys, values, bias) is None
    assert torch.equal(
        decode_attention_cpu(q, cache, bias, 40), decode_attention_cpu_torch(q, cache, bias, 40)
    )


def test_a_failed_build_falls_back_with_a_warning(monkeypatch, tmp_path):
    monkeypatch.setenv("OFFLOAD_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    with pytest.warns(UserWarning, match="could not build"):
        assert native.load_library("broken", "int f(void) { return 1; }") is None


def _cpu_flags() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def test_the_build_has_the_vector_width_asked_for():
    """512-bit vectors where AVX-512 is, 256 for an AVX2 build (OFFLOAD_NATIVE_ARCH)."""
    lib = cpu_attention._library() if native.enabled() else None
    if lib is None:
        pytest.skip("no C compiler with OpenMP here")
    if os.environ.get("OFFLOAD_NATIVE_ARCH") == "haswell":
        assert lib.vector_bits() == 256
    elif " avx512f" in _cpu_flags():
        assert lib.vector_bits() == 512


@pytest.mark.skipif(
    " avx512f" not in _cpu_flags() or os.environ.get("OFFLOAD_NATIVE_ARCH") is not None,
    reason="runs the AVX2 build where CI's AVX-512 one runs",
)
def test_the_avx2_build_matches_too():
    """The kernel's 8-float build (AVX2 machines), these tests again in a subprocess."""
    env = {**os.environ, "OFFLOAD_NATIVE_ARCH": "haswell", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:]
