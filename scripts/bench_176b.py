"""176B-class models on one GPU, the user's path, against the roofline (issue 18).

BLOOM-176B (preset bloom) and OPT-175B (preset opt-175b), dummy weights, int4 weights
and KV, prompt 512, generate 32, --gpu-mem 24GB, --nvme on this machine's disk, default
CPU cap, searched policy. In order, each a subprocess with its own timeout inside
--time-budget (a model that cannot start with its minimum time left is skipped):
    ceilings   pinned PCIe H2D and D2H, disk read and write in the --nvme directory
    <model>    offload-plan --json (block, prediction, lanes), then offload-run over
               exactly one block of 512-token prompts with --stats and --trace
Reported per model: sequences, prefill, decode, s/step, total tok/s, the prediction and
its error, peak GPU against the cap, peak RSS against the default CPU cap, disk (KV
spill peak and the weight store's bytes), and a decode step's lanes against the
roofline: the bytes the cost model streams per step (exactly, at unit rates) over the
ceilings measured in this run (the ideal step), beside the measured step and the
traced step's per-lane busy time (the trace's last step; tracing turns CUDA graphs off
and resolves its events once a step).
A model takes about 5 minutes (BLOOM: load ~110 s, one block ~170 s), so on the GPU
machine run one model per call:
    python3 scripts/bench_176b.py --models bloom
    python3 scripts/bench_176b.py --models opt-175b
    python3 scripts/bench_176b.py --smoke      # CPU, toy models of both architectures
Writes benchmarks/results/bench_176b_<stamp>.json after every part (a copy and the
traces in $OUT when set) and prints the table last.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import benchlib as bench  # noqa: E402
from benchlib import GB, fmt  # noqa: E402

from offload.executor.runner import prefill_trace_path  # noqa: E402

MODELS = ("bloom", "opt-175b")
CEILINGS_MIN_S = 20
MODEL_CAP_S, MODEL_MIN_S = 540, 240  # seconds: a model's timeout, the least worth starting


def parse_args() -> argparse.Namespace:
    p = bench.doc_parser(__doc__)
    p.add_argument("--smoke", action="store_true", help="CPU, toy models, prompt 32, gen 4; about a minute")  # fmt: skip
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated, run in this order")  # fmt: skip
    p.add_argument("--skip-ceilings", action="store_true", help="no ceilings (no ideal step)")
    p.add_argument("--time-budget", type=float, default=560, help="seconds for the whole script (default 560)")  # fmt: skip
    p.add_argument("--gpu-mem", default="24GB")
    p.add_argument("--compress", default="int4")
    p.add_argument("--kv-compress", default="int4")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--nvme", type=Path, help="fast-disk directory (default: a new one under /tmp); each model gets a subdirectory, removed after it unless --keep-store")  # fmt: skip
    p.add_argument("--no-trace", action="store_true", help="no --trace (tracing resolves its CUDA events once a step and turns CUDA graphs off)")  # fmt: skip
    p.add_argument("--keep-store", action="store_true", help="keep each model's weight store")
    p.add_argument("--ceiling-bytes", type=int, default=2**29, help="bytes a ceiling copy moves")  # fmt: skip
    args = p.parse_args()
    bench.check_names(p, "--models", args.models, MODELS)
    if args.smoke:
        args.prompt_len, args.gen_len, args.gpu_mem = 32, 4, "8MB"
        args.ceiling_bytes = 2**24
    return args


def lane_bytes(model: str, policy: dict, prompt_len: int, gen_len: int, profile: dict) -> dict:
    """Bytes a decode step moves per copy lane as the cost model counts them: its lane
    times under a profile whose copy rates are all 1 GB/s (weights off the GPU and KV
    that crosses, on h2d; disk reads and writes, on disk)."""
    import dataclasses

    from offload.core.config import resolve_dtype
    from offload.models.resolve import resolve_model
    from offload.policies.cost import estimate
    from offload.policies.hardware import HardwareProfile
    from offload.policies.policy import Policy

    hw = HardwareProfile(**profile)
    unit = dataclasses.replace(hw, h2d_gbps=1.0, disk_read_gbps=1.0, disk_write_gbps=1.0)
    cfg = resolve_model(model, dummy=True).config
    dtype = resolve_dtype("auto", hw.has_gpu, cfg.checkpoint_dtype)  # as offload-run's
    est = estimate(cfg, Policy.from_dict(policy), dtype, prompt_len, gen_len, unit)
    return {"h2d": est.lanes_decode_s["h2d"] * GB, "disk": est.lanes_decode_s["disk"] * GB}


def roofline(record: dict, ceilings: dict, model: str, args) -> dict[str, Any]:
    """A decode step's lanes: model bytes, ideal time at the measured ceilings, the
    plan's lane times, the traced step's busy times, against the measured step."""
    summary, plan = record["summary"], record["plan"]["json"]
    predicted = plan["predicted"]["lanes_decode_step_s"]
    out: dict[str, Any] = {"measured_step_s": summary.get("decode_step_s"), "lanes": {}}
    moved = {}
    if record.get("profile"):
        moved = lane_bytes(model, plan["policy"], args.prompt_len, args.gen_len, record["profile"])
    rates = {"h2d": ceilings.get("h2d_pinned_gbps"), "disk": ceilings.get("disk_read_gbps")}
    traced = (record.get("trace") or {}).get("lanes", {})
    for lane in ("h2d", "disk", "compute", "cpu_attn", "d2h", "cpu_copy"):
        nbytes, rate = moved.get(lane), rates.get(lane)
        # the model's h2d is the link: weights and KV loads, traced on two streams
        seen = (
            traced.get("pcie_h2d", traced.get(lane, {})) if lane == "h2d" else traced.get(lane, {})
        )
        row = {
            "model_bytes": nbytes,
            "ceiling_gbps": rate,
            "ideal_s": nbytes / (rate * GB) if nbytes is not None and rate else None,
            "predicted_s": predicted.get(lane),
            "traced_busy_s": seen.get("busy_s"),
            "traced_bytes": seen.get("bytes"),
            "traced_gbps": seen.get("gbps"),
            "traced_share_of_step": seen.get("share_of_step"),
        }
        if any(v for k, v in row.items() if k != "ceiling_gbps"):
            out["lanes"][lane] = row
    ideal = [row["ideal_s"] for row in out["lanes"].values() if row["ideal_s"] is not None]
    out["ideal_step_s"] = max(ideal) if ideal else None
    step = out["measured_step_s"]
    out["pcie_busy_share"] = (
        out["lanes"].get("h2d", {}).get("ideal_s") / step
        if step and out["lanes"].get("h2d", {}).get("ideal_s") is not None
        else None
    )
    out["traced_step_s"] = (record.get("trace") or {}).get("step_s")
    return out


def model_part(model: str, args, budget: bench.Budget, work: Path, env, results) -> dict:
    nvme = args.nvme / model
    name = str(bench.smoke_model(model, work)) if args.smoke else model
    flags = ["--model", name, "--dummy", "--gpu-mem", args.gpu_mem, "--nvme", str(nvme)]
    flags += ["--compress", args.compress, "--kv-compress", args.kv_compress]
    trace = work / model / "trace.json"
    record = bench.plan_and_run(
        model, flags, args.prompt_len, args.gen_len, budget, MODEL_CAP_S, work, env,
        run_flags=[] if args.no_trace else ["--trace", str(trace)],
    )  # fmt: skip
    record["nvme_bytes"] = directory_bytes(nvme) if nvme.exists() else 0
    if not args.keep_store:
        shutil.rmtree(nvme, ignore_errors=True)
    prefill = prefill_trace_path(trace)
    if trace.is_file():
        record["trace"] = trace_summary(trace)
        record["trace_files"] = [str(trace)]
    if prefill.is_file():
        record["prefill_trace"] = trace_summary(prefill)
        record.setdefault("trace_files", []).append(str(prefill))
    for path, tag in ((trace, "trace"), (prefill, "prefill_trace")):
        for out_dir in {p.parent for p in results.paths[1:]} if path.is_file() else ():  # $OUT
            out_dir.mkdir(parents=True, exist_ok=True)
            copy = out_dir / f"{results.paths[0].stem}_{model}_{tag}.json"
            shutil.copyfile(path, copy)
            record["trace_files"].append(str(copy))
    if "summary" not in record or "stats" not in record:
        return record
    profile = record.get("profile") or {}
    cpu_cap = int(0.9 * (profile.get("cpu_mem_bytes") or results.data["machine"]["node_memory_bytes"]))  # fmt: skip
    record["caps"] = {"gpu_bytes": _size(args.gpu_mem), "default_cpu_bytes": cpu_cap}
    ceilings = results.data["parts"].get("ceilings", {}).get("measured", {})
    record["roofline"] = roofline(record, ceilings, name, args)
    return record


def trace_summary(path: Path) -> dict[str, Any] | None:
    """Per lane of a Chrome trace written by offload-run --trace (one step): busy time
    (the union of its spans), bytes moved, the rate while busy and the share of the step."""
    from offload.executor.lanes import busy_seconds, read_chrome

    try:
        spans = read_chrome(path)
    except (OSError, ValueError, KeyError):
        return None
    if not spans:
        return None
    step_s = max(s[3] for s in spans) - min(s[2] for s in spans)
    lanes = {
        lane: {
            **s,
            "gbps": s["bytes"] / s["busy_s"] / GB if s["busy_s"] else 0.0,
            "share_of_step": s["busy_s"] / step_s if step_s else 0.0,
        }
        for lane, s in busy_seconds(spans).items()
    }
    return {"step_s": step_s, "spans": len(spans), "lanes": lanes}


def directory_bytes(path: Path) -> int:
    """Bytes of the files under `path` (allocated blocks: a sparse file counts its data)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue
    return total


def fmt_gb(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / GB:.1f} GB"


def _size(text: str) -> int:
    from offload.api.args import parse_size

    return parse_size(text)


def print_table(results: dict[str, Any]) -> None:
    parts = results["parts"]
    ceilings = parts.get("ceilings", {}).get("measured", {})
    print(
        f"\n{'model':9s} {'seqs':>4s} {'prefill':>8s} {'decode':>8s} {'s/step':>6s} "
        f"{'tok/s':>6s} {'predicted':>9s} {'error':>6s}  {'GPU peak / cap':>17s}  "
        f"{'RSS peak / default cap':>22s}  {'disk spill / store':>19s}"
    )
    for model, r in parts.items():
        if model == "ceilings":
            continue
        s, caps = r.get("summary", {}), r.get("caps", {})
        if "tok_s" not in s:
            why = r.get("skipped") or r.get("error") or _failure(r)
            print(f"{model:9s} {why}")
            continue
        print(
            f"{model:9s} {s['sequences']:4d} {s['prefill_s']:7.1f}s {s['decode_s']:7.1f}s "
            f"{s['decode_step_s']:6.2f} {s['tok_s']:6.1f} {s['predicted_tok_s']:9.1f} "
            f"{s['prediction_error_pct']:+5.0f}%  "
            f"{s['peak_gpu_bytes'] / GB:6.1f} / {fmt_gb(caps.get('gpu_bytes')):>8s}  "
            f"{s['peak_rss_bytes'] / GB:9.1f} / {fmt_gb(caps.get('default_cpu_bytes')):>10s}  "
            f"{s['peak_disk_bytes'] / GB:6.1f} / {fmt_gb(r.get('nvme_bytes')):>10s}"
        )
        if not s.get("all_exact_lengths"):
            print(f"  note: not every result had the asked lengths: {r.get('outputs')}")
    for model, r in parts.items():
        roof = r.get("roofline")
        if not roof:
            continue
        print(
            f"\n{model}: a decode step's lanes against the roofline (ceilings measured in "
            f"this run: PCIe pinned H2D {fmt(ceilings.get('h2d_pinned_gbps'))} GB/s, disk read "
            f"{fmt(ceilings.get('disk_read_gbps'), '.2f')} GB/s)"
        )
        print(
            f"  {'lane':8s} {'model GB':>9s} {'ideal s':>8s} {'predicted s':>11s} "
            f"{'traced busy s':>13s} {'traced GB':>9s} {'traced GB/s':>11s} {'of step':>7s}"
        )
        for lane, row in roof["lanes"].items():
            print(
                f"  {lane:8s} {fmt(_gb(row['model_bytes']), '.2f'):>9s} "
                f"{fmt(row['ideal_s'], '.3f'):>8s} {fmt(row['predicted_s'], '.3f'):>11s} "
                f"{fmt(row['traced_busy_s'], '.3f'):>13s} "
                f"{fmt(_gb(row['traced_bytes']), '.2f'):>9s} "
                f"{fmt(row['traced_gbps'], '.1f'):>11s} "
                f"{fmt(_pct(row['traced_share_of_step']), '.0f', '%'):>7s}"
            )
        print(
            f"  measured step {fmt(roof['measured_step_s'], '.3f')} s (traced step "
            f"{fmt(roof['traced_step_s'], '.3f')} s); ideal step {fmt(roof['ideal_step_s'], '.3f')}"
            f" s; the PCIe lane's ideal time is {fmt(_pct(roof['pcie_busy_share']), '.0f', '%')}"
            " of the measured step"
        )


def _gb(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / GB


def _pct(share: float | None) -> float | None:
    return None if share is None else 100 * share


def _failure(record: dict[str, Any]) -> str:
    for step in ("plan", "run"):
        r = record.get(step)
        if r is not None and not r["ok"]:
            last = (r["stderr_tail"].strip().splitlines() or [""])[-1]
            killed = f", {r['killed']}" if r.get("killed") else ""
            return f"{step} failed (rc {r['rc']}{killed}): {last}"
    return "no stats"


def main() -> None:
    args = parse_args()
    budget, work, results = bench.start(
        args,
        "bench_176b",
        "BLOOM-176B and OPT-175B dummy weights, int4 weights and KV, prompt 512, gen 32, "
        "--gpu-mem 24GB, --nvme, default CPU cap, searched policy; the user path "
        "(offload-plan --json, then offload-run --stats --trace over one searched block)",
    )
    env = bench.child_env()
    names = ([] if args.skip_ceilings else ["ceilings"]) + args.models.split(",")

    def run(name: str) -> dict:
        if name != "ceilings":
            return model_part(name, args, budget, work, env, results)
        record = bench.ceilings_part(budget, work, env, args.nvme, args.ceiling_bytes)
        results.data["machine"]["device"] = record.get("measured", {}).get("device")
        return record

    try:
        bench.run_parts(
            names,
            lambda name: CEILINGS_MIN_S if name == "ceilings" else MODEL_MIN_S,
            run,
            results,
            budget,
        )
    finally:
        bench.finish(results, budget, print_table)


if __name__ == "__main__":
    main()
