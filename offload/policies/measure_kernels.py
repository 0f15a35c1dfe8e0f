"""The profile's GPU kernel figures, per storage format: the matmuls at decode and
prefill shapes (ours and cuBLAS's) and decode attention, each through the kernels the
executor runs; and the prefill attention's rate."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from offload.kernels.formats import Compression
from offload.kernels.kv_attention import decode_attention
from offload.kernels.kv_cache import QuantKV
from offload.kernels.qmatmul import qlinear
from offload.kernels.quant import quantize
from offload.models.attention import attend
from offload.policies.hardware import (
    DECODE_ROWS,
    GB,
    MID_DECODE_ROWS,
    WIDE_DECODE_ROWS,
    format_name,
)
from offload.policies.timers import fit_call, kernel_seconds, timed

# the formats whose matmul and attention rates a profile holds
FORMATS = (None, Compression(8, 64, False), Compression(4, 64, False))


def matmul_tflops(m: int, k: int, n: int, device: torch.device, dtype: torch.dtype) -> float:
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    return 2 * m * k * n / timed(lambda: a @ b, repeat=3) / 1e12


# the rows at which a compressed format's fused prefill kernel is measured: a micro-
# batch of a few short prompts (fewer than qmatmul.DENSE_ROWS tokens) runs it
FUSED_PREFILL_ROWS = 512


@dataclass(frozen=True)
class MatmulRates:
    """Per format (`hardware.format_name`), the profile's matmul figures."""

    decode_gbps: dict[str, float]  # stored bytes a second, DECODE_ROWS rows
    wide_gbps: dict[str, float]  # the same at WIDE_DECODE_ROWS
    mid_gbps: dict[str, float]  # and at MID_DECODE_ROWS
    call_s: dict[str, float]  # a decode call's fixed time
    prefill_tflops: dict[str, float]
    dequant_gbps: dict[str, float]


# (N, K) of the four matmuls of two layers that a profile times at decode rows: a
# 4096-wide (Llama-3.1-8B's: qkv, out, gate and up, down) and an 8192-wide one (a
# 70B-class model's), so the fitted rate and call time are those of whole layers,
# which is what the cost model charges a layer (one 8192 x 28672 matrix alone does not
# stand for every layer). The fused kernel's rate depends on a matrix's shape, not only
# its bytes: at 16 rows on the H100, OPT-30B's qkv (21504 x 7168) read 55% of HBM and
# Llama-2-70B's gate and up (57344 x 8192) 74% (docs/throughput.md). OPT-30B's layer
# is slower than both of these (about 1.7 TB/s in W1c's job against 2.31 fitted): a
# rate by matrix shape is not modeled
LAYER_MATRICES = {
    "cuda": (
        ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)),
        ((10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)),
    ),
    "cpu": (
        ((384, 256), (256, 256), (1024, 256), (256, 512)),
        ((768, 512), (512, 512), (2048, 512), (512, 1024)),
    ),
}


def _layer_matrices(
    shapes: tuple[tuple[int, int], ...], config, device: torch.device, dtype: torch.dtype
) -> list:
    """A layer's matrices (N x K), stored in `config`'s format (None: dense)."""
    out = []
    for n, k in shapes:
        w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
        out.append(w if config is None else quantize(w, config))
        del w
    return out


def _layer_seconds(matrices: list, rows: int, device: torch.device, dtype: torch.dtype) -> float:
    """The kernel time of a layer's matmuls at `rows` rows, one after another."""
    call = F.linear if isinstance(matrices[0], torch.Tensor) else qlinear
    inputs = [torch.randn(rows, w.shape[1], device=device, dtype=dtype) for w in matrices]

    def layer() -> None:
        for x, w in zip(inputs, matrices, strict=True):
            call(x, w)

    return kernel_seconds(layer)


def matmul_rates(k: int, n: int, device: torch.device, dtype: torch.dtype) -> MatmulRates:
    """Per format: the stored weight bytes a layer's decode matmuls read a second at
    DECODE_ROWS, MID_DECODE_ROWS and WIDE_DECODE_ROWS rows beyond each call's fixed
    time, fitted from LAYER_MATRICES' two layers (`fit_call` at DECODE_ROWS; the wide
    layer beyond that fixed time at the others); on one [n, k] matrix, TFLOP/s at
    prefill rows (dense: cuBLAS at 4096 rows; compressed: the fused kernel at
    FUSED_PREFILL_ROWS) and, compressed, the stored bytes a second the 4096-row matmul
    dequantizes (its time beyond cuBLAS's on the dense weight)."""
    w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
    prefill_rows = 4096 if device.type == "cuda" else 256
    prefill_x = torch.randn(prefill_rows, k, device=device, dtype=dtype)
    fused_x = prefill_x[: min(FUSED_PREFILL_ROWS, prefill_rows // 2)]
    rates = MatmulRates({}, {}, {}, {}, {}, {})
    dense_s = timed(lambda: F.linear(prefill_x, w), repeat=3)
    narrow_shapes, wide_shapes = LAYER_MATRICES[device.type]
    calls = len(narrow_shapes)
    for config in FORMATS:
        name = format_name(config)
        layers = []
        for shapes in (narrow_shapes, wide_shapes):
            matrices = _layer_matrices(shapes, config, device, dtype)
            nbytes = sum(m.nbytes for m in matrices)  # (dense or `QTensor`: as stored)
            layers.append((matrices, nbytes, _layer_seconds(matrices, DECODE_ROWS, device, dtype)))
        (_, narrow_bytes, narrow_s), (wide, wide_bytes, wide_s) = layers
        rate, fixed = fit_call((narrow_bytes, narrow_s), (wide_bytes, wide_s))
        rates.decode_gbps[name], rates.call_s[name] = rate, fixed / calls
        for figure, rows in (
            (rates.wide_gbps, WIDE_DECODE_ROWS),
            (rates.mid_gbps, MID_DECODE_ROWS),
        ):
            seconds = _layer_seconds(wide, rows, device, dtype)
            figure[name] = wide_bytes / max(seconds - fixed, 0.5 * seconds) / GB
        del layers, wide
        if config is None:
            rates.prefill_tflops[name] = 2 * prefill_rows * k * n / dense_s / 1e12
            continue
        stored = quantize(w, config)
        seconds = timed(lambda s=stored: qlinear(fused_x, s), repeat=3)
        rates.prefill_tflops[name] = 2 * fused_x.shape[0] * k * n / seconds / 1e12
        # noise can make the difference tiny: at least 2% of the matmul
        extra = timed(lambda s=stored: qlinear(prefill_x, s), repeat=3) - dense_s
        rates.dequant_gbps[name] = stored.nbytes / max(extra, 0.02 * dense_s) / GB
        del stored
    return rates


def prefill_attention_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """TFLOP/s (4 x rows x T x S x heads x dim) of the executor's masked prefill
    attention at a 512-token prompt."""
    rows, heads, t, dim = (4, 32, 512, 128) if device.type == "cuda" else (1, 4, 128, 64)
    q, k, v = (torch.randn(rows, heads, t, dim, device=device, dtype=dtype) for _ in range(3))
    bias = torch.zeros(rows, 1, t, t, device=device, dtype=dtype)
    bias.masked_fill_(torch.ones(t, t, device=device, dtype=torch.bool).triu(1), float("-inf"))
    return 4 * rows * t * t * heads * dim / timed(lambda: attend(q, k, v, bias)) / 1e12


# (rows, slots) of the three decode attention calls a profile fits its GPU attention
# figures to (`fit_attention`), 32 heads of 128 channels each: few and many sequences at
# a short context, many at a long one. The slots hold a tail (an incomplete group of a
# compressed cache's, as a decode step's context almost always does)
ATTENTION_POINTS = ((4, 544), (32, 544), (32, 2080))


def fit_attention(
    points: list[tuple[int, float, float]],
) -> tuple[float, float, float]:
    """(GB/s, fixed seconds a call, seconds a (sequence, KV head) pair) of decode
    attention calls taking fixed + pairs x pair + bytes / rate, from the (pairs, bytes,
    seconds) of ATTENTION_POINTS' calls: the rate from the two with many pairs (the
    same pairs, more bytes), the pair's time from the two at the short context (the
    time beyond their bytes, by pairs), the fixed time from the small call. A term
    that comes out negative (noise, or none to see) is 0, and the rate is then the
    long call's alone."""
    (p_small, b_small, t_small), (p_short, b_short, t_short), (_, b_long, t_long) = points
    if t_long <= t_short:
        return b_long / t_long / GB, 0.0, 0.0
    per_byte = (t_long - t_short) / (b_long - b_short)
    pair = max(0.0, (t_short - t_small - per_byte * (b_short - b_small)) / (p_short - p_small))
    fixed = max(0.0, t_small - pair * p_small - per_byte * b_small)
    return 1 / per_byte / GB, fixed, pair


def gpu_attention_rates(
    device: torch.device, dtype: torch.dtype
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Per format: the cache bytes (as stored) decode attention on the GPU reads a
    second, a call's fixed time and a (sequence, KV head) pair's (`fit_attention`)."""
    heads, dim = 32, 128
    rates, call_s, pair_s = {}, {}, {}
    for config in FORMATS:
        points = []
        for rows, slots in ATTENTION_POINTS:
            q = torch.randn(rows, heads, 1, dim, device=device, dtype=dtype)
            k = torch.randn(rows, heads, slots, dim, device=device, dtype=dtype)
            v = torch.randn_like(k)
            bias = torch.zeros(rows, 1, 1, slots, device=device, dtype=dtype)
            if config is None:
                nbytes = 2 * k.numel() * k.element_size()
                seconds = kernel_seconds(functools.partial(attend, q, k, v, bias))
            else:
                cache = QuantKV(rows, heads, dim, slots, config, dtype, device)
                cache.write(k, v, 0)
                nbytes = cache.nbytes
                seconds = kernel_seconds(functools.partial(decode_attention, q, cache, bias, slots))
            points.append((rows * heads, nbytes, seconds))
        name = format_name(config)
        rates[name], call_s[name], pair_s[name] = fit_attention(points)
    return rates, call_s, pair_s
