"""Kernel benchmark: the compressed-data kernels at decode shapes against HBM bandwidth.

    python scripts/bench_kernels.py [--kernels qlinear,attention] [--out benchmarks/results]

qlinear: for OPT-30B and Llama-2-70B layer matrices at decode row counts, int4 and int8
(group 64, asymmetric): time of `qlinear`, the compressed bytes it reads per second as
a share of the HBM copy rate measured in the same run, and torch's fp16 `F.linear` on
the uncompressed matrix for comparison.
attention: decode attention over a compressed cache (int4 / int8, groups of 64 tokens)
at OPT-30B, Llama-2-70B (grouped queries) and BLOOM (per-head ALiBi bias) shapes: the
compressed cache bytes read per second as a share of the same HBM rate, beside SDPA
over the fp16 cache. The bytes read are those that hold the context's slots
(`QuantKV.slot_bytes`: the full groups and the tail's tokens), not the buffer's spare
capacity (runs before 2026-11-27 21:30 counted the whole buffer: 1.06-1.26x too many
at int4). Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from benchlib import Results

from offload.kernels import qmatmul, qmatmul_tiles, qmatmul_wgmma
from offload.kernels.formats import Compression
from offload.kernels.kv_attention import decode_attention, decode_attention_reference
from offload.kernels.kv_attention_cpu import decode_attention_cpu
from offload.kernels.kv_cache import QuantKV
from offload.kernels.qmatmul import qlinear
from offload.kernels.qmatmul_tiles import Tiles
from offload.kernels.quant import quantize
from offload.policies.timers import kernel_seconds

GB = 1e9
# (model, matrix, N, K)
SHAPES = [
    ("opt-30b", "qkv", 3 * 7168, 7168),
    ("opt-30b", "mlp_in", 28672, 7168),
    ("opt-30b", "mlp_out", 7168, 28672),
    ("opt-30b", "out_proj", 7168, 7168),
    ("llama-2-70b", "qkv", 10240, 8192),
    ("llama-2-70b", "mlp_in", 2 * 28672, 8192),
    ("llama-2-70b", "mlp_out", 8192, 28672),
]
ROWS = [1, 16, 64, 256]


def timed(fn, repeat: int = 20) -> float:
    """GPU seconds a call: `repeat` calls captured in one CUDA graph and replayed, so the
    host's launch cost (measured apart: --kernels launch) does not hide the kernel's
    (`timers.kernel_seconds`, as the profile times its kernel rates)."""
    return kernel_seconds(fn, repeat)


def _rates(read: int, seconds: float, hbm: float, dense: float) -> dict[str, float]:
    """A kernel's record: its time, bytes read per second and as a share of the HBM
    copy rate, and its speed-up over the uncompressed torch baseline's time."""
    gbps = read / seconds / GB
    return {
        "seconds": seconds,
        "gbps": gbps,
        "hbm_share": gbps / hbm,
        "speedup_vs_fp16": dense / seconds,
    }


def hbm_rate(dev: torch.device) -> float:
    """Device copy rate, counting the read and the write (GB/s)."""
    src = torch.empty(2**30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    # timed eagerly: a 1 GiB copy keeps the GPU busy far longer than its launch takes,
    # and copies replayed from a graph measured 20% slower (2438 against 3009 GB/s)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1e3) / GB


# (model, batch, query heads, KV heads, head_dim, context, per-head bias)
ATTENTION_SHAPES = [
    ("opt-30b", 12, 56, 56, 128, 544, False),
    ("opt-30b", 14, 56, 56, 128, 544, False),  # W1c's
    ("opt-30b", 32, 56, 56, 128, 544, False),
    ("llama-2-70b", 32, 64, 8, 128, 4096, False),
    ("bloom", 16, 112, 112, 128, 1024, True),
    ("llama-2-13b", 8, 40, 40, 128, 4096, False),  # plain heads, long context
]


def int4_attention_cases(dev: torch.device, random_bias: bool = False):
    """For each `ATTENTION_SHAPES` shape (int4-g64 asymmetric cache of random K and V,
    float16; seeded): the shape, q, the cache, the bias (zeros, or random where asked:
    a kernel's per-row bias indexing then shows in its output), the bytes a call reads
    (the slots that hold the context, the bias, q and the output) and
    `decode_attention_reference`'s output."""
    for shape in ATTENTION_SHAPES:
        _, batch, heads, kv_heads, dim, ctx, per_head = shape
        torch.manual_seed(0)
        k = torch.randn(batch, kv_heads, ctx, dim, device=dev, dtype=torch.float16)
        v = torch.randn_like(k)
        q = torch.randn(batch, heads, 1, dim, device=dev, dtype=torch.float16)
        make = torch.randn if random_bias else torch.zeros
        bias = make(batch, heads if per_head else 1, 1, ctx, device=dev, dtype=q.dtype)
        cache = QuantKV(batch, kv_heads, dim, ctx, Compression(4, 64, False), q.dtype, dev)
        cache.write(k, v, 0)
        read = cache.slot_bytes(ctx) + bias.numel() * 2 + 2 * q.numel() * 2
        yield shape, q, cache, bias, read, decode_attention_reference(q, cache, bias, ctx)


# decode attention (--kernels attention-sweep): `decode_attention`'s (split_groups,
# warps, stages, tile_groups, fused_merge, mma); split_groups None: the launcher's choice
# from the SM count; mma None: `kv_attention_mma` where it is eligible. The first is the
# default, the second the Triton kernel alone (both run without --sweep); a split_groups
# past a shape's groups is skipped.
ATTENTION_SWEEP = [
    (None, 2, 2, 1, True, None),
    (None, 2, 2, 1, True, False),
    (None, 2, 2, 1, False, False),
    (None, 4, 2, 1, False, False),
    (None, 2, 3, 1, False, False),
    (None, 2, 4, 1, False, False),
    (2, 2, 2, 1, False, None),
    (4, 2, 2, 1, False, None),
    (8, 2, 2, 1, False, None),
    (16, 2, 2, 1, False, None),
    (32, 2, 2, 1, False, None),
]


def _attention_shape(model, batch, heads, kv_heads, dim, ctx, bits) -> dict:
    return {
        "model": model,
        "batch": batch,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": dim,
        "context": ctx,
        "bits": bits,
    }


def bench_attention(dev: torch.device, hbm: float, sweep: bool, baseline=None) -> list[dict]:
    """`decode_attention` over int4 / int8 caches (group 64, asymmetric, fp16) and fp16
    SDPA over the same K/V: GB/s of the cache bytes that hold the context (and the bias,
    q and the output) and their share of the HBM copy rate. Each variant's largest
    difference from the default's output (a miscompiled variant shows there); the
    default's from the plain-torch reference (dequantize, SDPA). baseline: an earlier
    kv_attention module (--baseline), whose `decode_attention` runs last, beside ours in
    the same process."""
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
            read = cache.slot_bytes(ctx) + bias.numel() * 2 + 2 * q.numel() * 2
            want = decode_attention(q, cache, bias, ctx)
            reference = decode_attention_reference(q, cache, bias, ctx)
            shape = _attention_shape(model, batch, heads, kv_heads, dim, ctx, bits)
            variants = [(v, decode_attention) for v in ATTENTION_SWEEP[: None if sweep else 2]]
            if baseline is not None:
                variants.append((ATTENTION_SWEEP[0], baseline.decode_attention))
            for variant, attend in variants:
                split_groups, warps, stages, tile_groups, fused_merge, mma = variant
                if split_groups is not None and split_groups > ctx // cache.group:
                    continue
                row = {**shape, "split_groups": split_groups, "warps": warps, "stages": stages}
                row |= {"tile_groups": tile_groups, "fused_merge": fused_merge, "mma": mma}
                row["baseline"] = attend is not decode_attention
                # an earlier module (--baseline) takes no mma argument
                args = variant[:5] if row["baseline"] else variant
                call = functools.partial(attend, q, cache, bias, ctx, *args)
                try:
                    seconds = timed(call)
                except Exception as exc:  # a variant that does not fit shared memory
                    out.append({**row, "error": str(exc)[:200]})
                    print(f"{model} B{batch} int{bits} {variant}: {out[-1]['error']}", flush=True)
                    continue
                got = call()
                row["max_diff_vs_default"] = (got - want).abs().max().item()
                if variant == ATTENTION_SWEEP[0] and not row["baseline"]:
                    row["max_diff_vs_reference"] = (got - reference).abs().max().item()
                out.append({**row, **_rates(read, seconds, hbm, dense), "fp16_sdpa_seconds": dense})
                print(f"{model} B{batch} int{bits} {variant}: {seconds * 1e6:.1f} us", flush=True)
            del cache, want, reference
    return out


# prefill: the block's prompt tokens (12 x 512) through qkv, and the MLP's 4096-row slices
PREFILL_SHAPES = [
    ("opt-30b", "qkv", 6144, 3 * 7168, 7168),
    ("opt-30b", "mlp_in", 4096, 28672, 7168),
]
PREFILL_TILES = [  # Tiles(BLOCK_M, BLOCK_N, K step, warps, stages); the first is the default
    Tiles(128, 128, 64, 8, 3),
    Tiles(128, 128, 64, 4, 3),
    Tiles(128, 256, 64, 8, 3),
    Tiles(64, 128, 64, 4, 4),
    Tiles(128, 64, 64, 4, 4),
    Tiles(128, 128, 128, 8, 3),
    Tiles(256, 128, 64, 8, 3),
]

# decode and mid-sized shapes (--kernels decode): the fused kernel's tiles by rows of x,
# (block_m, block_n, K step, warps, stages, programs an SM, registers); the split
# is the launcher's rule for that many programs an SM (`qmatmul_tiles.split_for`). The launcher's
# own choice (`qmatmul_tiles.ROW_TILES`) runs first at every row count.
DECODE_SHAPES = [
    ("opt-30b", "qkv", 3 * 7168, 7168),
    ("opt-30b", "mlp_out", 7168, 28672),
    ("opt-30b", "out_proj", 7168, 7168),
    ("llama-2-70b", "mlp_in", 2 * 28672, 8192),
]
DECODE_SWEEP = {
    1: [],
    16: [
        (16, 64, 256, 4, 3, 4, None),
        (16, 64, 256, 4, 2, 4, None),
        (16, 64, 256, 4, 3, 2, None),
        (16, 64, 256, 4, 3, 8, None),
        (16, 64, 512, 4, 3, 4, None),
        (16, 64, 512, 4, 2, 4, None),
        (16, 32, 512, 4, 3, 4, None),
        (16, 128, 256, 8, 3, 4, None),
        (16, 64, 256, 4, 3, 4, 168),
        (16, 64, 256, 4, 3, 4, 128),
        (16, 64, 128, 4, 3, 4, None),
        (16, 128, 128, 4, 3, 4, None),
    ],
    32: [
        (32, 64, 256, 4, 3, 4, None),
        (32, 64, 256, 4, 2, 4, None),
        (32, 64, 512, 4, 3, 4, None),
        (32, 128, 256, 8, 3, 4, None),
        (32, 64, 256, 4, 3, 4, 168),
        (32, 64, 256, 4, 3, 8, None),
    ],
    64: [
        (64, 64, 256, 4, 3, 4, None),
        (64, 64, 256, 8, 3, 4, None),
        (64, 128, 128, 8, 3, 4, None),
        (64, 128, 256, 8, 3, 4, None),
        (64, 64, 128, 4, 3, 4, None),
        (32, 64, 256, 4, 3, 4, None),
    ],
    128: [
        (128, 128, 64, 8, 3, 2, None),
        (64, 128, 128, 8, 3, 2, None),
        (32, 64, 256, 4, 3, 4, None),
        (64, 64, 256, 4, 3, 4, None),
    ],
    256: [
        (128, 128, 64, 8, 3, 1, None),
        (64, 128, 128, 8, 3, 1, None),
    ],
}


def bench_decode(dev: torch.device, hbm: float, baseline=None) -> list[dict]:
    """int4-g64 `qlinear` at decode and mid-sized row counts over `DECODE_SWEEP`'s tiles:
    time, share of HBM (compressed bytes read), TFLOP/s, cuBLAS fp16 on the same shape,
    `baseline.qlinear` (an earlier version of the module, --baseline) and the largest
    difference from the launcher's output (a miscompiled variant shows there)."""
    out = []
    for model, name, n, k in DECODE_SHAPES:
        w = torch.randn(n, k, device=dev, dtype=torch.float16)
        q = quantize(w, Compression(4, 64, False))
        for m, sweep in DECODE_SWEEP.items():
            x = torch.randn(m, k, device=dev, dtype=torch.float16)
            flops, read = 2 * m * n * k, q.nbytes + x.numel() * 2 + m * n * 2
            dense = timed(functools.partial(F.linear, x, w), repeat=10)
            reference = qlinear(x, q)
            chosen = qmatmul_tiles.tiles_for(m, n, k, 64, dev)
            # the launcher's choice: `qmatmul_wgmma` where it takes the shape (Hopper, 1-32
            # rows), then the Triton kernel at the tiles it would have had
            variants = [("launcher", chosen, qlinear)]
            if qmatmul_wgmma.eligible(x, q, None):
                variants = [("launcher: wgmma", None, qlinear), ("Triton kernel", chosen, qlinear)]
            for block_m, block_n, max_k, warps, stages, per_sm, registers in sweep:
                tiles = Tiles(block_m, block_n, max_k, warps, stages)
                split = qmatmul_tiles.split_for(m, n, k, tiles, dev, per_sm)
                tiles = tiles._replace(split=split, registers=registers)
                label = f"{block_m}x{block_n}x{max_k} w{warps} s{stages} p{per_sm}"
                label += f" r{registers}" if registers else ""
                variants.append((label, tiles, qlinear))
            if baseline is not None:
                variants.append(("before", None, baseline.qlinear))
            for label, tiles, fn in variants:
                row = {"shape": f"{model} {name}", "rows": m, "variant": label}
                row["tiles"] = list(tiles) if tiles is not None else None
                launcher = label.startswith("launcher")
                call = functools.partial(fn, x, q, None, None if launcher else tiles)
                try:
                    diff = (call() - reference).abs().max().item()
                    seconds = timed(call, repeat=10)
                except Exception as exc:  # a tile that does not fit shared memory
                    out.append({**row, "error": str(exc)[:200]})
                    continue
                print(
                    f"{row['shape']:22s} m{m:<4d} {label:28s} {seconds * 1e6:8.1f} us", flush=True
                )
                out.append(
                    {
                        **row,
                        **_rates(read, seconds, hbm, dense),
                        "tflops": flops / seconds / 1e12,
                        "fp16_tflops": flops / dense / 1e12,
                        "fp16_seconds": dense,
                        "max_diff_vs_launcher": diff,
                    }
                )
        del w, q
    return out


def bench_sweep(dev: torch.device, shapes, tiles_list, hbm: float) -> list[dict]:
    """int4-g64 `qlinear` over tile choices: TFLOP/s, share of HBM (compressed bytes),
    cuBLAS fp16 on the same shape, and the largest difference from the default tiles'
    output (a miscompiled variant shows there)."""
    out = []
    for model, name, m, n, k in shapes:
        w = torch.randn(n, k, device=dev, dtype=torch.float16)
        x = torch.randn(m, k, device=dev, dtype=torch.float16)
        q = quantize(w, Compression(4, 64, False))
        flops = 2 * m * n * k
        read = q.nbytes + x.numel() * 2 + m * n * 2
        dense = timed(functools.partial(F.linear, x, w), repeat=10)
        reference = qlinear(x, q, None, tiles_list[0])
        for tiles in tiles_list:
            chosen = tiles or qmatmul_tiles.tiles_for(m, n, k, 64, dev)
            row = {"shape": f"{model} {name} m{m}", "tiles": list(chosen), "default": tiles is None}
            try:
                diff = (qlinear(x, q, None, tiles) - reference).abs().max().item()
                seconds = timed(functools.partial(qlinear, x, q, None, tiles), repeat=10)
            except Exception as exc:  # a tile that does not fit shared memory
                out.append({**row, "error": str(exc)[:200]})
                continue
            print(f"{row['shape']:24s} {row['tiles']}: {seconds * 1e6:8.1f} us", flush=True)
            out.append(
                {
                    **row,
                    **_rates(read, seconds, hbm, dense),
                    "tflops": flops / seconds / 1e12,
                    "fp16_tflops": flops / dense / 1e12,
                    "fp16_seconds": dense,
                    "max_diff_vs_default": diff,
                }
            )
        del w, x, q
    return out


def bench_launch(dev: torch.device) -> list[dict]:
    """Host time of one launch (a tiny problem, so the GPU never holds the host up)."""
    x = torch.randn(12, 64, device=dev, dtype=torch.float16)
    w = torch.randn(64, 64, device=dev, dtype=torch.float16)
    q = quantize(w, Compression(4, 64, False))
    k = torch.randn(12, 8, 128, 128, device=dev, dtype=torch.float16)
    cache = QuantKV(12, 8, 128, 128, Compression(4, 64, False), k.dtype, dev)
    cache.write(k, k, 0)
    qa = torch.randn(12, 8, 1, 128, device=dev, dtype=torch.float16)
    bias = torch.zeros(12, 1, 1, 128, device=dev, dtype=k.dtype)
    calls = {
        "qlinear": functools.partial(qlinear, x, q),
        "decode_attention": functools.partial(decode_attention, qa, cache, bias, 128),
        "F.linear": functools.partial(F.linear, x, w),
        "torch.empty": functools.partial(torch.empty, (12, 64), device=dev),
        "add_": functools.partial(x.add_, 0.0),
    }
    # beneath `qlinear`: Triton's own launch path, and its compiled launcher called directly
    rows, o = x, torch.empty(12, 64, device=dev, dtype=x.dtype)
    args = [rows, q.codes, q.scale, q.minimum, o, o, o, o, 12, 64, 64, 64]
    consts = dict(BITS=4, GROUP=64, SYMMETRIC=False, HAS_BIAS=False, PRECISION="tf32")
    consts.update(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, STAGES=4, SPLIT=False, PER_SPLIT=1)
    jit = functools.partial(qmatmul._qmatmul_kernel[(1, 1)], *args, **consts, num_warps=4)
    compiled = jit()
    stream = torch.cuda.current_stream().cuda_stream
    calls["triton jit launch"] = jit
    calls["compiled.run"] = functools.partial(
        compiled.run,
        *(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None),
        *args,
        *consts.values(),
    )
    out = []
    for name, fn in calls.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(1000):
            fn()
        host = (time.perf_counter() - started) / 1000
        torch.cuda.synchronize()
        out.append({"call": name, "host_us": host * 1e6})
    return out


# CPU attention (the executor's attention_on_cpu): (model, rows, heads, KV heads,
# head_dim, context); one micro-batch of one layer
CPU = torch.device("cpu")
CPU_ATTENTION_SHAPES = [
    ("opt-30b", 12, 56, 56, 128, 544),
    ("opt-30b", 48, 56, 56, 128, 544),
    ("llama-2-70b", 32, 64, 8, 128, 4096),
]


def dram_rate() -> float:
    """GB/s (read + write) of a 1 GiB host copy: the DRAM ceiling, same run."""
    src = torch.ones(2**30, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    started = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    return 3 * 2 * src.numel() / (time.perf_counter() - started) / 1e9


def bench_cpu_attention(dram: float) -> list[dict]:
    """`decode_attention_cpu` over int4 / int8 caches against fp16 SDPA over the same
    context on the CPU: GB/s of compressed bytes read and their share of the DRAM rate."""
    out = []
    for model, batch, heads, kv_heads, dim, ctx in CPU_ATTENTION_SHAPES:
        k = torch.randn(batch, kv_heads, ctx, dim, dtype=torch.float16)
        v = torch.randn_like(k)
        q = torch.randn(batch, heads, 1, dim, dtype=torch.float16)
        bias = torch.zeros(batch, 1, 1, ctx, dtype=q.dtype)
        sdpa = functools.partial(
            F.scaled_dot_product_attention, q, k, v, attn_mask=bias, enable_gqa=True
        )
        dense = _host_timed(sdpa)
        full = 2 * k.numel() * k.element_size()
        for bits in (4, 8):
            cache = QuantKV(batch, kv_heads, dim, ctx, Compression(bits, 64, False), q.dtype, CPU)
            cache.write(k, v, 0)
            seconds = _host_timed(functools.partial(decode_attention_cpu, q, cache, bias, ctx))
            out.append(
                {
                    **_attention_shape(model, batch, heads, kv_heads, dim, ctx, bits),
                    "seconds": seconds,
                    "compressed_gbps": cache.slot_bytes(ctx) / seconds / 1e9,
                    "dram_share": cache.slot_bytes(ctx) / seconds / 1e9 / dram,
                    "fp16_sdpa_seconds": dense,
                    "fp16_sdpa_gbps": full / dense / 1e9,
                    "speedup_vs_fp16_sdpa": dense / seconds,
                }
            )
            print(
                f"cpu {model} B{batch} int{bits}: {seconds * 1e3:.1f} ms, "
                f"{out[-1]['compressed_gbps']:.1f} GB/s; fp16 SDPA {dense * 1e3:.1f} ms",
                flush=True,
            )
    return out


def _module_from(path: Path):
    """The module in the file at path (a baseline version of one of ours). A dequant.py
    beside it (the register dequantization the kernels import) stands in for ours while
    it loads, so the baseline runs with its own (`offload.kernels.dequant` after)."""
    helpers = path.with_name("dequant.py")
    ours = sys.modules["offload.kernels.dequant"]
    if helpers.exists() and helpers != path:
        sys.modules["offload.kernels.dequant"] = _load(helpers, "baseline_dequant")
    try:
        return _load(path, f"baseline_{path.stem}")
    finally:
        sys.modules["offload.kernels.dequant"] = ours


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _host_timed(fn, repeat: int = 5) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - started) / repeat


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--kernels",
        default="qlinear,attention",
        help="also: prefill, decode, attention-sweep (sweeps), launch (host cost), "
        "cpu-attention (the CPU's attention over a compressed cache; needs no GPU)",
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument(
        "--baseline",
        type=Path,
        help="an earlier qmatmul.py or kv_attention.py (git show REV:offload/kernels/"
        "qmatmul.py > DIR/qmatmul.py): its qlinear runs beside ours in --kernels decode, "
        "its decode_attention in --kernels attention; with an earlier dequant.py in the "
        "same DIR, it imports that one instead of ours",
    )
    args = p.parse_args()
    kernels = args.kernels.split(",")
    dram = dram_rate() if "cpu-attention" in kernels else 0.0
    cpu_attention = bench_cpu_attention(dram) if "cpu-attention" in kernels else []
    dev = torch.device("cuda")
    hbm = hbm_rate(dev) if set(kernels) - {"cpu-attention"} else 0.0
    baseline = _module_from(args.baseline) if args.baseline else None
    attention = (
        bench_attention(
            dev,
            hbm,
            "attention-sweep" in kernels,
            baseline if hasattr(baseline, "decode_attention") else None,
        )
        if {"attention", "attention-sweep"} & set(kernels)
        else []
    )
    prefill = bench_sweep(dev, PREFILL_SHAPES, PREFILL_TILES, hbm) if "prefill" in kernels else []
    decode = (
        bench_decode(dev, hbm, baseline if hasattr(baseline, "qlinear") else None)
        if "decode" in kernels
        else []
    )
    launch = bench_launch(dev) if "launch" in kernels else []
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
                        **_rates(read, ours, hbm, dense),
                        "fp16_seconds": dense,
                    }
                )
        del w
    res = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "hbm_copy_gbps": hbm,
        "runs": rows_out,
        "attention": attention,
        "prefill": prefill,
        "decode": decode,
        "launch": launch,
        "dram_copy_gbps": dram,
        "cpu_threads": torch.get_num_threads(),
        "cpu_attention": cpu_attention,
    }
    Results("bench_kernels", res, args.out).save()
    print(f"HBM copy rate {hbm:.0f} GB/s; DRAM copy rate {dram:.0f} GB/s")
    for r in cpu_attention:
        print(
            f"cpu {r['model']} B{r['batch']} int{r['bits']}: {r['compressed_gbps']:.1f} GB/s "
            f"({100 * r['dram_share']:.0f}% DRAM), {r['speedup_vs_fp16_sdpa']:.2f}x fp16 SDPA"
        )
    print(
        f"{'shape':24s} {'bits':>4s} {'rows':>5s} {'us':>8s} {'GB/s':>7s} {'HBM%':>5s} {'vs fp16':>7s}"
    )
    for r in rows_out:
        print(
            f"{r['model'] + ' ' + r['matrix']:24s} {r['bits']:4d} {r['rows']:5d} "
            f"{r['seconds'] * 1e6:8.1f} {r['gbps']:7.0f} {100 * r['hbm_share']:5.0f} "
            f"{r['speedup_vs_fp16']:7.2f}"
        )
    for r in decode:
        if "error" in r:
            print(f"{r['shape']:22s} m{r['rows']:<4d} {r['variant']:28s} {r['error']}")
        else:
            print(
                f"{r['shape']:22s} m{r['rows']:<4d} {r['variant']:28s} {r['seconds'] * 1e6:8.1f} us "
                f"HBM {100 * r['hbm_share']:3.0f}% {r['tflops']:6.1f} TFLOP/s "
                f"(fp16 {r['fp16_seconds'] * 1e6:.1f} us) diff {r['max_diff_vs_launcher']:.2g}"
            )
    for r in prefill:
        if "error" in r:
            print(f"{r['shape']:24s} {r['tiles']}: {r['error']}")
        else:
            print(
                f"{r['shape']:24s} {r['tiles']}: {r['seconds'] * 1e6:8.1f} us "
                f"{r['tflops']:6.1f} TFLOP/s (fp16 {r['fp16_tflops']:.1f}) "
                f"HBM {100 * r['hbm_share']:3.0f}% diff {r['max_diff_vs_default']:.2g}"
            )
    for r in launch:
        print(f"launch {r['call']:20s} {r['host_us']:6.1f} us host")
    print_attention(attention)


def print_attention(attention: list[dict]) -> None:
    """The attention sweep's rows (variant: split groups ('auto': the launcher's
    choice) / warps / stages / tile groups, /fused: the merge in the kernel, /triton: the
    Triton kernel where `kv_attention_mma` is eligible; diff: the default's largest
    difference from the reference, the others' from the default),
    then a short table: each shape's default and best variant, and the variants by
    their mean time against the default."""
    rows = [r for r in attention if "error" not in r]

    def variant(r: dict) -> str:
        if r.get("baseline"):
            return "before (--baseline)"
        split = "auto" if r["split_groups"] is None else r["split_groups"]
        fused = "/fused" if r["fused_merge"] else ""
        mma = {None: "", False: "/triton", True: "/mma"}[r.get("mma")]
        return f"{split}/w{r['warps']}/s{r['stages']}/t{r['tile_groups']}{fused}{mma}"

    head = f"{'attention':26s} {'variant':20s} {'bits':>4s} {'us':>7s} {'GB/s':>6s} {'HBM%':>5s}"
    print(f"\n{head} {'vs fp16':>7s} {'diff':>8s}")
    for r in attention:
        shape = f"{r['model']} B{r['batch']} S{r['context']}"
        if "error" in r:
            print(f"{shape:26s} {variant(r):20s} {r['bits']:4d} {r['error'][:60]}")
            continue
        diff = r.get("max_diff_vs_reference", r["max_diff_vs_default"])
        print(
            f"{shape:26s} {variant(r):20s} {r['bits']:4d} {r['seconds'] * 1e6:7.1f} "
            f"{r['gbps']:6.0f} {100 * r['hbm_share']:5.0f} {r['speedup_vs_fp16']:7.2f} {diff:8.2g}"
        )
    cases: dict[tuple, list[dict]] = {}
    for r in rows:
        cases.setdefault((r["model"], r["batch"], r["context"], r["bits"]), []).append(r)
    print(
        f"\n{'attention, default / best':26s} {'bits':>4s} {'HBM%':>5s} {'best':>5s} best variant"
    )
    ratios: dict[str, list[float]] = {}
    for (model, batch, ctx, bits), group in cases.items():
        default, best = group[0], min(group, key=lambda r: r["seconds"])
        if "max_diff_vs_reference" not in default:
            continue  # the default variant failed
        print(
            f"{f'{model} B{batch} S{ctx}':26s} {bits:4d} {100 * default['hbm_share']:5.0f} "
            f"{100 * best['hbm_share']:5.0f} {variant(best)}"
        )
        for r in group:
            ratios.setdefault(variant(r), []).append(r["seconds"] / default["seconds"])
    ranked = sorted(ratios.items(), key=lambda kv: math.prod(kv[1]) ** (1 / len(kv[1])))
    print("variants by geometric-mean time against the default (cases measured):")
    for name, values in ranked:
        print(f"  {name:20s} {math.prod(values) ** (1 / len(values)):5.2f} ({len(values)})")


if __name__ == "__main__":
    main()
