"""The fp8 kernels' cases (`offload.kernels.fp8`), run under TRITON_INTERPRET=1 by
tests/test_fp8_checkpoint.py and compiled on the GPU: `python -m tests.fp8_cases
[cuda]` prints a JSON list of the cases that failed (empty: all passed).

- the dequantizing kernel gives `fp8.dequantize`'s values bit for bit (every e4m3 byte,
  the NaN codes included, partial blocks, a scale a row and block);
- the matmul, decode and mid-sized shapes with partial blocks, bias, ReLU and residual,
  stays within 2x the torch reference's own error against a float64 truth, or within
  the compute dtype's rounding of the output where the reference is exact (float32)."""

from __future__ import annotations

import json
import sys

import torch

from offload.kernels import fp8
from offload.kernels.formats import Compression
from offload.kernels.quant import QTensor

FP8 = Compression(8, 128, True, head=False, fp8=True)
NAN_CODES = (0x7F, 0xFF)
# (rows of x, N, K): decode rows, a mid-sized tile, partial blocks in N and K
# and a prefill's rows (the dequantized scratch and cuBLAS)
SHAPES = [(1, 256, 384), (3, 200, 320), (17, 130, 256), (40, 64, 130), (64, 576, 512),
          (1024, 192, 320)]  # fmt: skip


def _matrix(n: int, k: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # the NaN codes out of the matmul's cases
    scale = torch.rand(n, fp8.blocks(k, FP8), generator=g) * 1e-2 + 1e-3
    return codes.to(device), scale.to(device)


def dequant_cases(device: str, dtypes) -> list[str]:
    failed = []
    every = torch.arange(256, dtype=torch.uint8).repeat(3, 1)  # each byte, NaNs included
    codes = torch.cat([every, every.flip(1)], dim=1)[:, :320].contiguous().to(device)
    scale = torch.tensor([[0.5, 3e-3, 7.0]] * 3, device=device)
    for dtype in dtypes:
        out = torch.empty(codes.shape, dtype=dtype, device=device)
        fp8.dequantize_into(codes, scale, FP8, out)
        want = fp8.dequantize(codes.cpu(), scale.cpu(), FP8, dtype)
        got = out.cpu()
        if not torch.equal(got.isnan(), want.isnan()) or not torch.equal(
            got.nan_to_num(0.0), want.nan_to_num(0.0)
        ):
            failed.append(f"dequantize {dtype}")
    return failed


def matmul_cases(device: str, dtypes) -> list[str]:
    failed = []
    for i, (m, n, k) in enumerate(SHAPES):
        codes, scale = _matrix(n, k, device, i)
        for dtype in dtypes:
            g = torch.Generator().manual_seed(100 + i)
            x = torch.randn(m, k, generator=g).to(device, dtype)
            bias = torch.randn(n, generator=g).to(device, dtype)
            res = torch.randn(m, n, generator=g).to(device, dtype)
            w = QTensor(codes, scale, None, (n, k), dtype, FP8)
            got = fp8.linear(x, w, bias, relu=True, residual=res).double().cpu()
            parts = [t.cpu() for t in (x, bias, res)]
            truth = _truth(codes.cpu(), scale.cpu(), dtype, *parts)
            ref = fp8.linear_reference(
                parts[0], QTensor(codes.cpu(), scale.cpu(), None, (n, k), dtype, FP8),
                parts[1], True, parts[2],
            ).double()  # fmt: skip
            rounding = torch.finfo(dtype).eps * truth.abs().max().item()
            bound = max(2 * (ref - truth).abs().max().item(), rounding)
            error = (got - truth).abs().max().item()
            if not error <= bound:
                failed.append(f"linear {(m, n, k)} {dtype}: error {error:.3g} > {bound:.3g}")
    return failed


def _truth(codes, scale, dtype, x, bias, res) -> torch.Tensor:
    """float64 of the weights in the compute dtype (what both compute with)."""
    w = fp8.dequantize(codes, scale, FP8, dtype).double()
    out = (x.double() @ w.t() + bias.double()).relu()
    return out + res.double()


def main() -> None:
    cuda = sys.argv[1:] == ["cuda"]
    device = "cuda" if cuda else "cpu"
    # bfloat16 only compiled: the interpreter rounds float32 to bfloat16 by truncation
    dtypes = (torch.float32, torch.float16, torch.bfloat16) if cuda else (torch.float32, torch.float16)  # fmt: skip
    failed = dequant_cases(device, dtypes) + matmul_cases(device, dtypes)
    if cuda and fp8.native(torch.device("cuda")):  # the integer decoding, compiled too
        fp8.native = lambda device: False
        failed += [f"integer decoding: {f}" for f in dequant_cases(device, dtypes)]
    print(json.dumps(failed))


if __name__ == "__main__":
    main()
