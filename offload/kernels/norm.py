"""Row norms (LayerNorm and RMSNorm) with the residual add before them, in one kernel.

`norm_reference` is the plain-torch definition, transformers' arithmetic:
- LayerNorm is `F.layer_norm`: float32 inside, weight and bias applied, rounded once.
- RMSNorm is Llama's: the row is normalized in float32 and rounded to its dtype, and
  then the weight multiplies it in that dtype.
- "rms_offset" is Gemma's RMSNorm: the weight applies as (1 + weight), in float32,
  and the product is rounded once.

A residual, when given, is first added into x in place (`x += residual`), and the norm
is then taken of the sum.

`norm` launches one Triton program a row that does all of it: it reads x (and the
residual) once, and writes the sum back and the normed row out.
- torch's layer norm spends 12 us a call on 12 rows of 7168. That is 1.2 ms of W1c's
  15.2 ms decode step (97 calls; H100, docs/throughput.md).
- The RMS norm above is six elementwise kernels, and the residual add one more.

The kernel's products of two float16 (or bfloat16) values are exact in float32, so
RMSNorm's weight multiply rounds as the reference's does. Its reductions sum in
another order, so a row can differ from the reference in the last bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from offload.kernels.launch import Launcher, use_kernel

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs instead
    triton = None

# the widest row one program holds in registers (BLOOM-176B's hidden size is 14336)
MAX_KERNEL_WIDTH = 1 << 15


def norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kind: str,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x's rows normed ("layer", "rms" or "rms_offset"); residual, if given, is added
    into x first."""
    if residual is not None:
        x += residual
    if kind in ("rms", "rms_offset"):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        normed = x.float() * torch.rsqrt(variance + eps)
        if kind == "rms_offset":
            return (normed * (1.0 + weight.float())).to(x.dtype)
        return weight * normed.to(x.dtype)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    kind: str,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`norm_reference` in one Triton kernel. It runs on CUDA tensors, or interpreted,
    for contiguous rows; anything else takes the reference."""
    width = x.shape[-1]
    fits = x.is_contiguous() and width <= MAX_KERNEL_WIDTH and weight.dtype == x.dtype
    if residual is not None:
        fits = fits and residual.is_contiguous() and residual.shape == x.shape
    if not (use_kernel(x) and fits):
        return norm_reference(x, weight, bias, kind, eps, residual)
    out = torch.empty_like(x)
    block = triton.next_power_of_2(width)
    _launch(
        (x.numel() // width,), min(16, max(4, block // 1024)),
        x, x if residual is None else residual, weight, weight if bias is None else bias, out,
        width, eps,
        # RMS, OFFSET, HAS_RESIDUAL, HAS_BIAS, BLOCK
        kind != "layer", kind == "rms_offset", residual is not None, bias is not None, block,
    )  # fmt: skip
    return out


if triton is not None:

    @triton.jit(do_not_specialize=["width"])
    def _norm_kernel(
        x_ptr,
        residual_ptr,
        weight_ptr,
        bias_ptr,
        out_ptr,
        width,
        eps,
        RMS: tl.constexpr,
        OFFSET: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """One row: x (+= the residual, stored back), then the norm into out."""
        row = tl.program_id(0).to(tl.int64) * width
        cols = tl.arange(0, BLOCK)
        ok = cols < width
        x = tl.load(x_ptr + row + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            x = x + tl.load(residual_ptr + row + cols, mask=ok, other=0.0)
            tl.store(x_ptr + row + cols, x, mask=ok)
        xf = x.to(tl.float32)
        weight = tl.load(weight_ptr + cols, mask=ok, other=0.0)
        if RMS and OFFSET:
            variance = tl.sum(xf * xf, axis=0) / width
            normed = xf * tl.math.rsqrt(variance + eps)
            out = (normed * (1.0 + weight.to(tl.float32))).to(x.dtype)
        elif RMS:
            variance = tl.sum(xf * xf, axis=0) / width
            normed = (xf * tl.math.rsqrt(variance + eps)).to(x.dtype)
            out = (weight.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)
        else:
            mean = tl.sum(xf, axis=0) / width
            centred = tl.where(ok, xf - mean, 0.0)
            variance = tl.sum(centred * centred, axis=0) / width
            out = centred * tl.math.rsqrt(variance + eps) * weight.to(tl.float32)
            if HAS_BIAS:
                out += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            out = out.to(x.dtype)
        tl.store(out_ptr + row + cols, out, mask=ok)

    _launch = Launcher(_norm_kernel)
