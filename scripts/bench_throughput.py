"""OPT-30B throughput against FlexGen, same machine, same call (issue 21).

Workloads (dummy weights, prompt 512, generate 32, --gpu-mem 24GB, default CPU cap):
    W1u  uncompressed fp16: ours (searched policy) vs FlexGen's fp16 policy
    W1c  compression allowed: ours (--compress auto --kv-compress auto: the search
         picks the formats) vs FlexGen's int4 weights + int4 KV policy
Parts, in this order, each a subprocess with its own timeout inside --time-budget (a
part that cannot start with its minimum time left is recorded as skipped):
    ceilings   pinned PCIe H2D and D2H, HBM copy, DRAM copy, disk (--nvme dir) GB/s
    ours-c     offload-plan --json (the searched block and the prediction), then
               offload-run over exactly one block of 512-token prompts
    ours-u     the same in fp16, no compression
    flexgen-c  FlexGen 0.1.8, --percent 100 0 0 100 0 100, 64 x 2, int4 W and KV
    flexgen-u  FlexGen 0.1.8, --percent 20 80 0 100 0 100, 16 x 3, CPU attention
On the GPU machine (FlexGen from the carried wheels in .whl/, which holds flexgen_peer.py):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site && \\
        python3 scripts/bench_throughput.py
    All five parts take an estimated 10-11 minutes, more than one call: run
        --parts ceilings,ours-c,ours-u   then   --parts flexgen-c,flexgen-u --reuse FIRST.json
    (FIRST.json: the first call's results, copied into the checkout).
    python3 scripts/bench_throughput.py --smoke    # CPU, a toy OPT, FlexGen skipped
Writes benchmarks/results/bench_throughput_<stamp>.json (and a copy in $OUT when set)
after every part, and prints the table last.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import benchlib as bench  # noqa: E402
from benchlib import fmt  # noqa: E402

PARTS = ("ceilings", "ours-c", "ours-u", "flexgen-c", "flexgen-u")
# part -> (timeout cap, the least time worth starting it with), seconds
TIMES = {
    "ceilings": (120, 20),
    "ours-c": (330, 150),
    "ours-u": (300, 120),
    "flexgen-c": (300, 150),
    "flexgen-u": (300, 150),
}
FLEXGEN = {
    "flexgen-u": "--percent 20 80 0 100 0 100 --gpu-batch-size 16 --num-gpu-batches 3 "
    "--cpu-cache-compute",
    "flexgen-c": "--percent 100 0 0 100 0 100 --gpu-batch-size 64 --num-gpu-batches 2 "
    "--compress-weight --compress-cache",
}
# workload -> (ours, FlexGen, least tok/s, least multiple of FlexGen)
WORKLOADS = {
    "W1u fp16": ("ours-u", "flexgen-u", 75.0, 5.0),
    "W1c compressed": ("ours-c", "flexgen-c", 400.0, 10.0),
}


def parse_args() -> argparse.Namespace:
    p = bench.doc_parser(__doc__)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, a toy OPT, prompt 32, gen 4, int4 for ours-c unless --compress/--kv-compress say otherwise; about a minute",
    )
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset, run in this order")  # fmt: skip
    p.add_argument("--time-budget", type=float, default=560, help="seconds for the whole script (default 560)")  # fmt: skip
    p.add_argument("--model", default="opt-30b", help="preset (dummy weights)")
    p.add_argument("--gpu-mem", default="24GB")
    p.add_argument("--dtype", default="float16", help="our compute dtype (the smoke run: float32)")  # fmt: skip
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--compress", default="auto", help="ours-c's --compress (default auto)")
    p.add_argument("--kv-compress", default="auto", help="ours-c's --kv-compress (default auto)")
    p.add_argument("--nvme", type=Path, help="directory the disk ceiling is measured in (default: a new one under /tmp); our W1 runs take no --nvme")  # fmt: skip
    p.add_argument("--reuse", type=Path, help="an earlier call's results JSON: its parts that this call does not run go into the table, marked as reused (all five parts take more than one 10-minute call)")  # fmt: skip
    p.add_argument("--flexgen-peer", type=Path, default=ROOT / ".whl" / "flexgen_peer.py")
    p.add_argument("--ceiling-bytes", type=int, default=2**29, help="bytes a ceiling copy moves")  # fmt: skip
    args = p.parse_args()
    bench.check_names(p, "--parts", args.parts, PARTS)
    if args.smoke:
        args.prompt_len, args.gen_len, args.gpu_mem, args.dtype = 32, 4, "8MB", "float32"
        args.ceiling_bytes = 2**24
        if args.compress == args.kv_compress == "auto":  # a search over every pair: minutes
            args.compress = args.kv_compress = "int4"
    return args


def flexgen_part(name: str, args, budget: bench.Budget, work: Path, env, has_cuda: bool) -> dict:
    """FlexGen's command as its README gives it; its log parsed."""
    if not has_cuda:
        return {"skipped": "no CUDA"}
    if importlib.util.find_spec("flexgen") is None:
        return {"skipped": "flexgen is not importable: install the carried wheels (see --help)"}
    if not args.flexgen_peer.is_file():
        return {"skipped": f"{args.flexgen_peer} does not exist"}
    log = work / name / "flexgen.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)  # FlexGen appends to its log
    cmd = [sys.executable, str(args.flexgen_peer), "--model", f"facebook/{args.model}"]
    cmd += ["--path", "_DUMMY_", "--prompt-len", str(args.prompt_len)]
    cmd += ["--gen-len", str(args.gen_len), *FLEXGEN[name].split(), "--log-file", str(log)]
    timeout_s = min(TIMES[name][0], budget.left())
    # FlexGen's copy threads keep it alive after an error: a traceback then 60 s of quiet ends it
    record = bench.run_part(name, cmd, timeout_s, work / name, env, hung_after_traceback_s=60)
    text = (log if log.is_file() else Path(record["stdout"])).read_text(errors="replace")
    for phase, latency, rate in re.findall(
        r"(prefill|decode|total) latency: ([\d.]+) s\s+\1 throughput: ([\d.]+) token/s", text
    ):
        record[f"{phase}_s"], record[f"{phase}_tok_s"] = float(latency), float(rate)
    peak = re.search(r"peak gpu mem: ([\d.]+) GB", text)
    record["peak_gpu_bytes"] = float(peak.group(1)) * 2**30 if peak else None  # FlexGen's GB
    flags = FLEXGEN[name].split()
    batch = int(flags[flags.index("--gpu-batch-size") + 1])
    record["sequences"] = batch * int(flags[flags.index("--num-gpu-batches") + 1])
    record["tok_s"] = record.get("total_tok_s")
    return record


def run_parts(args, results: bench.Results, budget: bench.Budget, work: Path) -> None:
    env = bench.child_env()
    model = str(bench.smoke_model("opt-30b", work)) if args.smoke else args.model
    base = ["--model", model, "--dummy", "--gpu-mem", args.gpu_mem, "--dtype", args.dtype]
    compressed = [*base, "--compress", args.compress, "--kv-compress", args.kv_compress]
    state = {"has_cuda": not args.smoke}

    def run(name: str) -> dict:
        if name == "ceilings":
            record = bench.ceilings_part(budget, work, env, args.nvme, args.ceiling_bytes)
            measured = record.get("measured", {})
            state["has_cuda"] = measured.get("has_cuda", state["has_cuda"])
            results.data["machine"]["device"] = measured.get("device")
            return record
        if name.startswith("ours"):
            flags = compressed if name == "ours-c" else base
            cap_s = TIMES[name][0]
            return bench.plan_and_run(
                name, flags, args.prompt_len, args.gen_len, budget, cap_s, work, env
            )
        return flexgen_part(name, args, budget, work, env, state["has_cuda"])

    bench.run_parts(
        args.parts.split(","), lambda name: TIMES[name][1], run, results, budget, _one_line
    )


def _one_line(record: dict[str, Any]) -> str:
    if "skipped" in record:
        return f"skipped: {record['skipped']}"
    if "error" in record:
        return f"error: {record['error']}"
    steps = [record[k] for k in ("plan", "run") if k in record] or [record]
    bad = next((s for s in steps if not s.get("ok")), None)
    status = "ok" if bad is None else f"FAILED (rc {bad['rc']}"
    if bad is not None:
        status += f", {bad['killed']})" if bad.get("killed") else ")"
    summary = record.get("summary", record)
    exact = "" if summary.get("all_exact_lengths", True) else f"; lengths off: {record['outputs']}"
    return f"{status}; {fmt(summary.get('tok_s'))} tok/s{exact}"


def table(args, results: dict[str, Any]) -> list[dict[str, Any]]:
    parts = results["parts"]
    rows = []
    for workload, (ours_name, peer_name, least, multiple) in WORKLOADS.items():
        ours = parts.get(ours_name, {}).get("summary", {})
        peer = parts.get(peer_name, {})
        tok_s, peer_tok_s = ours.get("tok_s"), peer.get("tok_s")
        ratio = tok_s / peer_tok_s if tok_s and peer_tok_s else None
        checks = [tok_s >= least if tok_s is not None else None]
        checks.append(ratio >= multiple if ratio is not None else None)
        verdict = "FAIL" if False in checks else "PASS" if all(checks) else "?"
        rows.append(
            {
                "workload": workload,
                "ours_tok_s": tok_s,
                "predicted_tok_s": ours.get("predicted_tok_s"),
                "sequences": ours.get("sequences"),
                "flexgen_tok_s": peer_tok_s,
                "flexgen_sequences": peer.get("sequences"),
                "ratio": ratio,
                "target": f">= {least:g} tok/s and >= {multiple:g}x FlexGen",
                "verdict": "n/a (smoke)" if args.smoke else verdict,
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]], ceilings: dict[str, Any]) -> None:
    print(
        f"\n{'workload':15s} {'ours tok/s':>10s} {'predicted':>9s} {'seqs':>5s} "
        f"{'FlexGen':>8s} {'seqs':>5s} {'ratio':>6s}  {'target':34s} verdict"
    )
    for r in rows:
        print(
            f"{r['workload']:15s} {fmt(r['ours_tok_s']):>10s} {fmt(r['predicted_tok_s']):>9s} "
            f"{fmt(r['sequences'], 'd'):>5s} {fmt(r['flexgen_tok_s']):>8s} "
            f"{fmt(r['flexgen_sequences'], 'd'):>5s} {fmt(r['ratio'], '.1f', 'x'):>6s}  "
            f"{r['target']:34s} {r['verdict']}"
        )
    if ceilings:
        print(
            f"ceilings ({ceilings.get('device')}): PCIe pinned H2D "
            f"{fmt(ceilings.get('h2d_pinned_gbps'))} GB/s, D2H "
            f"{fmt(ceilings.get('d2h_pinned_gbps'))} GB/s; HBM copy "
            f"{fmt(ceilings.get('hbm_copy_gbps'), '.0f')} GB/s, DRAM copy "
            f"{fmt(ceilings.get('dram_copy_gbps'))} GB/s (bytes read + written); disk read "
            f"{fmt(ceilings.get('disk_read_gbps'), '.2f')} GB/s, write "
            f"{fmt(ceilings.get('disk_write_gbps'), '.2f')} GB/s"
        )
    else:
        print("ceilings: not measured")


def main() -> None:
    args = parse_args()
    budget, work, results = bench.start(
        args,
        "bench_throughput",
        "OPT-30B dummy weights, prompt 512, gen 32, --gpu-mem 24GB, default CPU cap: ours "
        "(searched policy; fp16, and compression allowed) against FlexGen",
    )
    if args.reuse:
        earlier = json.loads(args.reuse.read_text())["parts"]
        for name, record in earlier.items():
            if name not in args.parts.split(","):
                results.data["parts"][name] = {**record, "reused_from": str(args.reuse)}
    try:
        run_parts(args, results, budget, work)
    finally:
        rows = table(args, results.data)
        results.data["table"] = rows
        results.data["seconds"] = budget.elapsed()
        results.save()
        ceilings = results.data["parts"].get("ceilings", {}).get("measured", {})
        print_table(rows, ceilings)
        print("wrote " + ", ".join(map(str, results.paths)))


if __name__ == "__main__":
    main()
