"""Kernel-versus-reference cases, shared by the interpreter tests (CPU, run in a
subprocess with TRITON_INTERPRET=1) and the GPU tests.

Bound (the issue's): the kernel's error against a float64 truth is within 2x the error
of torch's own `F.linear` at the same dtype on the same dequantized weights (plus a
floor for the cases where torch happens to be exact).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from offload.kernels.qmatmul import qlinear
from offload.kernels.quant import dequantize, quantize
from offload.policies.policy import Compression

# (rows, out features, in features, group): odd rows and out features not a multiple
# of any tile, one and several groups
QLINEAR_SHAPES = [(1, 40, 64, 64), (3, 72, 192, 32), (37, 130, 256, 64), (300, 96, 128, 64)]


def qlinear_failures(
    bits: int, symmetric: bool, device: str, dtypes: list[torch.dtype], shapes=QLINEAR_SHAPES
) -> list[str]:
    failures = []
    gen = torch.Generator().manual_seed(bits * 10 + symmetric)
    for dtype in dtypes:
        for rows, n, k, group in shapes:
            for with_bias in (False, True):
                w = torch.randn(n, k, generator=gen)
                x = torch.randn(rows, k, generator=gen).to(dtype)
                bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
                q = quantize(w.to(device), Compression(bits, group, symmetric))
                x, bias = x.to(device), bias.to(device) if bias is not None else None
                weight = dequantize(q).to(dtype)
                truth = F.linear(
                    x.double(), weight.double(), bias.double() if bias is not None else None
                )
                ours = qlinear(x, q, bias)
                torch_err = (F.linear(x, weight, bias).double() - truth).abs().max().item()
                our_err = (ours.double() - truth).abs().max().item()
                scale = truth.abs().max().item()
                bound = 2 * torch_err + 1e-6 * scale
                if ours.shape != truth.shape or ours.dtype != dtype or not our_err <= bound:
                    failures.append(
                        f"bits={bits} sym={symmetric} {dtype} {rows}x{n}x{k} g{group} "
                        f"bias={with_bias}: error {our_err:.3g} > bound {bound:.3g}"
                    )
    return failures


if __name__ == "__main__":  # the interpreter tests' subprocess
    bits, symmetric = int(sys.argv[1]), sys.argv[2] == "sym"
    print(json.dumps(qlinear_failures(bits, symmetric, "cpu", [torch.float32, torch.float16])))
