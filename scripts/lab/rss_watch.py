"""Where a command's host memory goes: its resident bytes over time, by mapping, at the peak.

    python scripts/lab/rss_watch.py [--every 0.05] [--out DIR] [--name NAME] -- offload-run ...

Runs the command and samples the child's (and its children's) VmRSS from /proc. Each time
the resident total passes the last breakdown's by 256 MB (and every 10 s), it reads
/proc/PID/smaps of the largest process and
sums resident bytes by mapping: the pinned pools (anonymous mappings of 1 GB or more),
the heap and smaller anonymous mappings, and each shared library or mapped file by name.
The breakdown taken nearest the peak answers "what, besides the plan's pools, was
resident". Prints the peak breakdown and writes the time series and breakdowns as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil

POOL_BYTES = 1 << 30  # an anonymous mapping this large is one of the executor's pools
STEP_BYTES = 256 << 20  # a new breakdown each time the peak grows by this much
EVERY_S = 10.0  # and one at least this often
SMALL_BYTES = 16 << 20  # mappings below this are summed into one entry


def smaps_breakdown(pid: int) -> dict[str, int]:
    """Resident bytes of one process by mapping kind (pools, heap, anon, each file)."""
    out: dict[str, int] = defaultdict(int)
    name, size = "", 0
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line
                fields = line.split()
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                size = hi - lo
                name = fields[5] if len(fields) > 5 else ""
            elif head == "Rss:":
                rss = int(line.split()[1]) * 1024
                if not rss:
                    continue
                if name in ("", "[anon]") or name.startswith("[anon:"):
                    kind = "pools (anon >= 1 GB)" if size >= POOL_BYTES else "anon < 1 GB"
                elif name.startswith("["):
                    kind = name
                else:
                    kind = os.path.basename(name)
                out[kind] += rss
    return dict(out)


def _fold_small(parts: dict[str, int]) -> dict[str, int]:
    """Mappings under SMALL_BYTES summed into one entry (dozens of libraries a breakdown)."""
    out = {k: v for k, v in parts.items() if v >= SMALL_BYTES}
    small = sum(v for v in parts.values() if v < SMALL_BYTES)
    return out | ({"others < 16 MB each": small} if small else {})


def tree_rss(proc: psutil.Process) -> tuple[int, list[psutil.Process]]:
    """Resident bytes of a process and its descendants, and the processes."""
    procs = [proc, *proc.children(recursive=True)]
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total, procs


def biggest(procs: list[psutil.Process]) -> psutil.Process:
    def rss(p: psutil.Process) -> int:
        try:
            return p.memory_info().rss
        except psutil.NoSuchProcess:
            return 0

    return max(procs, key=rss)


def watch(cmd: list[str], every_s: float) -> dict:
    began = time.perf_counter()
    child = subprocess.Popen(cmd)
    proc = psutil.Process(child.pid)
    series, breakdowns, peak, last_breakdown, last_t = [], [], 0, 0, 0.0
    while child.poll() is None:
        try:
            total, procs = tree_rss(proc)
        except psutil.NoSuchProcess:
            break
        now = time.perf_counter() - began
        series.append((round(now, 3), total))
        peak = max(peak, total)
        if total >= last_breakdown + STEP_BYTES or now >= last_t + EVERY_S:
            target = biggest(procs)
            try:
                parts = smaps_breakdown(target.pid)
            except (FileNotFoundError, ProcessLookupError, psutil.NoSuchProcess):
                parts = {}
            if parts:
                parts = _fold_small(parts)
                breakdowns.append({"t_s": round(now, 3), "rss": total, "pid": target.pid, **parts})
                last_breakdown, last_t = max(last_breakdown, total), now
        time.sleep(every_s)
    return {
        "cmd": cmd,
        "rc": child.wait(),
        "seconds": round(time.perf_counter() - began, 2),
        "peak_rss": peak,
        "series": series[:: max(1, len(series) // 2000)],
        "breakdowns": breakdowns,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--every", type=float, default=0.05, help="seconds between samples")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="run", help="a label for the JSON's file name")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command")
    args = p.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("give the command after --")
    res = watch(cmd, args.every)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = args.out / f"rss_watch_{args.name}_{stamp}.json"
    path.write_text(json.dumps(res, separators=(",", ":")))  # hundreds of breakdowns
    last = max(res["breakdowns"], key=lambda b: b["rss"], default={})
    print(
        f"peak RSS {res['peak_rss'] / 1e9:.2f} GB; breakdown at {last.get('rss', 0) / 1e9:.2f} GB:"
    )
    parts = {k: v for k, v in last.items() if k not in ("t_s", "rss", "pid")}
    for kind, rss in sorted(parts.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {rss / 1e9:8.3f} GB  {kind}")
    print(f"JSON: {path}")
    sys.exit(res["rc"])


if __name__ == "__main__":
    main()
