"""Dequantize-and-multiply: y = x @ dequantize(W)^T (+ bias) for a group-wise quantized W.

W [N, K] is stored as `quant.QTensor`: codes [N, K / G, G x bits / 8] (int4 packed two a
byte, low nibble first), fp16 scale (and minimum, asymmetric) [N, K / G, 1]. The Triton
kernel reads the codes and the group parameters, dequantizes one group of every W row
in registers (`dequant.py`) and multiplies it into an fp32 accumulator with `tl.dot`:
the full-precision weight never exists in memory. One kernel serves decode shapes (a few to a
few hundred rows of x; the W read dominates, so tiles are wide in N) and mid-sized ones
(tiles in M and N); the launcher picks the tiles from the shape.

Prefill shapes (`DENSE_ROWS` rows or more) are compute-bound, and there the fused kernel
reached 364 TFLOP/s at int4 against cuBLAS fp16's 751 on the H100 machine
(docs/throughput.md). So they dequantize W into an fp16 scratch and multiply it with cuBLAS: the
whole matrix at once where the layer's largest fits `DENSE_WHOLE_BYTES`, else a slice
of rows at a time (`DENSE_SLICE_BYTES`) into its columns of the output
(`dense_scratch_bytes`: the memory plan counts it). The dequantization reads 0.5-1 and writes 2 bytes
a weight, about 1.5 ms for BLOOM-176B's largest matrix against 9 ms of its 4096-row
matmul; the break-even is near 640 rows, where the fused kernel's time equals the
dequantization's plus cuBLAS's.

On Hopper GPUs, x of 1-64 rows in float16 times int4-g64 asymmetric W takes
`qmatmul_wgmma` instead: wgmma with W's values made in its register operand from the
codes (docs/throughput.md, on the H100: 54-82% of the HBM copy rate at 1-16 rows where
this kernel reads 53-76%, 51-76% at 32 rows against 35-51%, and 40-65% at 48-64 rows
against 19-28%).

`qlinear_reference` is the plain-torch definition (dequantize, then `F.linear`) that the
kernel must match; it also runs wherever Triton or CUDA is absent (the CPU tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from offload.kernels import fp8, qmatmul_wgmma
from offload.kernels.launch import (
    Launcher,
    arrival_counters,
    shared_memory_limit,
    split_of,
    use_kernel,
)
from offload.kernels.qmatmul_tiles import (
    DENSE_ROWS,
    Tiles,
    block_k_of,
    fit_tiles,
    tiles_for,
)
from offload.kernels.quant import QTensor, dequantize

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs instead
    triton = None
else:
    from offload.kernels.dequant import dequant, dequant_bytes, dequant_nibbles


def qlinear_reference(
    x: torch.Tensor,
    w: QTensor,
    bias: torch.Tensor | None,
    relu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    out = F.linear(x, dequantize(w).to(x.dtype), bias)
    if relu:
        F.relu_(out)
    if residual is not None:
        out += residual.view_as(out)
    return out


def dense_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    relu: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias), then ReLU if relu: with a bias, both in the
    matmul's epilogue (cuBLASLt's, through `torch._addmm_activation`, where the output
    is contiguous), not a pass of their own over the output. out: where to write
    (a view into a larger output is allowed)."""
    if out is None:
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    if bias is None:
        torch.mm(x, weight.t(), out=out)
        return F.relu_(out) if relu else out
    if relu:
        return torch._addmm_activation(bias, x, weight.t(), out=out)
    return torch.addmm(bias, x, weight.t(), out=out)


# The dequantized W a prefill matmul holds at once (`dense_scratch_bytes`): a layer
# whose largest matrix dequantizes to DENSE_WHOLE_BYTES or less takes every matrix
# whole, so one cuBLAS call writes the contiguous output with the bias in its epilogue.
# A larger layer's matrices go in slices of DENSE_SLICE_BYTES. A slice's columns of the
# output are a strided view, which torch first fills with the bias (a copy) for cuBLAS
# to add to: about 20 copies a layer, 0.64 of W1c's 13.1 ms prefill layer (H100).
DENSE_SLICE_BYTES = 128 << 20
DENSE_WHOLE_BYTES = 512 << 20


def dense_scratch_bytes(largest: int) -> int:
    """Bytes of W a prefill matmul dequantizes at once in a layer whose largest matrix
    is `largest` bytes dequantized."""
    return largest if largest <= DENSE_WHOLE_BYTES else DENSE_SLICE_BYTES


def qlinear(
    x: torch.Tensor,
    w: QTensor,
    bias: torch.Tensor | None = None,
    tiles: Tiles | None = None,
    scratch_bytes: int = DENSE_SLICE_BYTES,
    relu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] (fp16/bf16/fp32) times the quantized W [N, K]; returns [..., N] in x's dtype.
    relu: the output goes through ReLU; residual (x's rows by N, contiguous): added
    after; both in the fused kernel's epilogue (rounded once there; prefill's dense
    path adds the residual after rounding).

    tiles overrides `tiles_for` and always runs the fused Triton kernel (the kernel
    benchmark's sweeps), never `qmatmul_wgmma`; scratch_bytes: the most of W
    dequantized at once from DENSE_ROWS rows (`dense_scratch_bytes`). An fp8 W takes
    `fp8.linear`."""
    if w.config.fp8:
        return fp8.linear(x, w, bias, scratch_bytes, relu, residual)
    if not use_kernel(x):
        return qlinear_reference(x, w, bias, relu, residual)
    n, k = w.shape
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if tiles is None and m >= DENSE_ROWS:
        _dense_slices(rows, w, bias, out, scratch_bytes, relu)
        if residual is not None:
            out += residual.view_as(out)
        return out.view(*x.shape[:-1], n)
    if residual is not None:
        assert residual.is_contiguous() and residual.numel() == m * n
    if tiles is None and qmatmul_wgmma.eligible(rows, w, bias):
        qmatmul_wgmma.qlinear(rows, w, bias, out, relu, residual)
        return out.view(*x.shape[:-1], n)
    cfg = w.config
    t = tiles or tiles_for(m, n, k, cfg.group_size, x.device)
    block_k = block_k_of(k, cfg.group_size, t.max_k)
    t = fit_tiles(t, block_k, x.element_size(), cfg, shared_memory_limit(x.device))
    steps = k // block_k
    split = split_of(t.split, steps)
    grid = (-(-m // t.block_m), -(-n // t.block_n), split)
    partial = counts = out  # unused without split-K
    if grid[2] > 1:
        partial = torch.empty((grid[2], m, n), dtype=torch.float32, device=x.device)
        counts = arrival_counters("qlinear", x.device, grid[0] * grid[1])
    _launch(
        grid,
        t.warps,
        rows,
        w.codes,
        w.scale,
        w.minimum if w.minimum is not None else w.scale,
        bias if bias is not None else out,
        residual if residual is not None else out,
        out,
        partial,
        counts,
        m,
        n,
        k,
        rows.stride(0),
        cfg.bits,
        cfg.group_size,
        cfg.symmetric,
        cfg.zero_point,
        bias is not None,
        relu,
        residual is not None,
        "ieee" if x.dtype == torch.float32 else "tf32",
        t.block_m,
        t.block_n,
        block_k,
        t.stages,
        split > 1,
        steps // split,
        cfg.bits == 4 and block_k >= 32,
        registers=t.registers,
    )
    return out.view(*x.shape[:-1], n)


def _dense_slices(
    rows: torch.Tensor,
    w: QTensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    slice_bytes: int = DENSE_SLICE_BYTES,
    relu: bool = False,
) -> None:
    """out = rows @ dequantize(W)^T (+ bias) (then ReLU), W dequantized into a scratch of
    at most slice_bytes (whole where it fits) and multiplied by cuBLAS into its columns
    of out."""
    n, k = w.shape
    cfg = w.config
    step = slice_bytes // (k * rows.element_size())
    step = n if step >= n else max(32, step // 32 * 32)
    scratch = torch.empty((min(step, n), k), dtype=rows.dtype, device=rows.device)
    block_k = block_k_of(k, cfg.group_size, 256)
    minimum = w.minimum if w.minimum is not None else w.scale
    for start in range(0, n, step):
        stop = min(n, start + step)
        dense = scratch[: stop - start]
        _launch_dequant(
            (-(-(stop - start) // DEQUANT_ROWS), k // block_k),
            4,
            w.codes[start:stop],
            w.scale[start:stop],
            minimum[start:stop],
            dense,
            stop - start,
            k,
            cfg.bits,
            cfg.group_size,
            cfg.symmetric,
            cfg.zero_point,
            DEQUANT_ROWS,
            block_k,
        )
        part = None if bias is None else bias[start:stop]
        dense_linear(rows, dense, part, relu and step >= n, out[:, start:stop])
    if relu and step < n:  # a slice's columns are a strided view: no epilogue for them
        F.relu_(out)


DEQUANT_ROWS = 32  # W rows a dequantizing program writes


if triton is not None:
    # M (rows: tokens) varies with the batch; not specialized on (a compile of about a
    # second each time M is 1 or a multiple of 16)
    @triton.jit(do_not_specialize=["M"])
    def _qmatmul_kernel(
        x_ptr,
        codes_ptr,
        scale_ptr,
        min_ptr,
        bias_ptr,
        res_ptr,
        out_ptr,
        partial_ptr,
        count_ptr,
        M,
        N,
        K: tl.constexpr,
        stride_xm,
        BITS: tl.constexpr,
        GROUP: tl.constexpr,
        SYMMETRIC: tl.constexpr,
        ZERO_POINT: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        RELU: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        STAGES: tl.constexpr,
        SPLIT: tl.constexpr,
        PER_SPLIT: tl.constexpr,  # K steps a program
        PLANES: tl.constexpr,  # int4 by nibble planes (K steps of 32 or more)
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
        first = tl.program_id(2) * PER_SPLIT
        for i in tl.range(0, PER_SPLIT, num_stages=STAGES):
            step = first + i
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
                if not PLANES:
                    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K))
            params = rn[:, None] * groups + step * PER_STEP + gg[None, :]  # [BLOCK_N, PER_STEP]
            scale = tl.load(scale_ptr + params, mask=n_ok[:, None], other=0.0)
            low = scale
            if not SYMMETRIC:
                low = tl.load(min_ptr + params, mask=n_ok[:, None], other=0.0)
            if PLANES:
                # int4 without interleaving: the low nibbles are W's even columns, the
                # high ones its odd columns; x splits the same way (a small tile)
                x_even, x_odd = tl.split(tl.reshape(xt, (BLOCK_M, BLOCK_K // 2, 2)))
                even, odd = dequant_nibbles(
                    tl.reshape(packed, (BLOCK_N, PER_STEP, GROUP // 2)),
                    scale[:, :, None],
                    low[:, :, None],
                    SYMMETRIC,
                    xt.dtype,
                    ZERO_POINT=ZERO_POINT,
                )
                even = tl.reshape(even, (BLOCK_N, BLOCK_K // 2))
                odd = tl.reshape(odd, (BLOCK_N, BLOCK_K // 2))
                acc = tl.dot(x_even, tl.trans(even), acc, input_precision=PRECISION)
                acc = tl.dot(x_odd, tl.trans(odd), acc, input_precision=PRECISION)
            else:
                codes = tl.reshape(codes, (BLOCK_N, PER_STEP, GROUP))
                if BITS == 8:
                    values = dequant_bytes(
                        codes, scale[:, :, None], low[:, :, None], SYMMETRIC, xt.dtype,
                        ZERO_POINT=ZERO_POINT,
                    )  # fmt: skip
                else:  # int4 in K steps too short for planes
                    values = dequant(
                        codes, scale[:, :, None], low[:, :, None], BITS, SYMMETRIC, xt.dtype,
                        ZERO_POINT,
                    )  # fmt: skip
                values = tl.reshape(values, (BLOCK_N, BLOCK_K))
                acc = tl.dot(xt, tl.trans(values), acc, input_precision=PRECISION)
        mask = m_ok[:, None] & n_ok[None, :]
        offsets = rm[:, None] * N + rn[None, :]
        if SPLIT:
            splits = tl.num_programs(2)
            tl.store(partial_ptr + tl.program_id(2) * M * N + offsets, acc, mask=mask)
            tl.debug_barrier()  # every thread's partial stored before the release below
            tile = pid_m * tl.num_programs(1) + pid_n
            if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == splits - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                s = 0
                while s < splits:  # in split order: the same sum whoever arrives last
                    total += tl.load(
                        partial_ptr + s * M * N + offsets,
                        mask=mask,
                        other=0.0,
                        cache_modifier=".cg",
                    )
                    s += 1
                tl.atomic_xchg(count_ptr + tile, 0)
                _store(
                    out_ptr, offsets, total, bias_ptr, res_ptr, rn, n_ok, mask, HAS_BIAS, RELU,
                    HAS_RESIDUAL,
                )  # fmt: skip
        else:
            _store(
                out_ptr, offsets, acc, bias_ptr, res_ptr, rn, n_ok, mask, HAS_BIAS, RELU,
                HAS_RESIDUAL,
            )  # fmt: skip

    @triton.jit
    def _store(
        out_ptr, offsets, acc, bias_ptr, res_ptr, rn, n_ok, mask,
        HAS_BIAS: tl.constexpr, RELU: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    ):  # fmt: skip
        """The epilogue: bias, ReLU, residual (in float32), then one rounding."""
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if RELU:
            acc = tl.maximum(acc, 0.0)
        if HAS_RESIDUAL:
            acc += tl.load(res_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)

    _launch = Launcher(_qmatmul_kernel)

    @triton.jit(do_not_specialize=["N"])
    def _dequant_kernel(
        codes_ptr,
        scale_ptr,
        min_ptr,
        out_ptr,
        N,
        K: tl.constexpr,
        BITS: tl.constexpr,
        GROUP: tl.constexpr,
        SYMMETRIC: tl.constexpr,
        ZERO_POINT: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """W rows [BLOCK_N] x columns [BLOCK_K] of the codes to out's dtype, as `dequant`."""
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        step = tl.program_id(1)
        n_ok = rn < N
        kk = tl.arange(0, BLOCK_K)
        PER_STEP: tl.constexpr = BLOCK_K // GROUP
        row_bytes = K * BITS // 8
        if BITS == 8:
            codes = tl.load(
                codes_ptr + rn[:, None] * row_bytes + step * BLOCK_K + kk[None, :],
                mask=n_ok[:, None],
                other=0,
            )
        else:  # low nibble first: the even column
            half = tl.arange(0, BLOCK_K // 2)
            packed = tl.load(
                codes_ptr + rn[:, None] * row_bytes + step * (BLOCK_K // 2) + half[None, :],
                mask=n_ok[:, None],
                other=0,
            )
            codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K))
        params = rn[:, None] * (K // GROUP) + step * PER_STEP + tl.arange(0, PER_STEP)[None, :]
        scale = tl.load(scale_ptr + params, mask=n_ok[:, None], other=0.0)
        low = scale
        if not SYMMETRIC:
            low = tl.load(min_ptr + params, mask=n_ok[:, None], other=0.0)
        values = dequant(
            tl.reshape(codes, (BLOCK_N, PER_STEP, GROUP)),
            scale[:, :, None],
            low[:, :, None],
            BITS,
            SYMMETRIC,
            out_ptr.dtype.element_ty,
            ZERO_POINT,
        )
        tl.store(
            out_ptr + rn[:, None] * K + step * BLOCK_K + kk[None, :],
            tl.reshape(values, (BLOCK_N, BLOCK_K)),
            mask=n_ok[:, None],
        )

    _launch_dequant = Launcher(_dequant_kernel)
