"""CPU decode attention over a compressed KV cache against SDPA and the DRAM copy rate.

    python scripts/bench_cpu_attention.py [--rows 16] [--repeat 3] [--out benchmarks/results]

At the shape `policies.measure._cpu_attention_rate` times (16 sequences, 32 heads, 1024
slots, head_dim 128), in fp16 and fp32: torch SDPA over the uncompressed cache, then
`decode_attention_cpu` over int4 and int8 caches (groups of 64, asymmetric) of the same
K/V. Each rate is given two ways: the K/V bytes at the compute dtype's size a second
(what the profile reports) and the bytes the cache actually stores a second, each as a
share of this machine's DRAM copy rate (read + write, as the profile counts it). Runs on
torch's thread count (all cores unless OMP_NUM_THREADS says otherwise). Writes JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from offload.kernels.formats import Compression
from offload.kernels.kv_attention_cpu import decode_attention_cpu
from offload.kernels.kv_cache import QuantKV
from offload.policies.hardware import code_version

GB = 1e9
CPU = torch.device("cpu")


def timed(fn, repeat: int) -> float:
    """Seconds a call, after one warm-up call."""
    fn()
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - started) / repeat


def dram_copy_gbps(nbytes: int = 2**28) -> float:
    """Read + write GB/s of a host copy (`measure`'s DRAM rate)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(lambda: dst.copy_(src), 3) / GB


def bench(dtype: torch.dtype, rows: int, repeat: int, dram: float) -> list[dict]:
    heads, slots, dim = 32, 1024, 128
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(rows, heads, slots, dim, generator=gen).to(dtype)
    v = torch.randn(rows, heads, slots, dim, generator=gen).to(dtype)
    q = torch.randn(rows, heads, 1, dim, generator=gen).to(dtype)
    bias = torch.zeros(rows, 1, 1, slots, dtype=dtype)
    at_dtype = 2 * k.numel() * k.element_size()
    runs = [("sdpa", at_dtype, functools.partial(F.scaled_dot_product_attention, q, k, v, bias))]
    for bits in (4, 8):
        cache = QuantKV(rows, heads, dim, slots, Compression(bits, 64), dtype, CPU)
        cache.write(k, v, 0)
        attention = functools.partial(decode_attention_cpu, q, cache, bias, slots)
        runs.append((f"int{bits}-g64", cache.slot_bytes(slots), attention))
    out = []
    for name, stored, attention in runs:
        seconds = timed(attention, repeat)
        row = {
            "dtype": str(dtype).removeprefix("torch."),
            "cache": name,
            "rows": rows,
            "heads": heads,
            "slots": slots,
            "head_dim": dim,
            "seconds": seconds,
            "gbps_at_dtype": at_dtype / seconds / GB,
            "gbps_stored": stored / seconds / GB,
            "dram_share_at_dtype": at_dtype / seconds / GB / dram,
            "dram_share_stored": stored / seconds / GB / dram,
        }
        out.append(row)
        print(
            f"{row['dtype']:8s} {name:9s} {seconds * 1e3:8.1f} ms "
            f"{row['gbps_at_dtype']:6.2f} GB/s at dtype ({100 * row['dram_share_at_dtype']:4.1f}%"
            f" DRAM), {row['gbps_stored']:6.2f} GB/s stored "
            f"({100 * row['dram_share_stored']:4.1f}%)",
            flush=True,
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16, help="sequences (the profile's: 16)")
    p.add_argument("--repeat", type=int, default=3, help="timed calls a case")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    dram = dram_copy_gbps()
    print(f"{torch.get_num_threads()} threads; DRAM copy {dram:.1f} GB/s", flush=True)
    runs = [
        r for d in (torch.float16, torch.float32) for r in bench(d, args.rows, args.repeat, dram)
    ]
    res = {
        "code_version": code_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dram_copy_gbps": dram,
        "runs": runs,
    }
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for out in {args.out, Path(os.environ.get("OUT", args.out))}:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"bench_cpu_attention_{stamp}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
