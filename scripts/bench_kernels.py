"""Kernel benchmark: the dequantize-and-multiply at decode shapes against HBM bandwidth.

    python scripts/bench_kernels.py [--out benchmarks/results]

For OPT-30B and Llama-2-70B layer matrices at decode row counts, int4 and int8 (group
64, asymmetric): time of `qlinear`, the compressed bytes it reads per second as a share
of the HBM copy rate measured in the same run, and torch's fp16 `F.linear` on the
uncompressed matrix for comparison. Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from offload.kernels.qmatmul import qlinear
from offload.kernels.quant import quantize
from offload.policies.policy import Compression

GB = 1e9
# (model, matrix, N, K)
SHAPES = [
    ("opt-30b", "qkv", 3 * 7168, 7168),
    ("opt-30b", "mlp_in", 28672, 7168),
    ("opt-30b", "mlp_out", 7168, 28672),
    ("llama-2-70b", "qkv", 10240, 8192),
    ("llama-2-70b", "mlp_in", 2 * 28672, 8192),
    ("llama-2-70b", "mlp_out", 8192, 28672),
]
ROWS = [1, 16, 64, 256]


def timed(fn, repeat: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeat


def hbm_rate(dev: torch.device) -> float:
    """Device copy rate, counting the read and the write (GB/s)."""
    src = torch.empty(2**30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src)) / GB


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    dev = torch.device("cuda")
    hbm = hbm_rate(dev)
    rows_out = []
    for model, name, n, k in SHAPES:
        w = torch.randn(n, k, device=dev, dtype=torch.float16)
        for bits in (4, 8):
            q = quantize(w, Compression(bits, 64, False))
            for m in ROWS:
                x = torch.randn(m, k, device=dev, dtype=torch.float16)
                ours = timed(lambda x=x, q=q: qlinear(x, q))
                dense = timed(lambda x=x, w=w: F.linear(x, w))
                read = q.nbytes + x.numel() * 2 + m * n * 2
                rows_out.append(
                    {
                        "model": model,
                        "matrix": name,
                        "n": n,
                        "k": k,
                        "rows": m,
                        "bits": bits,
                        "seconds": ours,
                        "gbps": read / ours / GB,
                        "hbm_share": read / ours / GB / hbm,
                        "fp16_seconds": dense,
                        "speedup_vs_fp16": dense / ours,
                    }
                )
        del w
    res = {"device": torch.cuda.get_device_name(), "hbm_copy_gbps": hbm, "runs": rows_out}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for out in {args.out, Path(os.environ.get("OUT", args.out))}:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"bench_kernels_{stamp}.json").write_text(json.dumps(res, indent=1))
    print(f"HBM copy rate {hbm:.0f} GB/s")
    print(
        f"{'shape':24s} {'bits':>4s} {'rows':>5s} {'us':>8s} {'GB/s':>7s} {'HBM%':>5s} {'vs fp16':>7s}"
    )
    for r in rows_out:
        print(
            f"{r['model'] + ' ' + r['matrix']:24s} {r['bits']:4d} {r['rows']:5d} "
            f"{r['seconds'] * 1e6:8.1f} {r['gbps']:7.0f} {100 * r['hbm_share']:5.0f} "
            f"{r['speedup_vs_fp16']:7.2f}"
        )


if __name__ == "__main__":
    main()
