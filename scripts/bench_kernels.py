"""Kernel benchmark: the compressed-data kernels at decode shapes against HBM bandwidth.

    python scripts/bench_kernels.py [--kernels qlinear,attention] [--out benchmarks/results]

qlinear: for OPT-30B and Llama-2-70B layer matrices at decode row counts, int4 and int8
(group 64, asymmetric): time of `qlinear`, the compressed bytes it reads per second as
a share of the HBM copy rate measured in the same run, and torch's fp16 `F.linear` on
the uncompressed matrix for comparison.
attention: decode attention over a compressed cache (int4 / int8, groups of 64 tokens)
at OPT-30B, Llama-2-70B (grouped queries) and BLOOM (per-head ALiBi bias) shapes: the
compressed cache bytes read per second as a share of the same HBM rate, beside SDPA
over the fp16 cache. Writes JSON and prints a table.
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

from offload.kernels.kvquant import QuantKV, decode_attention
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


# (model, batch, query heads, KV heads, head_dim, context, per-head bias)
ATTENTION_SHAPES = [
    ("opt-30b", 12, 56, 56, 128, 544, False),
    ("opt-30b", 32, 56, 56, 128, 544, False),
    ("llama-2-70b", 32, 64, 8, 128, 4096, False),
    ("bloom", 16, 112, 112, 128, 1024, True),
]


def bench_attention(dev: torch.device, hbm: float) -> list[dict]:
    out = []
    for model, batch, heads, kv_heads, dim, ctx, per_head in ATTENTION_SHAPES:
        k = torch.randn(batch, kv_heads, ctx, dim, device=dev, dtype=torch.float16)
        v = torch.randn_like(k)
        q = torch.randn(batch, heads, 1, dim, device=dev, dtype=torch.float16)
        bias = torch.zeros(batch, heads if per_head else 1, 1, ctx, device=dev, dtype=q.dtype)
        sdpa = F.scaled_dot_product_attention
        dense = timed(functools.partial(sdpa, q, k, v, attn_mask=bias, enable_gqa=True))
        for bits in (4, 8):
            cache = QuantKV(batch, kv_heads, dim, ctx, Compression(bits, 64, False), q.dtype, dev)
            cache.write(k, v, 0)
            seconds = timed(functools.partial(decode_attention, q, cache, bias, ctx))
            read = cache.nbytes + bias.numel() * 2 + 2 * q.numel() * 2
            out.append(
                {
                    "model": model,
                    "batch": batch,
                    "heads": heads,
                    "kv_heads": kv_heads,
                    "head_dim": dim,
                    "context": ctx,
                    "bits": bits,
                    "seconds": seconds,
                    "gbps": read / seconds / GB,
                    "hbm_share": read / seconds / GB / hbm,
                    "fp16_sdpa_seconds": dense,
                    "speedup_vs_fp16": dense / seconds,
                }
            )
            del cache
    return out


# prefill: the block's prompt tokens (12 x 512) through qkv, and the MLP's 4096-row slices
PREFILL_SHAPES = [
    ("opt-30b", "qkv", 6144, 3 * 7168, 7168),
    ("opt-30b", "mlp_in", 4096, 28672, 7168),
]
PREFILL_TILES = [  # (BLOCK_M, BLOCK_N, K step, warps, stages); the first is the default
    (128, 128, 64, 8, 3),
    (128, 128, 64, 4, 3),
    (128, 256, 64, 8, 3),
    (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
    (128, 128, 128, 8, 3),
    (256, 128, 64, 8, 3),
]


def bench_prefill(dev: torch.device) -> list[dict]:
    """Tile sweep of the int4 kernel at prefill shapes, TFLOP/s beside cuBLAS fp16."""
    out = []
    for model, name, m, n, k in PREFILL_SHAPES:
        w = torch.randn(n, k, device=dev, dtype=torch.float16)
        x = torch.randn(m, k, device=dev, dtype=torch.float16)
        q = quantize(w, Compression(4, 64, False))
        flops = 2 * m * n * k
        dense = timed(functools.partial(F.linear, x, w), repeat=10)
        for tiles in PREFILL_TILES:
            try:
                seconds = timed(functools.partial(qlinear, x, q, None, tiles), repeat=10)
            except Exception as exc:  # a tile that does not fit shared memory
                out.append({"shape": f"{model} {name}", "tiles": tiles, "error": str(exc)[:200]})
                continue
            out.append(
                {
                    "shape": f"{model} {name} m{m}",
                    "tiles": tiles,
                    "tflops": flops / seconds / 1e12,
                    "fp16_tflops": flops / dense / 1e12,
                }
            )
        del w, x, q
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kernels", default="qlinear,attention", help="also: prefill (tile sweep)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    kernels = args.kernels.split(",")
    dev = torch.device("cuda")
    hbm = hbm_rate(dev)
    attention = bench_attention(dev, hbm) if "attention" in kernels else []
    prefill = bench_prefill(dev) if "prefill" in kernels else []
    rows_out = []
    for model, name, n, k in SHAPES if "qlinear" in kernels else []:
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
    res = {
        "device": torch.cuda.get_device_name(),
        "hbm_copy_gbps": hbm,
        "runs": rows_out,
        "attention": attention,
        "prefill": prefill,
    }
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
    for r in prefill:
        if "error" in r:
            print(f"{r['shape']:28s} {r['tiles']}: {r['error']}")
        else:
            print(
                f"{r['shape']:28s} {r['tiles']}: {r['tflops']:6.1f} TFLOP/s (fp16 {r['fp16_tflops']:.1f})"
            )
    print(f"\n{'attention':28s} {'bits':>4s} {'us':>8s} {'GB/s':>7s} {'HBM%':>5s} {'vs fp16':>7s}")
    for r in attention:
        shape = f"{r['model']} B{r['batch']} S{r['context']}"
        print(
            f"{shape:28s} {r['bits']:4d} {r['seconds'] * 1e6:8.1f} {r['gbps']:7.0f} "
            f"{100 * r['hbm_share']:5.0f} {r['speedup_vs_fp16']:7.2f}"
        )


if __name__ == "__main__":
    main()
