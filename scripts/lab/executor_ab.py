"""Executor settings of the host side, one against another in one process (a diagnostic).

    python scripts/lab/executor_ab.py --model llama-3.1-8b \
        --policies w4gpu-kv4-cpu-disk-gpuattn-8x2,w4gpu-kv-cpu-disk-gpuattn-8x2 --reps 2
    python scripts/lab/executor_ab.py --model llama-3.1-8b --depths 4 \
        --switch-intervals 0.005,0.0002 --policies w4gpu-kv4-cpu-disk-gpuattn-8x2

The settings: the disk-KV staging depth (`Executor(disk_buffers=...)`) and the
interpreter's thread switch interval (`sys.setswitchinterval`: how long a worker
thread that wants the GIL waits before it asks the holder to drop it). Each repetition
generates one block of each hand policy (`validate_cost_model.py`'s) at each setting in
turn, through the engine's own loop (`validate_cost_model.measure_policy`), so a drift
of the machine falls on every setting alike. Dummy weights, prompt 512, gen 32; KV
spills to --nvme. Prints each run's decode step and writes every run to JSON in --out
(and $OUT).
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import _path  # noqa: F401  (scripts/ on the path)
import torch
from benchlib import Results
from validate_cost_model import hand_policies, measure_policy

from offload.io.spill import SWITCH_INTERVAL_S
from offload.models.resolve import resolve_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b", help="a preset (dummy weights)")
    p.add_argument("--policies", default="w4gpu-kv4-cpu-disk-gpuattn-8x2")
    p.add_argument("--depths", default="2,4", help="disk staging blocks, in turn")
    p.add_argument(
        "--switch-intervals",
        default="",
        help="seconds, in turn (default: the interval the engine sets)",
    )
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--nvme", type=Path, default=Path("."), help="where KV spills to disk")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    plans = hand_policies()
    names = args.policies.split(",")
    for name in names:
        if name not in plans:
            p.error(f"--policies: {name!r} is not a hand policy; they are {', '.join(plans)}")
    try:
        depths = [int(d) for d in args.depths.split(",")]
        intervals = [float(s) for s in args.switch_intervals.split(",") if s] or [None]
    except ValueError as err:
        p.error(f"--depths / --switch-intervals: {err}; give comma-separated numbers")
    spec = resolve_model(args.model, dummy=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    runs: dict[str, list[dict]] = {}
    for _ in range(args.reps):
        for depth, interval in itertools.product(depths, intervals):
            for name in names:
                label = f"{name} depth {depth}"
                if interval is not None:
                    label += f" switch {interval * 1e3:g} ms"
                got = measure_policy(
                    spec, plans[name], dtype, device, args.prompt_len, args.gen_len,
                    disk_buffers=depth, nvme_dir=args.nvme, switch_interval=interval,
                )  # fmt: skip
                # the interval the run had (the executor puts the process's back at close)
                got["switch_interval_s"] = SWITCH_INTERVAL_S if interval is None else interval
                runs.setdefault(label, []).append(got)
                print(
                    f"{label}: step {got['decode_step_s'] * 1e3:.1f} ms, "
                    f"{got['total_tok_s']:.1f} tok/s",
                    flush=True,
                )
    result = {
        "model": args.model,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "runs": runs,
    }
    Results(f"executor_ab_{args.model}", result, args.out).save()


if __name__ == "__main__":
    main()
