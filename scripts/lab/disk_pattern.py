"""The spill disk under the executor's access pattern: a diagnostic, not a benchmark.

    python scripts/lab/disk_pattern.py --dir /mnt/nvme --home-mb 4.4 --homes 96 --out DIR

A decode step over disk KV homes reads each home whole (`SpillFile.transfer`: requests
of up to `spill.CHUNK_BYTES`, the calling thread doing the last) and writes back a few
pages of it. This times, in one process:
- the profile's measurement (`measure_disk.disk_rates`: 16 MiB requests, one at a time);
- reads of one home size after another through the homes (alone);
- the page write-backs alone (two spans of `--write-kb` each, as K and V);
- reads and write-backs together, as the executor issues them: one thread reads home
  i while another writes back home i - 1, `--depth` homes apart at most;
- reads of the home size at other request sizes (`--chunks-kb`);
and with `--busy-host`, all of it beside a spinning Python thread with the executor's
GIL switch interval (the host thread launching work holds the GIL most of the time).
Prints one table; JSON under --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import threading
import time
from pathlib import Path

import torch

from offload.io import spill
from offload.io.pinned import ALIGN, PinnedPool, align_up
from offload.policies.measure_disk import beside_busy_host, disk_rates

MB = 1e6


def _half(home: int) -> int:
    """Where a home's V region starts: its middle page."""
    return home // 2 // ALIGN * ALIGN


def _reads(file: spill.SpillFile, bufs: list[torch.Tensor], homes: int, home: int) -> list[float]:
    times = []
    for i in range(homes):
        started = time.perf_counter()
        file.transfer([(i * home, bufs[i % len(bufs)])], write=False)
        times.append(time.perf_counter() - started)
    return times


def _write_back(file: spill.SpillFile, page: torch.Tensor, i: int, home: int) -> None:
    """Home i's page write-back: half of `page` at its K region, half at its V region."""
    span = page.numel() // 2
    file.transfer([(i * home, page[:span]), (i * home + _half(home), page[span:])], write=True)


def _writes(file: spill.SpillFile, page: torch.Tensor, homes: int, home: int) -> list[float]:
    times = []
    for i in range(homes):
        started = time.perf_counter()
        _write_back(file, page, i, home)
        times.append(time.perf_counter() - started)
    return times


def _together(
    file: spill.SpillFile, bufs, page, homes: int, home: int, depth: int
) -> tuple[list[float], float]:
    """Home i's read waits for home i - depth's write-back (its staging block's last
    user), and home i's write-back follows its read, on another thread."""
    read_done = [threading.Event() for _ in range(homes)]
    written = [threading.Event() for _ in range(homes)]
    read_times: list[float] = []

    def reader() -> None:
        for i in range(homes):
            if i >= depth:
                written[i - depth].wait()
            started = time.perf_counter()
            file.transfer([(i * home, bufs[i % len(bufs)])], write=False)
            read_times.append(time.perf_counter() - started)
            read_done[i].set()

    def writer() -> None:
        for i in range(homes):
            read_done[i].wait()
            _write_back(file, page, i, home)
            written[i].set()

    started = time.perf_counter()
    threads = [threading.Thread(target=reader), threading.Thread(target=writer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return read_times, time.perf_counter() - started


def _row(name: str, times: list[float], nbytes: int) -> dict:
    total = sum(times)
    return {
        "case": name,
        "median_ms": statistics.median(times) * 1e3,
        "gbps": nbytes * len(times) / total / 1e9,
    }


def _measure(args: argparse.Namespace, home: int) -> list[dict]:
    rows = []
    read_gbps, write_gbps = disk_rates(args.dir, 2**30)
    rows.append({"case": "profile: 16 MiB requests, one at a time", "gbps": read_gbps})
    rows.append({"case": "profile: writes", "gbps": write_gbps})
    span = align_up(args.write_kb * 1024)
    with (
        PinnedPool(home * args.depth + 2 * span) as pool,
        spill.SpillFile(args.dir, home * args.homes) as file,
    ):
        bufs = [pool.alloc(home).tensor for _ in range(args.depth)]
        page = pool.alloc(2 * span).tensor
        file.transfer([(i * home, bufs[0]) for i in range(args.homes)], write=True)
        times = _reads(file, bufs, args.homes, home)
        rows.append(_row(f"reads of {home / MB:.1f} MB", times, home))
        rows.append(_row("page write-backs", _writes(file, page, args.homes, home), page.numel()))
        times, wall = _together(file, bufs, page, args.homes, home, args.depth)
        row = _row(f"reads beside write-backs, depth {args.depth}", times, home)
        row["wall_gbps"] = home * args.homes / wall / 1e9
        rows.append(row)
        default = spill.CHUNK_BYTES
        for kb in (int(x) for x in args.chunks_kb.split(",")):
            spill.CHUNK_BYTES = kb * 1024
            times = _reads(file, bufs, args.homes, home)
            rows.append(_row(f"reads, {kb} KiB requests", times, home))
        spill.CHUNK_BYTES = default
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=Path, default=Path("."))
    p.add_argument("--home-mb", type=float, default=4.4)
    p.add_argument("--homes", type=int, default=96)
    p.add_argument("--write-kb", type=int, default=16)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--chunks-kb", default="256,4096")
    p.add_argument(
        "--busy-host",
        action="store_true",
        help="a Python thread spins throughout, as the executor's launching host thread",
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    home = align_up(int(args.home_mb * MB))
    with beside_busy_host() if args.busy_host else contextlib.nullcontext():
        rows = _measure(args, home)
    for row in rows:
        extra = f"  wall {row['wall_gbps']:.2f} GB/s" if "wall_gbps" in row else ""
        median = f"{row['median_ms']:8.2f} ms" if "median_ms" in row else " " * 11
        print(f"{row['case']:48s} {median} {row['gbps']:6.2f} GB/s{extra}")
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (args.out / f"disk_pattern_{stamp}.json").write_text(
        json.dumps(
            {"home_bytes": home, "homes": args.homes, "busy_host": args.busy_host, "rows": rows},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
