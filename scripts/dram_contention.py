"""DRAM shared by the weight DMA (pinned host -> GPU copies) and the CPU attention.

    python scripts/dram_contention.py --out benchmarks/results/dram_contention.json

At W1u's shape (88 sequences, 56 heads, 544 slots, head_dim 128, fp16; one layer's KV
is 1.37 GB), twice: the copy alone and beside a running attention, the attention alone
and beside running copies, both at once with a W1u layer's ratio of bytes, and the DRAM
read rate (the C kernel's own loads) alone and beside copies. A diagnostic of where a
CPU-attention step's time goes (docs/throughput.md); the profile measures the copy's
rate beside the attention itself (`policies.measure`). Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from offload.kernels.cpu_attention import read_gbps
from offload.models.attention import attend

GB = 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSON written here")
    args = p.parse_args()
    torch.manual_seed(0)
    rows, heads, slots, dim = 88, 56, 544, 128
    k = torch.empty(rows, heads, slots, dim, dtype=torch.float16).normal_()
    v = torch.empty_like(k).normal_()
    q = torch.randn(rows, heads, 1, dim).half()
    bias = torch.zeros(rows, 1, 1, slots, dtype=torch.float16)
    kv = 2 * k.numel() * k.element_size()
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    attend(q, k, v, bias)  # warm up
    res: dict[str, float | int] = {"threads": torch.get_num_threads(), "kv_bytes": kv}

    def queue(n: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            first.record()
            for _ in range(n):
                gpu.copy_(host, non_blocking=True)
            last.record()
        return first, last

    def attention_s(n: int) -> float:
        started = time.perf_counter()
        for _ in range(n):
            attend(q, k, v, bias)
        return time.perf_counter() - started

    def copy_gbps(n: int, first, last) -> float:
        return n * host.numel() / (first.elapsed_time(last) / 1e3) / GB

    for rep in range(2):
        first, last = queue(8)
        last.synchronize()
        res[f"h2d_alone_{rep}"] = copy_gbps(8, first, last)
        res[f"attn_alone_{rep}"] = 4 * kv / attention_s(4) / GB
        first, last = queue(6)  # the attention outlasts the copies
        attention_s(int(0.5 / (kv / res["attn_alone_0"] / GB)) + 2)
        last.synchronize()
        res[f"h2d_under_attn_{rep}"] = copy_gbps(6, first, last)
        first, last = queue(40)  # the copies outlast the attention
        res[f"attn_under_h2d_{rep}"] = 4 * kv / attention_s(4) / GB
        last.synchronize()
        torch.cuda.synchronize()
        started = time.perf_counter()
        first, last = queue(4)  # 4 GiB of copies beside 4 layers' KV: W1u's ratio
        attention = attention_s(4)
        last.synchronize()
        both = time.perf_counter() - started
        res[f"both_s_{rep}"] = both
        res[f"both_gbps_{rep}"] = (4 * host.numel() + 4 * kv) / both / GB
        res[f"both_attn_s_{rep}"] = attention
        res[f"both_h2d_s_{rep}"] = first.elapsed_time(last) / 1e3
        big = torch.ones(1 << 31, dtype=torch.uint8)
        res[f"dram_read_alone_{rep}"] = read_gbps(big) or 0.0
        first, last = queue(30)
        res[f"dram_read_under_h2d_{rep}"] = read_gbps(big) or 0.0
        last.synchronize()
        del big
    for key, value in res.items():
        print(f"{key:24s} {value:.3f}" if isinstance(value, float) else f"{key:24s} {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
