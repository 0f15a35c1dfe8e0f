"""A compressed expert on the CPU against this machine's DRAM read rate, measured in the
same run.

    python scripts/bench_cpu_expert.py [--shapes mixtral,deepseek-v3] [--rows 1,8,32]
                                       [--threads N] [--cpu-time] [--quick] [--out DIR]

For each expert shape (SwiGLU: hidden x intermediate) and format (int4 and int8, groups
of 64, asymmetric, float16 values), at each row count (a cold expert's decode rows):
the C kernel (`kernels/cpu_expert_native.expert_mlp`, what `cpu_expert_mlp` runs), and
at 8 rows the plain-torch path it replaces (dequantize 256 output rows at a time, then
multiply). Rates count the expert's weight bytes as stored (codes, scales, minimums)
over the best call's time, and their share of the DRAM read rate (all threads reading
2 GiB: the kernel library's own loads, and torch's sum; the higher, measured before and
after the runs). Each call reads a different copy of the expert, at least 1 GiB of
copies a case, so none is served from the last-level cache. Each case's output is
checked against the float32 reference (`expert_mlp_reference`) on its first copy.

Runs on torch's thread count (all cores unless --threads or OMP_NUM_THREADS says
otherwise). --cpu-time (one thread) times by the thread's CPU time, not the wall clock:
on a machine others share, time spent descheduled is not counted. Prints one table; the JSON goes to --out (and $OUT) only where CUDA exists (the GPU machine's
host is the one the profile measures).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from offload.kernels import cpu_expert_native, native
from offload.kernels.cpu_expert import _linear, expert_mlp_reference
from offload.kernels.formats import Compression
from offload.kernels.quant import QTensor, quantize
from offload.policies.hardware import code_version

GB = 1e9
# name: (hidden, intermediate) of one routed expert
SHAPES = {
    "mixtral": (4096, 14336),
    "deepseek-v3": (7168, 2048),
    "qwen3-235b": (4096, 1536),
}
FORMATS = {"int4-g64": Compression(4, 64), "int8-g64": Compression(8, 64)}
COPY_BYTES = 1 << 30  # bytes of expert copies a case cycles through (past any LLC)
TORCH_ROWS = 8  # the rows at which the plain-torch path is timed too


def machine() -> dict:
    """The CPU, its vector ISA and the thread count."""
    model = ""
    try:
        with open("/proc/cpuinfo") as info:
            model = next(
                (line.split(":", 1)[1].strip() for line in info if "model name" in line), ""
            )
    except OSError:
        pass
    lib = cpu_expert_native._library() if native.enabled() else None
    return {
        "cpu": model or platform.processor(),
        "threads": torch.get_num_threads(),
        "native_vector_bits": lib.vector_bits() if lib is not None else None,
    }


def dram_read_gbps() -> dict:
    """GB/s of a 2 GiB read by all threads: the kernel library's loads, and torch's sum."""
    buffer = torch.ones(1 << 29)
    rates = {"c_read": None}
    if CLOCK[0] is time.perf_counter:  # (the library times by the wall clock)
        rates["c_read"] = cpu_expert_native.read_gbps(buffer)
    buffer.sum()
    best = min(_timed(lambda: buffer.sum()) for _ in range(3))
    rates["torch_sum"] = buffer.numel() * 4 / best / GB
    rates["best"] = max(r for r in rates.values() if r is not None)
    return rates


CLOCK = [time.perf_counter]  # time.thread_time with --cpu-time


def _timed(fn) -> float:
    started = CLOCK[0]()
    fn()
    return CLOCK[0]() - started


def _copy(w: QTensor) -> QTensor:
    minimum = None if w.minimum is None else w.minimum.clone()
    return QTensor(w.codes.clone(), w.scale.clone(), minimum, w.shape, w.dtype, w.config)


def experts(hidden: int, inter: int, config: Compression, gen: torch.Generator) -> list:
    """Copies of one expert (mlp_in, mlp_out) as stored, COPY_BYTES of them at least."""
    mlp_in = quantize((torch.randn(2 * inter, hidden, generator=gen) / hidden**0.5).half(), config)
    mlp_out = quantize((torch.randn(hidden, inter, generator=gen) / inter**0.5).half(), config)
    count = max(2, -(-COPY_BYTES // (mlp_in.nbytes + mlp_out.nbytes)))
    return [(mlp_in, mlp_out)] + [(_copy(mlp_in), _copy(mlp_out)) for _ in range(count - 1)]


def _torch_path(x, mlp_in, mlp_out):
    """The plain-torch path `cpu_expert_mlp` takes where the kernel does not run."""
    with _native_off():
        gate, up = _linear(x, mlp_in).chunk(2, dim=-1)
        return _linear(torch.nn.functional.silu(gate).mul_(up), mlp_out)


class _native_off:
    def __enter__(self):
        self.before = os.environ.get("OFFLOAD_NATIVE")
        os.environ["OFFLOAD_NATIVE"] = "0"

    def __exit__(self, *exc):
        if self.before is None:
            os.environ.pop("OFFLOAD_NATIVE", None)
        else:
            os.environ["OFFLOAD_NATIVE"] = self.before


def best_seconds(call, copies: list, passes: int) -> float:
    """The least seconds of a call over `passes` passes through every copy (one warm call)."""
    call(*copies[0])
    return min(_timed(lambda c=c: call(*c)) for _ in range(passes) for c in copies)


def run_case(hidden, inter, config, rows, gen, passes) -> list[dict]:
    copies = experts(hidden, inter, config, gen)
    nbytes = copies[0][0].nbytes + copies[0][1].nbytes
    out = []
    for n in rows:
        x = torch.randn(n, hidden, generator=gen).half()
        want = expert_mlp_reference(x.float(), *copies[0])
        got = cpu_expert_native.expert_mlp(x, *copies[0])
        error = ((got - want).abs().max() / want.abs().max()).item()
        variants = {"kernel": lambda a, b, x=x: cpu_expert_native.expert_mlp(x, a, b)}
        if n == TORCH_ROWS:
            variants["torch"] = lambda a, b, x=x: _torch_path(x, a, b)
        for variant, call in variants.items():
            seconds = best_seconds(call, copies if variant == "kernel" else copies[:3], passes)
            row = {"rows": n, "variant": variant, "ms": seconds * 1e3, "bytes": nbytes}
            row["gbps"] = nbytes / seconds / GB
            row["relative_error"] = error if variant == "kernel" else None
            out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--threads", type=int, default=0, help="torch's threads (0: as set)")
    p.add_argument("--cpu-time", action="store_true", help="one thread, timed in CPU time")
    p.add_argument("--quick", action="store_true", help="one shape, one pass")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        if torch.get_num_threads() != 1:
            p.error("--cpu-time times one thread: add --threads 1")
        CLOCK[0] = time.thread_time
    shapes = args.shapes.split(",")[:1] if args.quick else args.shapes.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    before = dram_read_gbps()
    results = []
    for name in shapes:
        hidden, inter = SHAPES[name]
        for fmt, config in FORMATS.items():
            for row in run_case(hidden, inter, config, rows, gen, 1 if args.quick else 3):
                results.append({"shape": name, "format": fmt, **row})
                print(_line(results[-1]), flush=True)
    after = dram_read_gbps()
    dram = max(before["best"], after["best"])
    for row in results:
        row["dram_share"] = row["gbps"] / dram
    print(f"\nDRAM read {dram:.1f} GB/s (before {before}, after {after})")
    print(_header())
    for row in results:
        print(_line(row))
    result = {
        "machine": machine(),
        "clock": "thread CPU time" if args.cpu_time else "wall",
        "dram_read_gbps": {"before": before, "after": after, "best": dram},
        "code_version": code_version(),
        "results": results,
    }
    if torch.cuda.is_available():
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for out in {args.out, Path(os.environ.get("OUT", args.out))}:
            out.mkdir(parents=True, exist_ok=True)
            (out / f"bench_cpu_expert_{stamp}.json").write_text(json.dumps(result, indent=1))


def _header() -> str:
    head = f"{'shape':12} {'format':9} {'rows':>4} {'variant':7} {'ms':>8} {'GB/s':>7} {'DRAM':>5}"
    return head + f" {'error':>8}"


def _line(row: dict) -> str:
    share = f"{row['dram_share']:.0%}" if "dram_share" in row else ""
    error = "" if row["relative_error"] is None else f"{row['relative_error']:.1e}"
    return (
        f"{row['shape']:12} {row['format']:9} {row['rows']:>4} {row['variant']:7} "
        f"{row['ms']:8.2f} {row['gbps']:7.2f} {share:>5} {error:>8}"
    )


if __name__ == "__main__":
    main()
