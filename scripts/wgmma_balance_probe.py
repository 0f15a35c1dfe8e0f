"""How `qmatmul_wgmma`'s HBM rate depends on its programs an SM: W of N = 64 x warpgroups
x P rows for P programs (one tile each, unsplit), from 1 to `PER_SM` programs an SM and
between (where the GPU's block scheduler gives some SMs one program more than others).

    python scripts/wgmma_balance_probe.py [--rows 1,8,16,32,64] [--k 14336,28672]

If an SM's throughput bounds the kernel, a grid of 2.5 programs an SM takes as long as 3;
if a program's own latency does, as long as 1. W is at least 60 MB, above the L2, so
every replay reads it from HBM. Writes JSON and prints a table (us a call, share of the
HBM copy rate measured in the same run).
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
from bench_kernels import hbm_rate, timed
from benchlib import Results

from offload.kernels import qmatmul_wgmma
from offload.kernels.formats import Compression
from offload.kernels.launch import sm_count
from offload.kernels.quant import quantize

GB = 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,8,16,32,64")
    p.add_argument("--k", default="14336,28672")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    dev = torch.device("cuda")
    sms = sm_count(dev)
    hbm = hbm_rate(dev)
    results = Results(
        "wgmma_balance_probe",
        {"device": torch.cuda.get_device_name(), "sms": sms, "hbm_copy_gbps": hbm, "runs": []},
        args.out,
    )  # fmt: skip
    for m in map(int, args.rows.split(",")):
        x_rows = qmatmul_wgmma._x_rows(m)
        per_sm = qmatmul_wgmma.PER_SM[x_rows]
        for warpgroups in sorted({1, qmatmul_wgmma.WARPGROUPS[x_rows]}):
            # programs an SM: whole numbers, and halves where some SMs get one more
            loads = sorted({c / 2 for c in range(2, 2 * per_sm + 1)})
            for k in map(int, args.k.split(",")):
                for load in loads:
                    programs = round(load * sms)
                    n = 64 * warpgroups * programs
                    q = quantize(
                        torch.randn(n, k, device=dev, dtype=torch.float16), Compression(4, 64, False)
                    )  # fmt: skip
                    x = torch.randn(m, k, device=dev, dtype=torch.float16)
                    out = torch.empty((m, n), dtype=x.dtype, device=dev)
                    call = functools.partial(
                        qmatmul_wgmma.qlinear, x, q, None, out, grid=programs, warpgroups=warpgroups
                    )  # fmt: skip
                    call()
                    us = min(timed(call) for _ in range(2)) * 1e6
                    read = q.nbytes + x.numel() * 2 + m * n * 2
                    run = {
                        "rows": m, "warpgroups": warpgroups, "k": k, "programs_per_sm": load,
                        "n": n, "us": us, "hbm_share": read / (us / 1e6) / GB / hbm,
                    }  # fmt: skip
                    results.data["runs"].append(run)
                    results.save()
                    del q, x, out
    print(f"HBM copy {hbm:.0f} GB/s, {sms} SMs; share of HBM by programs an SM")
    keys = sorted({(r["rows"], r["warpgroups"], r["k"]) for r in results.data["runs"]})
    for m, wg, k in keys:
        runs = [
            r for r in results.data["runs"] if (r["rows"], r["warpgroups"], r["k"]) == (m, wg, k)
        ]
        cells = " ".join(f"{r['programs_per_sm']:g}:{r['hbm_share'] * 100:3.0f}%" for r in runs)
        print(f"rows {m:2d} wg {wg} K {k:5d}  {cells}")


if __name__ == "__main__":
    main()
