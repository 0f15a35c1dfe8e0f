"""A mixture of experts' expert computed on the CPU, over its weights where they live
in pinned host memory: for an expert a few token rows chose, copying its weights to
the GPU can cost more than computing those rows beside them (Fiddler, ktransformers).

`expert_mlp_reference` is the plain definition: SwiGLU, y = down(silu(gate(x)) * up(x))
with [gate | up] in mlp_in, every matrix dequantized (a `quant.QTensor`) to float32 and
the arithmetic in float32, the result in x's dtype.

`cpu_expert_mlp` computes the same on the CPU:
- full-precision weights multiply in their own dtype (oneDNN's bf16 and fp16 GEMMs
  accumulate in float32), x cast to it: the weights are read once, as stored;
- compressed weights go through the C kernel (`cpu_expert_native`: each packed byte
  read once, dequantized in registers to the values the format defines, the sums in
  float32; both matrices compressed: the whole SwiGLU in one call);
- where the kernel does not run (no C compiler, OFFLOAD_NATIVE=0), compressed weights
  are dequantized `CPU_SLICE_ROWS` output rows at a time (in the matrix's dtype) and
  multiplied in float32, so the float32 copy stays a slice (in cache), never the
  matrix: 2.0 GB/s of int4 and 4.8 of int8 on the H100 machine's host, where its
  fp16 experts ran at 71.6.
Its rate (weight bytes a second at a decode's few rows) is measured per format into the
hardware profile (`policies.measure_experts`), and the cost model computes an expert
on the CPU only where that beats copying its weights (`policies.cost_moe`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from offload.kernels import cpu_expert_native
from offload.kernels.quant import QTensor, dequantize

# output rows of a compressed matrix dequantized at once: 256 x 4096 float32 is 4 MiB
CPU_SLICE_ROWS = 256


def _dense(w: torch.Tensor | QTensor) -> torch.Tensor:
    return dequantize(w).float() if isinstance(w, QTensor) else w.float()


def expert_mlp_reference(
    x: torch.Tensor, mlp_in: torch.Tensor | QTensor, mlp_out: torch.Tensor | QTensor
) -> torch.Tensor:
    """The expert's SwiGLU MLP over rows x [n, hidden], in float32."""
    gate, up = F.linear(x.float(), _dense(mlp_in)).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, _dense(mlp_out)).to(x.dtype)


def _linear(x: torch.Tensor, w: torch.Tensor | QTensor) -> torch.Tensor:
    """x [n, K] times W [N, K]^T on the CPU (module docstring); float32 out."""
    if not isinstance(w, QTensor):
        return F.linear(x.to(w.dtype), w).float()
    y = cpu_expert_native.qlinear(x, w)
    if y is not None:
        return y
    rows = w.shape[0]
    out = torch.empty((x.shape[0], rows), dtype=torch.float32)
    x = x.float()
    for start in range(0, rows, CPU_SLICE_ROWS):
        part = slice(start, min(rows, start + CPU_SLICE_ROWS))
        minimum = None if w.minimum is None else w.minimum[part]
        piece = QTensor(
            w.codes[part], w.scale[part], minimum, (part.stop - start, w.shape[1]),
            w.dtype, w.config,
        )  # fmt: skip
        out[:, part] = F.linear(x, dequantize(piece).float())
    return out


def cpu_expert_mlp(
    x: torch.Tensor, mlp_in: torch.Tensor | QTensor, mlp_out: torch.Tensor | QTensor
) -> torch.Tensor:
    """The expert's SwiGLU MLP over rows x [n, hidden] on the CPU, weights read where
    they are (module docstring); the result in x's dtype."""
    if isinstance(mlp_in, QTensor) and isinstance(mlp_out, QTensor):
        y = cpu_expert_native.expert_mlp(x, mlp_in, mlp_out)
        if y is not None:
            return y.to(x.dtype)
    gate, up = _linear(x, mlp_in).chunk(2, dim=-1)
    return _linear(F.silu(gate).mul_(up), mlp_out).to(x.dtype)
