"""Block-scaled FP8 weights (DeepSeek-V3/R1's and Kimi-K2's checkpoints) as stored and
multiplied: y = x @ dequantize(W)^T (+ bias) with W kept in its float8 bytes.

Format (`formats.Compression(fp8=True)`, G = group_size = 128): W [N, K] is
- codes [N, K] uint8: the checkpoint's float8_e4m3fn bytes, as shipped;
- scale [N, ceil(K / G)] float32: the checkpoint's `weight_scale_inv` [ceil(N / G),
  ceil(K / G)] with each block row repeated over its G rows (the last block's rows and
  columns run to N and K). A scale a row rather than a block row keeps matrices fused
  along N (q | k | v, gate | up) and rows regrouped (Falcon's qkv) one scale a row
  whatever their parts' N: 4 bytes a row and block, 1.031 bytes a value in all (the
  checkpoint's own scales are 1.0002).
The value is fp32(code) x scale, computed in float32 and rounded once to the compute
dtype: transformers' own dequantization (`Fp8Dequantize`), bit for bit.

`dequantize` is the plain-torch reference and the path wherever the kernels do not run
(the CPU): each matmul dequantizes its matrix there. On CUDA (and under
TRITON_INTERPRET=1) `linear` runs a Triton kernel that loads a tile of codes and its
scales, makes the values in registers and multiplies them into a float32 accumulator
(`tl.dot`): the codes cross PCIe and HBM at one byte a value, and the dense weight never
exists. The e4m3 bytes become floats by the GPU's own conversion where it has one
(compute capability 8.9 on: Ada, Hopper) and by integer arithmetic elsewhere, exact
either way (the byte's exponent and mantissa placed in a float16's, times 2^8; the NaN
code, 0x7F and 0xFF, kept NaN). From `qmatmul.DENSE_ROWS` rows (prefill) W is
dequantized by a Triton kernel into a scratch of the compute dtype, a slice of rows at
a time, and multiplied by cuBLAS (`qmatmul`'s scheme for int4 and int8).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from offload.kernels.formats import Compression
from offload.kernels.launch import Launcher, sm_count, use_kernel
from offload.kernels.qmatmul_tiles import DENSE_ROWS

if TYPE_CHECKING:
    from offload.kernels.quant import QTensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs instead
    triton = None


def blocks(k: int, config: Compression) -> int:
    """Scale columns of a matrix of k input channels: its column blocks."""
    return -(-k // config.group_size)


def row_scales(block_scales: torch.Tensor, rows: int, block: int) -> torch.Tensor:
    """A checkpoint's block scales [ceil(N / G), B] as our row scales [N, B] (float32)."""
    return block_scales.float().repeat_interleave(block, dim=0)[:rows].contiguous()


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, config: Compression, dtype: torch.dtype
) -> torch.Tensor:
    """W [..., N, K] in dtype from codes [..., N, K] and row scales [..., N, B]."""
    k = codes.shape[-1]
    values = codes.view(torch.float8_e4m3fn).float()
    return (values * scale.repeat_interleave(config.group_size, dim=-1)[..., :k]).to(dtype)


def linear_reference(
    x: torch.Tensor,
    w: QTensor,
    bias: torch.Tensor | None,
    relu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    out = F.linear(x, dequantize(w.codes, w.scale, w.config, x.dtype), bias)
    if relu:
        F.relu_(out)
    if residual is not None:
        out += residual.view_as(out)
    return out


@functools.cache
def native(device: torch.device) -> bool:
    """The GPU converts e4m3 itself (compute capability 8.9 on)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def linear(
    x: torch.Tensor,
    w: QTensor,
    bias: torch.Tensor | None = None,
    scratch_bytes: int = 128 << 20,
    relu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] times the fp8 W [N, K]; [..., N] in x's dtype. relu, residual: as
    `qmatmul.qlinear` (in the kernel's epilogue, rounded once there); scratch_bytes: the
    most of W dequantized at once from DENSE_ROWS rows."""
    assert w.config.group_size % BLOCK_K == 0, "a K step takes one scale a row"
    if not use_kernel(x):
        return linear_reference(x, w, bias, relu, residual)
    n, k = w.shape
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m >= DENSE_ROWS:
        _dense_slices(rows, w, bias, out, scratch_bytes, relu)
        if residual is not None:
            out += residual.view_as(out)
        return out.view(*x.shape[:-1], n)
    if residual is not None:
        assert residual.is_contiguous() and residual.numel() == m * n
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n = _block_n(m, n, block_m, x.device)
    _launch_matmul(
        (-(-m // block_m), -(-n // block_n)),
        4,
        rows,
        w.codes,
        w.scale,
        bias if bias is not None else out,
        residual if residual is not None else out,
        out,
        m,
        n,
        k,
        rows.stride(0),
        blocks(k, w.config),
        bias is not None,
        relu,
        residual is not None,
        native(x.device),
        "ieee" if x.dtype == torch.float32 else "tf32",
        block_m,
        block_n,
        BLOCK_K,
        w.config.group_size,
    )
    return out.view(*x.shape[:-1], n)


BLOCK_K = 128  # K a step: divides the block (one scale a row a step)
DEQUANT_ROWS = 32  # W rows a dequantizing program writes


def _block_n(m: int, n: int, block_m: int, device: torch.device) -> int:
    """The widest N tile that still gives every SM two programs (16 at the narrowest)."""
    wanted = 2 * sm_count(device)
    for block_n in (128, 64, 32):
        if -(-m // block_m) * -(-n // block_n) >= wanted:
            return block_n
    return 16


def _dense_slices(
    rows: torch.Tensor,
    w: QTensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    slice_bytes: int,
    relu: bool,
) -> None:
    """out = rows @ dequantize(W)^T (+ bias) (then ReLU), W dequantized into a scratch of
    at most slice_bytes (whole where it fits) and multiplied by cuBLAS into its columns."""
    n, k = w.shape
    step = slice_bytes // (k * rows.element_size())
    step = n if step >= n else max(32, step // 32 * 32)
    scratch = torch.empty((min(step, n), k), dtype=rows.dtype, device=rows.device)
    for start in range(0, n, step):
        stop = min(n, start + step)
        dense = scratch[: stop - start]
        dequantize_into(w.codes[start:stop], w.scale[start:stop], w.config, dense)
        if bias is None:
            torch.mm(rows, dense.t(), out=out[:, start:stop])
        else:
            torch.addmm(bias[start:stop], rows, dense.t(), out=out[:, start:stop])
    if relu:
        F.relu_(out)


def dequantize_into(
    codes: torch.Tensor, scale: torch.Tensor, config: Compression, out: torch.Tensor
) -> None:
    """out [N, K] (the compute dtype) = the values of codes [N, K] and scales [N, B]:
    the Triton kernel where kernels run, else `dequantize`."""
    n, k = codes.shape
    if not use_kernel(out):
        out.copy_(dequantize(codes, scale, config, out.dtype))
        return
    grid = (-(-n // DEQUANT_ROWS), -(-k // BLOCK_K))
    _launch_dequant(grid, 4, codes, scale, out, n, k, blocks(k, config), native(out.device),
                    DEQUANT_ROWS, BLOCK_K, config.group_size)  # fmt: skip


if triton is not None:

    @triton.jit
    def _values(c, NATIVE: tl.constexpr):
        """e4m3 bytes (uint8) -> their values in float32, exactly."""
        if NATIVE:
            return c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        h = c.to(tl.uint16)
        h = ((h & 0x80) << 8) | ((h & 0x7F) << 7)  # sign; exponent and mantissa in place
        v = h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0  # the exponent's bias
        return tl.where((c & 0x7F) == 0x7F, float("nan"), v)

    # M (rows: tokens) varies with the batch: not specialized on
    @triton.jit(do_not_specialize=["M"])
    def _fp8_matmul_kernel(
        x_ptr, codes_ptr, scale_ptr, bias_ptr, res_ptr, out_ptr,
        M, N, K, stride_xm, BLOCKS,
        HAS_BIAS: tl.constexpr, RELU: tl.constexpr, HAS_RES: tl.constexpr,
        NATIVE: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, G: tl.constexpr,
    ):  # fmt: skip
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        in_m, in_n = offs_m < M, offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            ks = start + offs_k
            in_k = ks < K
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :],
                        mask=in_m[:, None] & in_k[None, :], other=0.0)  # fmt: skip
            c = tl.load(codes_ptr + offs_n[:, None] * K + ks[None, :],
                        mask=in_n[:, None] & in_k[None, :], other=0)  # fmt: skip
            s = tl.load(scale_ptr + offs_n * BLOCKS + start // G, mask=in_n, other=0.0)
            w = (_values(c, NATIVE) * s[:, None]).to(x.dtype)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=in_n, other=0.0).to(tl.float32)[None, :]
        if RELU:
            acc = tl.maximum(acc, 0.0)
        at = offs_m[:, None] * N + offs_n[None, :]
        mask = in_m[:, None] & in_n[None, :]
        if HAS_RES:
            acc += tl.load(res_ptr + at, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _fp8_dequant_kernel(
        codes_ptr, scale_ptr, out_ptr, N, K, BLOCKS,
        NATIVE: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, G: tl.constexpr,
    ):  # fmt: skip
        offs_n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        start = tl.program_id(1) * BLOCK_K
        ks = start + tl.arange(0, BLOCK_K)
        mask = (offs_n < N)[:, None] & (ks < K)[None, :]
        c = tl.load(codes_ptr + offs_n[:, None] * K + ks[None, :], mask=mask, other=0)
        s = tl.load(scale_ptr + offs_n * BLOCKS + start // G, mask=offs_n < N, other=0.0)
        w = _values(c, NATIVE) * s[:, None]
        tl.store(out_ptr + offs_n[:, None] * K + ks[None, :],
                 w.to(out_ptr.dtype.element_ty), mask=mask)  # fmt: skip

    _launch_matmul = Launcher(_fp8_matmul_kernel)
    _launch_dequant = Launcher(_fp8_dequant_kernel)
