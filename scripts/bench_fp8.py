"""The fp8 block-scaled matmul (`offload.kernels.fp8.linear`) against cuBLAS bf16 on the
same matrix dequantized, at DeepSeek-V3's shapes: time, and GB/s of the bytes each
reads (fp8: a byte a value and the row scales; bf16: two bytes a value), beside the
GPU's copy rate measured in the same run. CUDA events around 50 calls after a warm-up.

    python scripts/bench_fp8.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from offload.kernels import fp8
from offload.kernels.formats import Compression
from offload.kernels.quant import QTensor

FP8 = Compression(8, 128, True, head=False, fp8=True)
# (name, N, K): V3's attention output, an expert's gate | up and down, the dense MLP's up
SHAPES = [("o_proj", 7168, 16384), ("expert_in", 4096, 7168), ("expert_out", 7168, 2048),
          ("dense_in", 36864, 7168)]  # fmt: skip
ROWS = (1, 16, 64, 256)
GB = 1e9


def timed(fn, repeat: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeat


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    copy_gbps = 2 * big.numel() / timed(big.clone, 10) / GB
    rows_out = []
    for name, n, k in SHAPES:
        codes = torch.randint(0, 0x7E, (n, k), dtype=torch.uint8, device=dev)
        scale = torch.rand(n, fp8.blocks(k, FP8), device=dev) * 1e-3
        w = QTensor(codes, scale, None, (n, k), torch.bfloat16, FP8)
        dense = fp8.dequantize(codes, scale, FP8, torch.bfloat16)
        stored = codes.numel() + scale.numel() * 4
        for m in ROWS:
            x = torch.randn(m, k, dtype=torch.bfloat16, device=dev)
            ours = timed(lambda x=x, w=w: fp8.linear(x, w))
            theirs = timed(lambda x=x, d=dense: F.linear(x, d))
            rows_out.append({
                "matrix": name, "n": n, "k": k, "rows": m,
                "fp8_us": ours * 1e6, "bf16_us": theirs * 1e6,
                "fp8_gbps": stored / ours / GB, "bf16_gbps": 2 * n * k / theirs / GB,
                "speedup": theirs / ours,
            })  # fmt: skip
            print(json.dumps(rows_out[-1]))
    result = {"device": torch.cuda.get_device_name(dev), "copy_gbps": copy_gbps, "rows": rows_out}
    print(f"copy {copy_gbps:.0f} GB/s on {result['device']}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        (args.out / f"bench_fp8_{stamp}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
