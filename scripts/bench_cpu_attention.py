"""CPU decode attention against this machine's DRAM read rate, measured in the same run.

    python scripts/bench_cpu_attention.py [--shapes opt-30b-b12,...] [--out DIR]

For each shape (OPT-30B at 12 and 48 sequences, Llama-2-70B at 32, the profile's, all
at head_dim 128) and cache (fp16; int4 and int8, groups of 64, asymmetric), every
variant: torch SDPA (what `decoder.attend` ran before) and the C kernel
(`kernels/cpu_attention.py`) over the fp16 cache; the torch path
(`kv_attention_cpu.decode_attention_cpu_torch`) and the C kernel over a compressed one.
Each is timed alone and, where CUDA exists, while a background thread keeps pinned
host -> GPU copies running (they read the same DRAM, as the executor's weight stream
does), and its output is checked against the reference (SDPA in float32 over the
cache, dequantized for a compressed one) on two sequences: within 2x the error of
torch's own SDPA at fp16 (the tests' bound).

Rates count the bytes each call reads: the cache as stored (`GB/s`, and its share of
the DRAM read rate of all threads, measured alone before and after the runs: the
higher of the two), and K/V at fp16's size (`fp16 GB/s`, what the profile reports).
Each call reads a different copy of the cache, at least 1 GiB of copies a case, so no
shape is served from the last-level cache.
Runs on torch's thread count (all cores unless OMP_NUM_THREADS says otherwise); about
60 s on a 16-core host. Prints one table last and writes JSON to --out (and $OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from offload.kernels import cpu_attention, native
from offload.kernels.formats import Compression
from offload.kernels.kv_attention_cpu import decode_attention_cpu_torch
from offload.kernels.kv_cache import QuantKV
from offload.policies.hardware import code_version

GB = 1e9
CPU = torch.device("cpu")
# name: (sequences, query heads, KV heads, context)
SHAPES = {
    "opt-30b-b12": (12, 56, 56, 544),
    "opt-30b-b48": (48, 56, 56, 544),
    "llama-2-70b-b32": (32, 64, 8, 4096),
    "profile": (16, 32, 32, 1024),
}
HEAD_DIM = 128
COPY_BYTES = 1 << 30  # bytes of cache copies a case cycles through (past any LLC)
CHECKED_ROWS = 2


def machine() -> dict:
    """The CPU, its vector ISA and the OpenMP runtimes this process has loaded."""
    model = ""
    try:
        with open("/proc/cpuinfo") as info:
            model = next(
                (line.split(":", 1)[1].strip() for line in info if "model name" in line), ""
            )
        with open("/proc/self/maps") as maps:
            omp = sorted({line.split()[-1] for line in maps if "gomp" in line or "libomp" in line})
    except OSError:
        omp = []
    lib = cpu_attention._library() if native.enabled() else None
    return {
        "cpu": model or platform.processor(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "native_vector_bits": lib.vector_bits() if lib is not None else None,
        "openmp_runtimes": omp,
    }


class H2DCopies:
    """Pinned host -> GPU copies kept running on a side stream by a thread that waits
    on blocking events (it takes no core while the copies run)."""

    def __init__(self, nbytes: int = 1 << 28) -> None:
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.gpu = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.stream = torch.cuda.Stream()
        self.copied, self.seconds = 0, 0.0

    def __enter__(self) -> H2DCopies:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.started = time.perf_counter()
        self.thread.start()
        time.sleep(0.05)  # the first copies are under way
        return self

    def _run(self) -> None:
        with torch.cuda.stream(self.stream):
            while not self.stop.is_set():
                for _ in range(4):
                    self.gpu.copy_(self.host, non_blocking=True)
                done = torch.cuda.Event(blocking=True)
                done.record(self.stream)
                done.synchronize()
                self.copied += 4 * self.host.numel()

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.seconds += time.perf_counter() - self.started

    @property
    def gbps(self) -> float:
        return self.copied / max(self.seconds, 1e-9) / GB


def dram_read_gbps(copies: H2DCopies | None = None) -> dict:
    """GB/s of a 2 GiB read by all threads: through the C kernel's loads, and torch's sum."""
    buffer = torch.ones(1 << 29)  # 2 GiB of float32
    rates = {}
    with copies or _Nothing():
        rates["c_read"] = cpu_attention.read_gbps(buffer)
        rates["torch_sum"] = _timed_rate(lambda: buffer.sum(), buffer.numel() * 4, 3)
    rates["best"] = max(r for r in rates.values() if r is not None)
    return rates


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _timed_rate(fn, nbytes: int, calls: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return calls * nbytes / (time.perf_counter() - started) / GB


def _check(out: torch.Tensor, ref: torch.Tensor, torch_out: torch.Tensor) -> dict:
    """Our first rows against the float32 reference: within 2x torch's own error."""
    rows = ref.shape[0]
    ours = (out[:rows].double() - ref).abs().max().item()
    bound = 2 * (torch_out.double() - ref).abs().max().item() + 1e-5 * ref.abs().max().item()
    return {"max_error": ours, "bound": bound, "ok": ours <= bound}


def _sdpa(q, keys, values, bias) -> torch.Tensor:
    """attend's decode before the kernel: grouped query heads as rows over their KV head."""
    batch, heads, _, dim = q.shape
    grouped = q.view(batch, keys.shape[1], heads // keys.shape[1], dim)
    return F.scaled_dot_product_attention(grouped, keys, values, attn_mask=bias).reshape(
        batch, 1, heads * dim
    )


def cases(name: str, gen: torch.Generator):
    """(cache, stored bytes, fp16 bytes, {variant: call(copy)}, reference check) a cache
    format of shape `name`; each call takes the index of the copy it reads."""
    rows, heads, kv_heads, ctx = SHAPES[name]
    k = torch.randn(rows, kv_heads, ctx, HEAD_DIM, generator=gen).half()
    v = torch.randn(rows, kv_heads, ctx, HEAD_DIM, generator=gen).half()
    q = torch.randn(rows, heads, 1, HEAD_DIM, generator=gen).half()
    bias = torch.zeros(rows, 1, 1, ctx, dtype=torch.float16)
    fp16_bytes = 2 * k.numel() * 2
    few = slice(0, CHECKED_ROWS)
    ref = _sdpa(q[few].float(), k[few].float(), v[few].float(), bias[few].float()).double()
    copies = max(1, min(8, -(-COPY_BYTES // fp16_bytes)))
    ks = [k] + [k.clone() for _ in range(copies - 1)]
    vs = [v] + [v.clone() for _ in range(copies - 1)]
    variants = {
        "torch-sdpa": lambda i: _sdpa(q, ks[i], vs[i], bias),
        "native": lambda i: cpu_attention.decode_attention_dense(q, ks[i], vs[i], bias),
    }
    torch_out = _sdpa(q[few], k[few], v[few], bias[few])
    yield "fp16", fp16_bytes, fp16_bytes, copies, variants, (ref, torch_out)
    ks.clear(), vs.clear()  # (the copies are done with)
    for bits in (4, 8):
        config = Compression(bits, 64)
        cache = QuantKV(rows, kv_heads, HEAD_DIM, ctx, config, torch.float16, CPU)
        cache.write(k, v, 0)
        stored = cache.slot_bytes(ctx)
        copies = max(1, min(8, -(-COPY_BYTES // stored)))
        caches = [cache]
        for _ in range(copies - 1):
            other = QuantKV(rows, kv_heads, HEAD_DIM, ctx, config, torch.float16, CPU)
            other.copy_from(cache)
            caches.append(other)
        keys, values = cache.rows(0, CHECKED_ROWS).dequantized(ctx, torch.float32)
        ref = _sdpa(q[few].float(), keys, values, bias[few].float()).double()
        torch_out = _sdpa(q[few], keys.half(), values.half(), bias[few])
        variants = {
            "torch": lambda i, c=caches: decode_attention_cpu_torch(q, c[i], bias, ctx),
            "native": lambda i, c=caches: cpu_attention.decode_attention_quant(q, c[i], bias, ctx),
        }
        yield f"int{bits}-g64", stored, fp16_bytes, copies, variants, (ref, torch_out)


def time_variant(call, copies: int, min_calls: int = 4) -> tuple[float, torch.Tensor]:
    """Mean seconds a call over at least min_calls calls cycling the copies (after one
    warm-up call), and the first copy's output."""
    out = call(0)
    calls = max(min_calls, copies)
    times = []
    for index in range(calls):
        started = time.perf_counter()
        call((index + 1) % copies)
        times.append(time.perf_counter() - started)
    return statistics.mean(times), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    started = time.perf_counter()
    build = time.perf_counter()
    available = cpu_attention.available(compressed=True)  # builds the kernel once
    build = time.perf_counter() - build
    info = machine()
    copies = H2DCopies() if torch.cuda.is_available() else None
    dram = dram_read_gbps()
    dram_copying = dram_read_gbps(copies) if copies else None
    print(
        f"{info['cpu']}, {info['threads']} threads, {info['torch_cpu_capability']}; kernel "
        f"{'built' if available else 'NOT available'} ({build:.1f} s, "
        f"{info['native_vector_bits']}-bit vectors), OpenMP {info['openmp_runtimes']}",
        flush=True,
    )
    print(f"DRAM read {dram['best']:.1f} GB/s alone {dram}", flush=True)
    if dram_copying:
        print(f"DRAM read while copying to the GPU ({copies.gbps:.1f} GB/s): {dram_copying}")
    gen = torch.Generator().manual_seed(0)
    runs = []
    for name in args.shapes.split(","):
        for cache, stored, fp16_bytes, n_copies, variants, (ref, torch_out) in cases(name, gen):
            for variant, call in variants.items():
                if variant == "native" and call(0) is None:
                    continue  # the kernel does not run here for this cache
                row = {"shape": name, "cache": cache, "variant": variant, "copies": n_copies}
                row["stored_bytes"], row["fp16_bytes"] = stored, fp16_bytes
                seconds, out = time_variant(call, n_copies)
                row["check"] = _check(out, ref, torch_out)
                row["alone"] = _rates(seconds, stored, fp16_bytes, dram["best"])
                if copies:
                    with copies:
                        seconds, _ = time_variant(call, n_copies)
                    row["copying"] = _rates(seconds, stored, fp16_bytes, dram["best"])
                runs.append(row)
                print(_line(row), flush=True)
    result = {
        "code_version": code_version(),
        "torch": torch.__version__,
        **info,
        "kernel_build_seconds": build,
        "dram_read_gbps": dram,
        "dram_read_gbps_copying": dram_copying,
        "h2d_gbps_background": copies.gbps if copies else None,
        "runs": runs,
        "seconds": time.perf_counter() - started,
    }
    # measured again after the runs: on a shared host the higher figure is the machine's
    dram_after = dram_read_gbps()
    best = max(dram["best"], dram_after["best"])
    for row in runs:
        for rates in (row["alone"], row.get("copying")):
            if rates:
                rates["dram_share"] = rates["gbps"] / best
    result["dram_read_gbps_after"] = dram_after
    result["dram_read_gbps_best"] = best
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for out in {args.out, Path(os.environ.get("OUT", args.out))}:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"bench_cpu_attention_{stamp}.json").write_text(json.dumps(result, indent=1))
    print(
        f"\nDRAM read {best:.1f} GB/s ({info['threads']} threads; {dram['best']:.1f} before the "
        f"runs, {dram_after['best']:.1f} after); GB/s of the cache as stored; "
        f"{time.perf_counter() - started:.0f} s"
    )
    print(_header(copies is not None))
    for row in runs:
        print(_line(row))


def _rates(seconds: float, stored: int, fp16_bytes: int, dram: float) -> dict:
    return {
        "ms": seconds * 1e3,
        "gbps": stored / seconds / GB,
        "dram_share": stored / seconds / GB / dram,
        "fp16_gbps": fp16_bytes / seconds / GB,
    }


def _header(copying: bool) -> str:
    extra = f" {'copying: ms':>11} {'GB/s':>6} {'DRAM':>5}" if copying else ""
    return f"{'shape':16} {'cache':8} {'variant':10} {'ms':>8} {'GB/s':>6} {'DRAM':>5} {'fp16 GB/s':>9}{extra} check"


def _line(row: dict) -> str:
    a = row["alone"]
    text = (
        f"{row['shape']:16} {row['cache']:8} {row['variant']:10} {a['ms']:8.2f} "
        f"{a['gbps']:6.1f} {100 * a['dram_share']:4.0f}% {a['fp16_gbps']:9.1f}"
    )
    if "copying" in row:
        c = row["copying"]
        text += f" {c['ms']:11.2f} {c['gbps']:6.1f} {100 * c['dram_share']:4.0f}%"
    check = row["check"]
    return text + (
        " ok" if check["ok"] else f" FAIL {check['max_error']:.2g} > {check['bound']:.2g}"
    )


if __name__ == "__main__":
    main()
