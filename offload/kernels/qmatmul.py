"""Dequantize-and-multiply: y = x @ dequantize(W)^T (+ bias) for a group-wise quantized W.

W [N, K] is stored as `quant.QTensor`: codes [N, K / G, G x bits / 8] (int4 packed two a
byte, low nibble first), fp16 scale (and minimum, asymmetric) [N, K / G, 1]. The Triton
kernel reads the codes and the group parameters, dequantizes one group of every W row
in registers and multiplies it into an fp32 accumulator with `tl.dot`: the full-
precision weight never exists in memory. One kernel serves decode shapes (a few to a
few hundred rows of x; the W read dominates, so tiles are wide in N) and prefill shapes
(tiles in M and N); the launcher picks the tiles from the shape.

`qlinear_reference` is the plain-torch definition (dequantize, then `F.linear`) that the
kernel must match; it also runs wherever Triton or CUDA is absent (the CPU tests).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from offload.kernels.quant import QTensor, dequantize

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs instead
    triton = None


def qlinear_reference(x: torch.Tensor, w: QTensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, dequantize(w).to(x.dtype), bias)


# Triton reads TRITON_INTERPRET when it is imported; so do we (not on every matmul)
_INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"


def use_kernel(x: torch.Tensor) -> bool:
    """The Triton kernel runs on CUDA tensors, or anywhere under TRITON_INTERPRET=1."""
    return triton is not None and (x.is_cuda or _INTERPRETED)


def qlinear(
    x: torch.Tensor, w: QTensor, bias: torch.Tensor | None = None, tiles: tuple | None = None
) -> torch.Tensor:
    """x [..., K] (fp16/bf16/fp32) times the quantized W [N, K]; returns [..., N] in x's dtype.

    tiles overrides `_tiles(m, n)` (the kernel benchmark's tile sweep)."""
    if not use_kernel(x):
        return qlinear_reference(x, w, bias)
    n, k = w.shape
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    cfg = w.config
    block_m, block_n, max_k, warps, stages = tiles or _tiles(m, n)
    block_k = next(
        b
        for b in (256, 128, 64, cfg.group_size)
        if (b <= max_k or b == cfg.group_size) and b % cfg.group_size == 0 and k % b == 0
    )
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _qmatmul_kernel[grid](
        rows,
        w.codes,
        w.scale,
        w.minimum if w.minimum is not None else w.scale,
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        rows.stride(0),
        BITS=cfg.bits,
        GROUP=cfg.group_size,
        SYMMETRIC=cfg.symmetric,
        HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        STAGES=stages,
        num_warps=warps,
    )
    return out.view(*x.shape[:-1], n)


def _tiles(m: int, n: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, largest K step, warps, pipeline stages) for [m, K] x [K, n].

    Decode (m <= 64): one M tile and 64-wide N tiles, so that even the smallest layer
    spreads its weight read over every SM; K steps of up to 256 (several groups) keep
    enough bytes in flight; prefill: 128 x 128 tiles with K steps of 64 (shared memory)."""
    if m <= 16:
        return 16, 64, 256, 4, 4
    if m <= 64:
        return 64, 64, 128, 4, 3
    return 128, 128, 64, 8, 3  # (128 + 128) x 64 x 2 bytes a stage: fits shared memory


if triton is not None:

    @triton.jit
    def dequant(codes, scale, minimum, BITS: tl.constexpr, SYMMETRIC: tl.constexpr):
        """Codes (uint8, any shape) to float32 values, the fp16 scale (and minimum)
        broadcast against them. (The same arithmetic in float16 measured up to 17x
        torch's error on asymmetric groups with large minimums: kept in float32.)"""
        values = codes.to(tl.float32)
        scale = scale.to(tl.float32)
        if SYMMETRIC:
            return (values - ((1 << BITS) - 1) // 2) * scale
        return values * scale + minimum.to(tl.float32)

    # M (rows: tokens) varies with the batch; not specialized on (a compile of about a
    # second each time M is 1 or a multiple of 16)
    @triton.jit(do_not_specialize=["M"])
    def _qmatmul_kernel(
        x_ptr,
        codes_ptr,
        scale_ptr,
        min_ptr,
        bias_ptr,
        out_ptr,
        M,
        N,
        K: tl.constexpr,
        stride_xm,
        BITS: tl.constexpr,
        GROUP: tl.constexpr,
        SYMMETRIC: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        STAGES: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        groups = K // GROUP
        row_bytes = K * BITS // 8
        PER_STEP: tl.constexpr = BLOCK_K // GROUP  # groups per K step
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        kk = tl.arange(0, BLOCK_K)
        gg = tl.arange(0, PER_STEP)
        for step in tl.range(0, K // BLOCK_K, num_stages=STAGES):
            xt = tl.load(
                x_ptr + rm[:, None] * stride_xm + (step * BLOCK_K + kk)[None, :],
                mask=m_ok[:, None],
                other=0.0,
            )
            if BITS == 8:
                codes = tl.load(
                    codes_ptr + rn[:, None] * row_bytes + step * BLOCK_K + kk[None, :],
                    mask=n_ok[:, None],
                    other=0,
                )
            else:
                half = tl.arange(0, BLOCK_K // 2)
                packed = tl.load(
                    codes_ptr + rn[:, None] * row_bytes + step * (BLOCK_K // 2) + half[None, :],
                    mask=n_ok[:, None],
                    other=0,
                )
                codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K))
            params = rn[:, None] * groups + step * PER_STEP + gg[None, :]  # [BLOCK_N, PER_STEP]
            scale = tl.load(scale_ptr + params, mask=n_ok[:, None], other=0.0)
            low = scale
            if not SYMMETRIC:
                low = tl.load(min_ptr + params, mask=n_ok[:, None], other=0.0)
            codes = tl.reshape(codes, (BLOCK_N, PER_STEP, GROUP))
            values = dequant(codes, scale[:, :, None], low[:, :, None], BITS, SYMMETRIC)
            values = tl.reshape(values, (BLOCK_N, BLOCK_K))
            acc = tl.dot(xt, tl.trans(values.to(xt.dtype)), acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + rm[:, None] * N + rn[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=m_ok[:, None] & n_ok[None, :],
        )
