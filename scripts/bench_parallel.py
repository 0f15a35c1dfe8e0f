"""Two GPUs against one, through the user's command: one GPU, TP=2 and DP=2 (issue 58).

    python scripts/bench_parallel.py            # nvidia-h200-x2: 2 H200, 32 cores, 256 GiB
    python scripts/bench_parallel.py --smoke    # CPU: toy models, two ranks over gloo

Workloads (dummy weights, --dtype float16), in this order (the budget skips what no
longer fits, BLOOM-176B last: its load alone may take minutes):
    opt30b-fp16    OPT-30B, --gpu-mem 24GB a GPU       target: best 2-GPU layout >= 1.8x one
    opt30b-int4    the same, int4 weights and KV cache  target: >= 2.0x one GPU
    llama13b-fp16  Llama-2-13B, --gpu-mem 10GB a GPU    target: >= 1.6x one GPU
    bloom-int4     BLOOM-176B int4 weights and KV, the node's RAM (230GB), TP=2 first
                                                        target: >= 40 tok/s
Parts, each a subprocess with its own timeout inside --time-budget:
    profile        offload-profile --nvme DIR (the node: the all-reduce, the ranks' skew
                   at it, each GPU's H2D rate with both copying), unless a current
                   profile of this machine is cached
    W/plan         offload-plan --gpus 2 --json: one GPU, TP=2 and DP=2 searched for this
                   node, their predicted tok/s and blocks; the job is then sized to at
                   least two blocks of every layout (DP: of every group)
    W/one, W/tp2, W/dp2
                   offload-run over that job (prompts of exactly --prompt-len tokens,
                   --max-tokens --gen-len, --ignore-eos), the searched plan, --cpu-mem the
                   node's (each rank its share), load timed apart from the job (its
                   --stats), no warm-up but offload-run's own; --trace with --trace-every:
                   a trace a rank, from which each rank's lanes, the all-reduce's share of
                   a decode step and the ranks' skew at it
Defaults: prompts of 128 tokens, 8 new tokens, --cpu-mem 64GB for the node (pinning and
freeing it is much of a run's fixed time), --time-budget 530 s: the profile and the first
three workloads' nine runs take about 8-9 minutes on the x2 machine by the plans'
predictions; what does not fit is recorded as skipped (BLOOM-176B most likely).
Writes benchmarks/results/bench_parallel_<stamp>.json (and $OUT/ when set) after every
part and prints the table last: measured beside predicted for every run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import benchlib as bench  # noqa: E402
from benchlib import fmt  # noqa: E402

# name -> (preset, engine flags, layouts in order, the target's multiple of one GPU or tok/s)
WORKLOADS: dict[str, tuple[str, list[str], tuple[str, ...], str]] = {
    "opt30b-fp16": ("opt-30b", ["--gpu-mem", "24GB"], ("one", "tp2", "dp2"), "x1.8"),
    "opt30b-int4": (
        "opt-30b",
        ["--gpu-mem", "24GB", "--compress", "int4", "--kv-compress", "int4"],
        ("one", "tp2", "dp2"),
        "x2.0",
    ),
    "llama13b-fp16": ("llama-2-13b", ["--gpu-mem", "10GB"], ("one", "tp2", "dp2"), "x1.6"),
    "bloom-int4": (
        "bloom",
        ["--gpu-mem", "24GB", "--compress", "int4", "--kv-compress", "int4", "--cpu-mem", "230GB"],
        ("tp2", "dp2", "one"),
        "40tok/s",
    ),
}
LAYOUT_FLAGS = {"one": [], "tp2": ["--tp", "2"], "dp2": ["--tp", "1", "--dp", "2"]}
PLAN_NAMES = {"one": "one GPU", "tp2": "TP=2", "dp2": "DP=2"}
# part -> (timeout cap, the least time worth starting it with), seconds
TIMES = {"profile": (150, 30), "plan": (90, 15), "opt30b": (170, 60), "llama13b": (120, 45)}
TIMES |= {"bloom": (420, 240)}


def parse_args() -> argparse.Namespace:
    p = bench.doc_parser(__doc__)
    p.add_argument("--smoke", action="store_true", help="CPU, toy models, gloo (a minute or two)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--time-budget", type=float, default=530, help="seconds for the whole script")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=8)
    p.add_argument("--cpu-mem", default="64GB", help="the node's CPU memory cap (each rank its share; BLOOM-176B: 230GB, the node's RAM): pinning and freeing it is much of a run's fixed time")  # fmt: skip
    p.add_argument("--max-prompts", type=int, default=1024, help="the job's prompts at most")
    p.add_argument("--trace-every", type=int, default=3, help="trace one forward in N")
    p.add_argument("--nvme", type=Path, help="offload-profile's disk directory (default: a new one under /tmp)")  # fmt: skip
    args = p.parse_args()
    bench.check_names(p, "--workloads", args.workloads, WORKLOADS)
    if args.smoke:
        args.prompt_len, args.gen_len, args.cpu_mem, args.max_prompts = 24, 4, "8GB", 48
    return args


# -- parts --------------------------------------------------------------------------------
def profile_part(args, budget: bench.Budget, work: Path, env: dict) -> dict[str, Any]:
    shown = bench.run_part("profile-show", [sys.executable, "-m", "offload.cli.profile", "--show"], 60, work, env)  # fmt: skip
    if shown["ok"]:
        return {"cached": True, "profile": json.loads(Path(shown["stdout"]).read_text())}
    cmd = [sys.executable, "-m", "offload.cli.profile", "--nvme", str(args.nvme)]
    cap_s = TIMES["profile"][0]
    if args.smoke:  # (a small CPU measures the full profile in minutes; cached after)
        cmd, cap_s = [*cmd, "--quick"], 600
    record = bench.run_part("profile", cmd, min(cap_s, budget.left()), work, env)
    if record["ok"]:
        text = Path(record["stdout"]).read_text()
        record["profile"] = json.loads(text[: text.rindex("}") + 1])
    return record


def _engine(args, preset: str, flags: list[str], work: Path) -> list[str]:
    model = str(_smoke_model(preset, work)) if args.smoke else preset
    device = ["--device", "cpu", "--dtype", "float32"] if args.smoke else ["--dtype", "float16"]
    if args.smoke:  # toy caps: the plan search still chooses
        flags = [*flags[: flags.index("--gpu-mem")], "--gpu-mem", "1GB", *flags[flags.index("--gpu-mem") + 2 :]]  # fmt: skip
    if "--cpu-mem" in flags and args.smoke:  # (the node's RAM: the toy's cap)
        flags = flags[: flags.index("--cpu-mem")] + flags[flags.index("--cpu-mem") + 2 :]
    cpu = [] if "--cpu-mem" in flags else ["--cpu-mem", args.cpu_mem]
    return ["--model", model, "--dummy", *device, *flags, *cpu]


def _smoke_model(preset: str, work: Path) -> Path:
    """The preset's architecture at toy sizes, as many KV heads as heads (Llama-2-13B's
    40 would not divide the toy's 4)."""
    path = bench.smoke_model(preset, work)
    config = json.loads((path / "config.json").read_text())
    if "num_key_value_heads" in config:
        config["num_key_value_heads"] = config["num_attention_heads"]
        (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def plan_part(name, engine, args, budget, work, env) -> dict[str, Any]:
    """offload-plan --gpus 2 --json, and the job's size: two blocks of every layout."""
    plan_flags = [f for f in engine if f not in ("--dummy", "--device", "cpu")]  # (config only)
    cmd = [sys.executable, "-m", "offload.cli.plan", *plan_flags, "--prompt-len", str(args.prompt_len)]  # fmt: skip
    cmd += ["--max-tokens", str(args.gen_len), "--gpus", "2", "--json"]
    record = bench.run_part(f"{name}-plan", cmd, min(TIMES["plan"][0], budget.left()), work, env)
    if not record["ok"]:
        return record
    compared = json.loads(Path(record["stdout"]).read_text())
    layouts = {row["layout"]: row for row in compared["layouts"]}
    record["layouts"], record["recommendation"] = layouts, compared["recommendation"]
    blocks = [
        _block(row) * (row["dp"] if row["dp"] > 1 else 1)
        for row in layouts.values()
        if row.get("policy")
    ]
    record["prompts"] = min(args.max_prompts, 2 * max(blocks, default=1))
    return record


def _block(row: dict) -> int:
    return row["policy"]["gpu_batch_size"] * row["policy"]["num_gpu_batches"]


def run_part(name, layout, engine, plan, prompts, args, budget, work, env, cap_s) -> dict:
    """offload-run over the job with `layout`; its stats, traces and the plan's prediction."""
    part = work / name
    part.mkdir(parents=True, exist_ok=True)
    out, stats, trace = part / "out.jsonl", part / "stats.json", part / "trace.json"
    cmd = [sys.executable, "-m", "offload.cli.run", *engine, *LAYOUT_FLAGS[layout]]
    cmd += ["-i", str(prompts), "-o", str(out), "--stats", str(stats), "--ignore-eos", "--quiet"]
    cmd += ["--max-tokens", str(args.gen_len), "--trace", str(trace)]
    cmd += ["--trace-every", str(args.trace_every)]
    record = bench.run_part(name, cmd, min(cap_s, budget.left()), part, env)
    predicted = plan.get("layouts", {}).get(PLAN_NAMES[layout], {})
    record["predicted_tok_s"] = predicted.get("node_tok_s")
    record["predicted_lanes_decode_step_s"] = predicted.get("lanes_decode_step_s")
    if not stats.is_file():
        return record
    summary = json.loads(stats.read_text())
    seconds = summary["seconds"]
    node = summary.get("node") or {
        "tokens_per_second": summary["tokens_per_second"],
        "seconds": seconds["prefill"] + seconds["decode"],
    }
    record |= {
        "tok_s": node["tokens_per_second"],
        "load_s": seconds["loading"],
        "job_s": node["seconds"],
        "prefill_s": seconds["prefill"],  # (group 0's)
        "decode_s": seconds["decode"],
        "groups": node.get("groups"),
        "sequences": summary["policy"]["gpu_batch_size"] * summary["policy"]["num_gpu_batches"],
        "policy": summary["policy"],
        "policy_matches_plan": summary["policy"] == predicted.get("policy"),
        "peak_memory": summary["peak_memory"],
        "ranks": rank_traces(trace, 1 if layout == "one" else 2),
    }
    if record["predicted_tok_s"]:
        record["prediction_error_pct"] = 100 * (record["tok_s"] / record["predicted_tok_s"] - 1)
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.is_file() else []
    record["exact_lengths"] = sum(r.get("completion_tokens") == args.gen_len for r in rows)
    return record


# -- per-rank traces ---------------------------------------------------------------------
def rank_traces(trace: Path, ranks: int) -> list[dict[str, Any]]:
    """Each rank's last traced decode step: its lanes, the all-reduce's share of the step
    and its wait for the other ranks there (each all-reduce's time beyond the shortest
    rank's time for the same all-reduce: the collective itself takes the shortest)."""
    from offload.cli.parallel import rank_trace
    from offload.executor.lanes import busy_seconds, read_chrome

    paths = [trace] if ranks == 1 else [rank_trace(trace, r) for r in range(ranks)]
    spans = [read_chrome(p) if p.is_file() else [] for p in paths]
    reduces = [[e - s for lane, _, s, e, _ in rank if lane == "allreduce"] for rank in spans]
    count = min((len(r) for r in reduces), default=0)
    shortest = [min(r[i] for r in reduces) for i in range(count)]
    out = []
    for rank, (rank_spans, mine) in enumerate(zip(spans, reduces, strict=True)):
        if not rank_spans:
            out.append({"rank": rank, "trace": None})
            continue
        step = max(e for _, _, _, e, _ in rank_spans) - min(s for _, _, s, _, _ in rank_spans)
        lanes = {k: v["busy_s"] for k, v in busy_seconds(rank_spans).items() if v["busy_s"]}
        wait = sum(mine[i] - shortest[i] for i in range(count))
        out.append({
            "rank": rank, "step_s": step, "lanes_busy_s": lanes,
            "allreduce_share": sum(mine) / step if step else 0.0,
            "skew_share": wait / step if step else 0.0,
        })  # fmt: skip
    return out


# -- the table ------------------------------------------------------------------------------
def table(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for name, (_, _, layouts, target) in WORKLOADS.items():
        runs = {lay: results["parts"].get(f"{name}/{lay}", {}) for lay in layouts}
        if not any(runs.values()):
            continue
        one = runs.get("one", {}).get("tok_s")
        two = max((runs[lay].get("tok_s") or 0 for lay in ("tp2", "dp2") if lay in runs), default=0)
        if target.startswith("x"):
            ok = one and two and two / one >= float(target[1:])
        else:
            ok = two >= float(target.removesuffix("tok/s"))
        for lay in layouts:
            r = runs[lay]
            rows.append({
                "workload": name, "layout": lay, "tok_s": r.get("tok_s"),
                "predicted_tok_s": r.get("predicted_tok_s"), "error_pct": r.get("prediction_error_pct"),
                "load_s": r.get("load_s"), "sequences": r.get("sequences"),
                "speedup": r["tok_s"] / one if one and r.get("tok_s") else None,
                "target": target, "verdict": "n/a" if results["smoke"] else ("PASS" if ok else "FAIL"),
                "skipped": r.get("skipped") or (None if r.get("ok") else r.get("stderr_tail", "")[-200:]),
            })  # fmt: skip
    return rows


def print_table(rows: list[dict[str, Any]], results: dict[str, Any]) -> None:
    print(f"\n{'workload':14s} {'layout':6s} {'tok/s':>8s} {'predicted':>9s} {'error':>7s} {'x one':>6s} {'load s':>7s} {'seqs':>5s}  target verdict")  # fmt: skip
    for r in rows:
        print(
            f"{r['workload']:14s} {r['layout']:6s} {fmt(r['tok_s']):>8s} {fmt(r['predicted_tok_s']):>9s} "
            f"{fmt(r['error_pct'], '+.0f', '%'):>7s} {fmt(r['speedup'], '.2f'):>6s} {fmt(r['load_s']):>7s} "
            f"{fmt(r['sequences'], 'd'):>5s}  {r['target']} {r['verdict']}"
            + (f"  [{r['skipped']}]" if r["skipped"] else "")
        )  # fmt: skip
    for name, record in results["parts"].items():
        for rank in record.get("ranks") or []:
            if rank.get("trace") is None and "lanes_busy_s" not in rank:
                continue
            lanes = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in sorted(rank["lanes_busy_s"].items(), key=lambda kv: -kv[1]))  # fmt: skip
            print(
                f"{name} rank {rank['rank']}: step {rank['step_s'] * 1e3:.0f} ms; all-reduce "
                f"{rank['allreduce_share']:.0%}, skew {rank['skew_share']:.0%}; lanes ms: {lanes}"
            )


def main() -> None:
    args = parse_args()
    budget, work, results = bench.start(
        args,
        "bench_parallel",
        f"one GPU, TP=2 and DP=2 through offload-run; prompt {args.prompt_len}, gen "
        f"{args.gen_len}, dummy weights, --cpu-mem {args.cpu_mem} for the node",
    )
    if args.smoke:  # a profile cache of this script's own (other checkouts measure theirs)
        os.environ["OFFLOAD_CACHE"] = str(bench.SMOKE_CACHE.with_name(bench.SMOKE_CACHE.name + "-parallel"))  # fmt: skip
    env = bench.child_env()
    plans: dict[str, dict] = {}
    names = ["profile"]
    for name in args.workloads.split(","):
        names += [f"{name}/plan", *(f"{name}/{lay}" for lay in WORKLOADS[name][2])]

    def min_seconds(part: str) -> float:
        kind = "profile" if part == "profile" else "plan" if part.endswith("/plan") else part.split("-")[0]  # fmt: skip
        return 5 if args.smoke else TIMES[kind][1]

    def run(part: str) -> dict:
        if part == "profile":
            return profile_part(args, budget, work, env)
        name, _, layout = part.partition("/")
        preset, flags, _, _ = WORKLOADS[name]
        engine = _engine(args, preset, flags, work)
        if layout == "plan":
            plans[name] = plan_part(name, engine, args, budget, work, env)
            if plans[name].get("prompts"):
                bench.write_prompts(work / f"{name}.jsonl", plans[name]["prompts"], args.prompt_len)
            return plans[name]
        plan = plans.get(name, {})
        if not plan.get("prompts"):
            return {"skipped": "no plan (see its part)"}
        cap_s = TIMES[name.split("-")[0]][0]
        return run_part(part.replace("/", "-"), layout, engine, plan, work / f"{name}.jsonl", args, budget, work, env, cap_s)  # fmt: skip

    try:
        bench.run_parts(names, min_seconds, run, results, budget, _status)
    finally:
        rows = table(results.data)
        results.data["table"], results.data["seconds"] = rows, budget.elapsed()
        results.save()
        print_table(rows, results.data)
        print("wrote " + ", ".join(map(str, results.paths)))


def _status(record: dict[str, Any]) -> str:
    if "profile" in record:
        return "cached" if record.get("cached") else f"measured in {record['seconds']:.0f} s"
    if "skipped" in record or "error" in record:
        return str(record.get("skipped") or record.get("error"))
    if "prompts" in record:
        return f"{record['prompts']} prompts"
    if not record.get("ok", True):
        return f"FAILED (rc {record.get('rc')}, {record.get('killed')})"
    return f"{fmt(record.get('tok_s'))} tok/s (predicted {fmt(record.get('predicted_tok_s'))}), load {fmt(record.get('load_s'))} s"  # fmt: skip


if __name__ == "__main__":
    main()
