"""Where a plan's step time goes: the executor's lane trace of a model cut to a few layers.

    python scripts/trace_plan.py --model bloom --policy policy.json --layers 4 \
        --prompt-len 512 --out DIR [--nvme DIR] [--cprofile-first]
    python scripts/trace_plan.py --from-trace benchmarks/results/bench_176b_<stamp>_bloom_trace.json

Runs the policy's block (prefill twice, the second warm, then decode steps) on the
preset cut to `--layers` layers at full width (embedding, head, ring slots and
per-layer buffers at full size) with the executor's tracer on, prints each lane's busy
time against the wall time of the warm prefill and of the last decode step, and writes
the last decode step's Chrome trace (`chrome://tracing` or Perfetto) and a JSON summary
to --out.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import time
from pathlib import Path

import torch

from offload.executor.executor import Executor
from offload.executor.lanes import layer_timeline, read_chrome
from offload.models.batch import PaddedBatch
from offload.models.resolve import resolve_model
from offload.models.weights import DummySource
from offload.policies.policy import Policy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bloom", help="a preset (dummy weights)")
    p.add_argument("--policy", type=Path, help="policy JSON (offload-plan's)")
    p.add_argument(
        "--from-trace",
        type=Path,
        help="only print the per-layer timeline of a Chrome trace already written "
        "(offload-run --trace, bench_176b's _bloom_trace.json)",
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="decode steps after the prefill")
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--nvme", type=Path, help="fast-disk directory (policies with disk tiers)")
    p.add_argument(
        "--untraced-steps",
        type=int,
        default=0,
        help="then time this many decode steps with the tracer off (what the trace's own "
        "events and spans cost the step)",
    )
    p.add_argument(
        "--warm-up",
        action="store_true",
        help="run the executor's load-time warm-up (Executor.warm_up) before the first prefill",
    )
    p.add_argument(
        "--cprofile-first",
        action="store_true",
        help="run the first prefill under cProfile and print where its extra time goes "
        "(its functions by cumulative time; the text also goes to --out)",
    )
    p.add_argument(
        "--kernels",
        action="store_true",
        help="then run the block again under torch.profiler and print the GPU time a "
        "layer by kernel, for the prefill and for a decode step (warm: kernels compiled)",
    )
    args = p.parse_args()
    if args.from_trace is not None:
        for row in layer_timeline(read_chrome(args.from_trace))["rows"]:
            print(row)
        return
    if args.policy is None:
        p.error("--policy is required (or --from-trace)")
    cfg = dataclasses.replace(resolve_model(args.model, dummy=True).config, num_layers=args.layers)
    policy = Policy.from_file(args.policy)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    began = time.perf_counter()
    ex = Executor(DummySource(cfg), policy, dtype, device, nvme_dir=args.nvme, trace=True)
    if args.warm_up:
        ex.warm_up()
    load_s = time.perf_counter() - began
    prompts = [[5 + row % 100] * args.prompt_len for row in range(policy.block_size)]
    batch = PaddedBatch(cfg, prompts, args.steps + args.untraced_steps + 1, pad_id=1)
    ex.start(batch)
    profiler = cProfile.Profile() if args.cprofile_first else None
    began = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    ex.forward(batch.prompt_ids, ex.step_inputs(batch, 0, args.prompt_len))
    first_prefill_s = time.perf_counter() - began
    if profiler is not None:
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"first_prefill_{args.model}_{args.layers}l_cprofile.txt").write_text(
            text.getvalue()
        )
        print(text.getvalue())
    # the same prefill again, warm (its kernels compiled); a traced forward ends by
    # resolving its events, so its time is the GPU's
    began = time.perf_counter()
    ex.forward(batch.prompt_ids, ex.step_inputs(batch, 0, args.prompt_len))
    warm_prefill_s = time.perf_counter() - began
    ids = torch.ones(batch.size, 1, dtype=torch.long)
    for t in range(args.steps):
        ex.forward(ids, ex.step_inputs(batch, args.prompt_len + t, 1))
    args.out.mkdir(parents=True, exist_ok=True)
    trace_path = args.out / f"trace_{args.model}_{args.layers}l_decode.json"
    ex.write_trace(trace_path)
    timeline = layer_timeline(ex.tracer.resolved())
    print(f"\nlast decode step by layer (ms from the step's start; {timeline['legend']})")
    for row in timeline["rows"]:
        print("  " + row)
    rows = []
    for label, step in (("prefill", ex.traces[1]), ("decode", ex.traces[-1])):
        lanes = {lane: v["busy_s"] for lane, v in step.lanes.items() if v["busy_s"] > 0}
        moved = {lane: v.get("bytes", 0) for lane, v in step.lanes.items() if v.get("bytes")}
        rows.append({"step": label, "wall_s": step.seconds, "busy_s": lanes, "bytes": moved})
        busy = ", ".join(f"{lane} {s * 1e3:.1f} ms" for lane, s in sorted(lanes.items()))
        print(f"{label:8s} wall {step.seconds * 1e3:8.1f} ms  busy: {busy}")
    summary = {
        "model": args.model,
        "layers": args.layers,
        "policy": policy.to_dict(),
        "prompt_len": args.prompt_len,
        "load_s": load_s,
        "first_prefill_s": first_prefill_s,
        "warm_prefill_s": warm_prefill_s,
        "steps": rows,
        "timeline": timeline,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    if args.kernels:
        summary["kernels"] = {}
        for label, run in (
            (
                "prefill",
                lambda: ex.forward(batch.prompt_ids, ex.step_inputs(batch, 0, args.prompt_len)),
            ),
            ("decode", lambda: ex.forward(ids, ex.step_inputs(batch, args.prompt_len, 1))),
        ):
            began = time.perf_counter()
            summary["kernels"][label] = kernel_times(run, args.layers)
            print(f"{label} under the profiler: {time.perf_counter() - began:.3f} s")
    steps_ms = [round(step.seconds * 1e3, 1) for step in ex.traces[2:]]
    summary["decode_steps_ms"] = steps_ms
    if args.untraced_steps:
        ex.tracer.enabled = False
        untraced = []
        for t in range(args.untraced_steps):
            began = time.perf_counter()
            ex.forward(ids, ex.step_inputs(batch, args.prompt_len + args.steps + t, 1))
            untraced.append(round((time.perf_counter() - began) * 1e3, 1))
        summary["untraced_decode_steps_ms"] = untraced
        print(f"untraced decode steps {untraced} ms")
    print(f"decode steps {steps_ms} ms (the first compiles)")
    print(f"first prefill {first_prefill_s:.3f} s (kernels compiled in it)")
    print(f"warm prefill {warm_prefill_s:.3f} s")
    (args.out / f"trace_{args.model}_{args.layers}l_summary.json").write_text(
        json.dumps(summary, indent=1)
    )
    ex.close()


def kernel_times(run, layers: int, top: int = 14) -> dict[str, float]:
    """GPU ms a layer by kernel name (the top few, the rest summed) over one run."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.key_averages():
        us = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
        if us > 0:
            totals[event.key[:90]] = us / 1e3 / layers
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    out = dict(ranked[:top])
    out["(rest)"] = sum(v for _, v in ranked[top:])
    print(f"  GPU ms a layer, total {sum(totals.values()):.2f}")
    for name, ms in out.items():
        print(f"  {ms:9.3f}  {name}")
    return out


if __name__ == "__main__":
    main()
