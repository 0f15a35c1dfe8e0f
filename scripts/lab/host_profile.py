"""Where the host's decode time goes: Python's profiler over a plan's decode steps.

    python scripts/lab/host_profile.py --model llama-3.1-8b \
        --policies w4gpu-kv4-cpu-disk-gpuattn-8x2,w4gpu-kv4-cpu-gpuattn-8x2 --nvme DIR

Each hand policy (`validate_cost_model.py`'s) generates one block through the engine's
own loop (`validate_cost_model.measure_policy`: dummy weights, prompt 512, gen 32)
twice: once plain, for the step time, then with `cProfile` on for every decode step
after the first six (the warm-up's and the first compiles). On Python 3.12 the
profiler sees every thread (the transfer workers too), and it slows the step about 2x:
read the counts of calls a step and their shares, not the absolute times. Prints and
writes each policy's table (by own time, then by cumulative time) to --out.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time
from pathlib import Path

import _path  # noqa: F401  (scripts/ on the path)
import torch
from validate_cost_model import hand_policies, measure_policy

from offload.executor import executor as executor_module
from offload.models.resolve import resolve_model

SKIPPED_STEPS = 6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b", help="a preset (dummy weights)")
    p.add_argument("--policies", default="w4gpu-kv4-cpu-disk-gpuattn-8x2")
    p.add_argument("--nvme", type=Path, default=Path("."), help="where KV spills to disk")
    p.add_argument("--lines", type=int, default=45, help="rows of each table")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    plans = hand_policies()
    for name in args.policies.split(","):
        if name not in plans:
            p.error(f"--policies: {name!r} is not a hand policy; they are {', '.join(plans)}")
    spec = resolve_model(args.model, dummy=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    plain_forward = executor_module.Executor.forward
    stamp = time.strftime("%Y%m%d-%H%M")
    for name in args.policies.split(","):
        profiler = cProfile.Profile()
        seen = {"decode": 0, "profiled": 0, "seconds": 0.0}

        def forward(self, token_ids, step, last_only=True, wait=True, seen=seen, prof=profiler):
            if token_ids.shape[1] == 1:
                seen["decode"] += 1
                if seen["decode"] > SKIPPED_STEPS:
                    started = time.perf_counter()
                    prof.enable()
                    try:
                        return plain_forward(self, token_ids, step, last_only, wait)
                    finally:
                        prof.disable()
                        seen["profiled"] += 1
                        seen["seconds"] += time.perf_counter() - started
            return plain_forward(self, token_ids, step, last_only, wait)

        steps = {}
        try:
            for profiled in (False, True):
                executor_module.Executor.forward = forward if profiled else plain_forward
                got = measure_policy(spec, plans[name], dtype, device, 512, 32, nvme_dir=args.nvme)
                steps[profiled] = got["decode_step_s"]
        finally:
            executor_module.Executor.forward = plain_forward
        text = io.StringIO()
        count = max(seen["profiled"], 1)
        print(
            f"== {args.model} {name}: decode step {steps[False] * 1e3:.1f} ms plain, "
            f"{steps[True] * 1e3:.1f} ms profiled; {seen['profiled']} steps profiled, "
            f"{seen['seconds'] / count * 1e3:.1f} ms each",
            file=text,
        )
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("tottime").print_stats(args.lines)
        stats.sort_stats("cumulative").print_stats(args.lines)
        for folder in {args.out, Path(os.environ.get("OUT", args.out))}:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"host_profile_{args.model}_{name}_{stamp}.txt").write_text(text.getvalue())
        print("\n".join(text.getvalue().splitlines()[: args.lines + 12]), flush=True)


if __name__ == "__main__":
    main()
