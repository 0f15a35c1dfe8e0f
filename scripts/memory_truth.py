"""Measured GPU and host peaks of real runs against the one accounting (`policies.caps`).

For each case (a preset cut to a few layers, so a 176B-wide model runs in seconds; the
per-layer buffers, the embedding and the head are at full size) and policy: place the
weights, run one block's prefill and a few decode steps, and record
torch.cuda.max_memory_allocated / max_memory_reserved, the CUDA context, peak RSS, the
plan's parts and the ledger. Prints a table and writes JSON (benchmarks/results/ and $OUT).

With --where, the run phase is recorded (`torch.cuda.memory._record_memory_history`) and
replayed: the blocks live when the allocated total peaked, grouped by the innermost
frame of this project that allocated them, go into each case's "live_at_peak". With
--limit, the caching allocator is held to each plan's GPU peak less the context: whether
the run fits its plan in reserved bytes.

    python scripts/memory_truth.py [--layers 3] [--prompt-len 512] [--gen-len 4]
        [--where] [--limit]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import time
from collections import Counter
from functools import cache
from pathlib import Path

import torch

import offload
from offload.core.sampling import SamplingParams, sample
from offload.executor.executor import Executor
from offload.kernels.formats import Compression
from offload.models.batch import PaddedBatch
from offload.models.resolve import resolve_model
from offload.models.weights import DummySource
from offload.policies.caps import Baseline, peak_bytes
from offload.policies.memory import plan_memory
from offload.policies.policy import Placement, Policy

GB = 1e9
INT4 = Compression(4, 64, False)
# the allocator keeps the newest this many trace entries; a 3-layer case makes thousands
WHERE_MAX_EVENTS = 1_000_000
# a frame in one of these folders names where a block was allocated
PROJECT_DIRS = (Path(offload.__file__).resolve().parent, Path(__file__).resolve().parent)


def _int4(batch: int, micro: int, weights: Placement, kv: Placement) -> Policy:
    """A policy with int4 weights and int4 KV."""
    return Policy(
        batch, micro, weights=weights, kv_cache=kv, weight_compression=INT4, kv_compression=INT4
    )


CASES = {
    # the BLOOM run of issue 18: int4 weights streamed from CPU, int4 KV mostly in CPU
    "bloom int4 W+KV, 16 seqs, KV cpu": (
        "bloom",
        _int4(8, 2, Placement(0, 1, 0), Placement(0.25, 0.75, 0)),
    ),
    "bloom int4 W+KV, 2 seqs, all cpu": (
        "bloom",
        _int4(2, 1, Placement(0, 1, 0), Placement(0, 1, 0)),
    ),
    "opt-30b fp16, 48x2 CPU attention": (
        "opt-30b",
        Policy(
            48,
            2,
            weights=Placement(0.2, 0.8, 0),
            kv_cache=Placement(0, 1, 0),
            attention_on_cpu=True,
        ),
    ),
    # W1u's plan (bench_throughput 125354): its prefill holds 88 x 512 rows a layer
    "opt-30b fp16, 88x1 CPU attention (W1u)": (
        "opt-30b",
        Policy(
            88,
            1,
            weights=Placement(0.25, 0.75, 0),
            kv_cache=Placement(0, 1, 0),
            attention_on_cpu=True,
        ),
    ),
    # W1c's plans (bench_throughput 011706: 12 sequences; 085614: 14) and the batch a
    # cap of 24 GB just misses
    "opt-30b int4 W+KV, 12x1 on GPU": (
        "opt-30b",
        _int4(12, 1, Placement(1, 0, 0), Placement(1, 0, 0)),
    ),
    "opt-30b int4 W+KV, 14x1 on GPU": (
        "opt-30b",
        _int4(14, 1, Placement(1, 0, 0), Placement(1, 0, 0)),
    ),
    "opt-30b int4 W+KV, 16x1 on GPU": (
        "opt-30b",
        _int4(16, 1, Placement(1, 0, 0), Placement(1, 0, 0)),
    ),
    "llama-3.1-70b int4 W+KV, 64 seqs on GPU": (
        "llama-3.1-70b",
        _int4(32, 2, Placement(0, 1, 0), Placement(1, 0, 0)),
    ),
    # the searched plan of validate_cost_model 034609 (prompt 128): peak GPU 18.5 GB
    # against 24.0 planned
    "llama-3.1-70b int4 W+KV, 256x8 searched": (
        "llama-3.1-70b",
        _int4(256, 8, Placement(0.1, 0.9, 0), Placement(0.02490234375, 0.975098, 0)),
    ),
}


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# -- where the run's peak is (--where) ---------------------------------------------------
# The CUDA caching allocator's trace: "alloc" and "free_requested" carry the block's
# requested size and mark where `memory_allocated` (allocated_bytes, counted in the
# rounded block size) goes up and down; "free_completed" comes once the streams a block
# was recorded on are done with it, where `requested_bytes` and `active_bytes` go down
# (c10/cuda/CUDACachingAllocator.cpp: `malloc`, `free`, `free_block`). Blocks live when
# recording began have no "alloc"; a free of one comes off the starting figure.


def _replay(trace: list[dict], start_bytes: int, free_action: str, stop: int | None = None):
    """Replays trace[: stop + 1] from `start_bytes`: (peak bytes, index of the event that
    reached it or -1 for the start, the blocks live at the end {addr: alloc event}, what
    is left of the starting bytes, frees of blocks the trace never allocated, allocs at an
    address already live)."""
    events = trace if stop is None else trace[: stop + 1]
    live: dict[int, dict] = {}
    total = before = peak = start_bytes
    peak_at = -1
    unmatched = reused = 0
    for i, event in enumerate(events):
        action = event["action"]
        if action == "alloc":
            if event["addr"] in live:  # its free was lost (a wrapped trace)
                reused += 1
                total -= live[event["addr"]]["size"]
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, peak_at = total, i
        elif action == free_action:
            if live.pop(event["addr"], None) is None:
                unmatched += 1
                before -= event["size"]
            total -= event["size"]
    return peak, peak_at, live, before, unmatched, reused


@cache
def _project_path(filename: str, roots: tuple[Path, ...]) -> str | None:
    """filename relative to the folder above its root (offload/..., scripts/...), or None
    outside them."""
    path = Path(os.path.realpath(filename))
    for root in roots:
        if path.is_relative_to(root):
            return path.relative_to(root.parent).as_posix()
    return None


def _frame_label(frames: list[dict], roots: tuple[Path, ...]) -> tuple[str, str]:
    """(the innermost frame under `roots`, the next project frame out) as 'path:line
    function'; frames run innermost first, as the allocator records them."""
    ours = []
    for frame in frames:
        path = _project_path(frame["filename"], roots)
        if path is not None:
            ours.append(f"{path}:{frame['line']} {frame['name']}")
            if len(ours) == 2:
                break
    if not ours:
        if not frames:
            return "<no python frames>", ""
        inner = frames[0]
        return f"<outside> {Path(inner['filename']).name}:{inner['line']} {inner['name']}", ""
    return ours[0], ours[1] if len(ours) > 1 else ""


def live_at_peak(
    trace: list[dict],
    start_bytes: int,
    roots: tuple[Path, ...],
    start_blocks: int | None = None,
    free_action: str = "free_requested",
) -> dict:
    """The blocks live when the total peaked in one device's allocator trace
    (`torch.cuda.memory._snapshot()["device_traces"][device]`), recording having begun
    with `start_bytes` in `start_blocks` blocks live: grouped by allocating frame
    (`_frame_label`), largest first, those from before recording as one group."""
    peak, peak_at, _, _, _, _ = _replay(trace, start_bytes, free_action)
    _, _, live, before, unmatched, reused = _replay(trace, start_bytes, free_action, peak_at)
    groups: dict[str, dict] = {}
    for event in live.values():
        where, caller = _frame_label(event.get("frames") or [], roots)
        group = groups.setdefault(
            where, {"bytes": 0, "count": 0, "sizes": Counter(), "callers": Counter()}
        )
        group["bytes"] += event["size"]
        group["count"] += 1
        group["sizes"][event["size"]] += 1
        group["callers"][caller] += event["size"]
    rows = [
        {
            "where": where,
            "bytes": g["bytes"],
            "count": g["count"],
            # [block bytes, how many], the most bytes first
            "sizes": sorted(g["sizes"].items(), key=lambda sc: -sc[0] * sc[1])[:6],
            "callers": g["callers"].most_common(3),
        }
        for where, g in groups.items()
    ]
    if before:
        count = None if start_blocks is None else start_blocks - unmatched
        rows.append({"where": "before recording", "bytes": before, "count": count})
    rows.sort(key=lambda row: -row["bytes"])
    assert sum(row["bytes"] for row in rows) == peak
    peak_alloc = None  # the allocation that reached the peak
    if peak_at >= 0:
        event = trace[peak_at]
        where = _frame_label(event.get("frames") or [], roots)
        peak_alloc = {"size": event["size"], "where": where}
    return {
        "peak_bytes": peak,
        "peak_event": peak_at,
        "events": len(trace),
        "peak_alloc": peak_alloc,
        "unmatched_frees": unmatched,
        "reused_addresses": reused,
        "groups": rows,
    }


def start_recording() -> dict:
    """The allocator's figures as recording begins (none of them has an "alloc")."""
    stats = torch.cuda.memory_stats()
    start = {
        "allocated": stats["allocated_bytes.all.current"],
        "requested": stats["requested_bytes.all.current"],
        "blocks": stats["allocation.all.current"],
    }
    torch.cuda.memory._record_memory_history(
        "all", context="alloc", stacks="python", max_entries=WHERE_MAX_EVENTS, clear_history=True
    )
    return start


def finish_recording(start: dict) -> dict:
    """Stops recording; the run's live blocks at its peak, and a check of the replay: its
    requested bytes (alloc against free_completed) must peak where torch's did."""
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    stats = torch.cuda.memory_stats()
    found = live_at_peak(trace, start["requested"], PROJECT_DIRS, start["blocks"])
    found["start"] = start
    found["truncated"] = len(trace) >= WHERE_MAX_EVENTS
    found["check"] = {
        "requested_peak_replayed": _replay(trace, start["requested"], "free_completed")[0],
        "requested_peak_torch": stats["requested_bytes.all.peak"],
        # peak_bytes counts requested sizes: below this by the blocks' rounding
        "max_allocated_torch": stats["allocated_bytes.all.peak"],
    }
    return found


def print_where(run: dict, top: int = 15) -> None:
    found = run["live_at_peak"]
    check = found["check"]
    print(
        f"\n{run['case']}: live at the run's peak {found['peak_bytes'] / GB:.3f} GB (event "
        f"{found['peak_event']} of {found['events']}); torch max_allocated "
        f"{check['max_allocated_torch'] / GB:.3f}, requested peak "
        f"{check['requested_peak_torch'] / GB:.3f} (replayed "
        f"{check['requested_peak_replayed'] / GB:.3f})"
        + (" TRUNCATED" if found["truncated"] else "")
    )
    print(f"{'GB':>7} {'n':>4}  where  [MB x n]  <- caller")
    for row in found["groups"][:top]:
        sizes = " ".join(f"{size / 1e6:.1f}x{n}" for size, n in row.get("sizes", []))
        callers = row.get("callers") or [("", 0)]
        count = "" if row["count"] is None else row["count"]
        print(f"{row['bytes'] / GB:7.3f} {count:>4}  {row['where']}  [{sizes}]  <- {callers[0][0]}")


def run_case(name: str, preset: str, policy: Policy, args) -> dict:
    device = torch.device("cuda")
    cfg = dataclasses.replace(resolve_model(preset, dummy=True).config, num_layers=args.layers)
    dtype = torch.float16
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = Baseline.measure(device)
    ex = start = None
    try:
        if args.limit:  # the caching allocator held to the plan's GPU peak, less the context
            plan = plan_memory(cfg, policy, dtype, args.prompt_len, args.gen_len)
            total = torch.cuda.get_device_properties(device).total_memory
            share = (peak_bytes(plan, base)[0] - base.gpu_context_bytes) / total
            torch.cuda.set_per_process_memory_fraction(share)
        ex = Executor(DummySource(cfg), policy, dtype, device)
        load_peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()  # from here on, the run's own peak
        start = start_recording() if args.where else None
        out = _measure(ex, cfg, policy, dtype, base, load_peak, name, preset, args)
        if start is not None:
            out["live_at_peak"] = finish_recording(start)
        return out
    finally:
        if start is not None:
            torch.cuda.memory._record_memory_history(None)
        if ex is not None:
            ex.close()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0)


def _measure(
    ex: Executor, cfg, policy: Policy, dtype, base, load_peak: int, name, preset, args
) -> dict:
    prompts = torch.randint(10, cfg.vocab_size - 10, (policy.block_size, args.prompt_len))
    batch = PaddedBatch(cfg, prompts.tolist(), args.gen_len, pad_id=1)
    greedy = SamplingParams(max_tokens=args.gen_len)
    ex.start(batch)
    started = time.perf_counter()
    # as `decode_loop` holds them: a step's logits dropped once sampled
    logits = [ex.forward(batch.prompt_ids, ex.step_inputs(batch, 0, args.prompt_len))]
    prefill_peak = torch.cuda.max_memory_allocated()
    torch.cuda.synchronize()
    prefilled = time.perf_counter()
    for t in range(args.gen_len - 1):
        ids = sample(logits.pop(), greedy)
        logits.append(ex.forward(ids[:, None], ex.step_inputs(batch, args.prompt_len + t, 1)))
    torch.cuda.synchronize()
    # (a first call of each shape: compiles and graph captures included)
    seconds = {"prefill_s": prefilled - started, "decode_s": time.perf_counter() - prefilled}
    plan = plan_memory(cfg, policy, dtype, args.prompt_len, args.gen_len)
    planned_gpu, planned_cpu = peak_bytes(plan, base)
    run_peak = torch.cuda.max_memory_allocated()
    measured_gpu = max(load_peak, run_peak) + base.gpu_context_bytes
    out = {
        "case": name,
        "model": preset,
        "layers": args.layers,
        **seconds,
        "policy": policy.to_dict(),
        "baseline": dataclasses.asdict(base),
        "plan_detail": plan.detail,
        "ledger": ex.ledger.snapshot(),
        "planned_gpu_peak": planned_gpu,
        "measured_gpu_peak": measured_gpu,
        "max_allocated": max(load_peak, run_peak),
        # the run's phase alone (the weights placed), against the plan's run parts
        "load_max_allocated": load_peak,
        "run_max_allocated": run_peak,
        "planned_run_bytes": plan.run_bytes("gpu"),
        "prefill_max_allocated": prefill_peak,
        "max_reserved": torch.cuda.max_memory_reserved(),
        "planned_cpu_peak": planned_cpu,
        "measured_peak_rss": peak_rss(),
    }
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=4)
    p.add_argument("--cases", default=";".join(CASES), help="case names, separated by ;")
    p.add_argument(
        "--limit",
        action="store_true",
        help="hold the caching allocator to each plan's GPU peak (less the CUDA context): "
        "whether the run fits its plan in reserved bytes",
    )
    p.add_argument(
        "--where",
        action="store_true",
        help="record the run phase's allocations and report the blocks live at its peak, "
        "by allocating frame",
    )
    args = p.parse_args()
    runs = []
    for name in args.cases.split(";"):
        preset, policy = CASES[name]
        try:
            runs.append(run_case(name, preset, policy, args))
        except Exception as exc:  # a failed case is a result too
            runs.append({"case": name, "error": f"{type(exc).__name__}: {exc}"})
        print(json.dumps(runs[-1]), flush=True)
    res = {
        "machine": platform.node(),
        "gpu": torch.cuda.get_device_name(),
        "allocator_held_to_plan": args.limit,
        "runs": runs,
    }
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for folder in (Path("benchmarks/results"), Path(os.environ.get("OUT", "."))):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"memory_truth_{stamp}.json").write_text(json.dumps(res, indent=1))
    print(
        f"{'case':44} {'planned':>8} {'measured':>8} {'reserved':>8} {'RSS':>7} {'plan CPU':>8} "
        f"{'run plan':>8} {'run':>8} {'resv+ctx':>8} {'prefill':>7} {'decode':>7}"
    )
    for r in runs:
        if "error" in r:
            print(f"{r['case']:44} {r['error'][:80]}")
            continue
        print(
            f"{r['case']:44} {r['planned_gpu_peak'] / GB:8.2f} {r['measured_gpu_peak'] / GB:8.2f} "
            f"{r['max_reserved'] / GB:8.2f} {r['measured_peak_rss'] / GB:7.2f} "
            f"{r['planned_cpu_peak'] / GB:8.2f} {r['planned_run_bytes'] / GB:8.2f} "
            f"{r['run_max_allocated'] / GB:8.2f} "
            f"{(r['max_reserved'] + r['baseline']['gpu_context_bytes']) / GB:8.2f} "
            f"{r['prefill_s']:6.2f}s {r['decode_s']:6.2f}s"
        )
    for r in runs:
        if "live_at_peak" in r:
            print_where(r)


if __name__ == "__main__":
    main()
