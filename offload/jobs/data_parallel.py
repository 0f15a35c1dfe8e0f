"""Data parallelism over a job: requests sharded over groups, results merged in order.

Group g of M takes the requests whose input index is g modulo M. Each group's TP rank 0
appends finished blocks to its own `<output>.dp<g>of<M>.partial` (a `jobs.ResultLog`:
fsynced, fingerprinted, resumable); the job's world rank 0 merges the M partial files
in input order once every group is done. Killed and started again, every group skips
what its partial file holds, so every id lands exactly once.
"""

from __future__ import annotations

import array
import hashlib
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from offload.io.atomic import atomic_writer
from offload.jobs.job import JobRequest


def group_requests(requests: Iterator[JobRequest], dp: int, index: int) -> Iterator[JobRequest]:
    """The requests data-parallel group `index` of `dp` generates."""
    return (req for req in requests if req.index % dp == index)


def group_output(output: Path, dp: int, index: int) -> Path:
    """Where group `index` keeps its results (`output` itself with one group)."""
    return output if dp == 1 else output.with_name(f"{output.name}.dp{index}of{dp}")


def seeded(requests: Iterator[JobRequest], job_seed: int) -> Iterator[JobRequest]:
    """Requests that sample without a seed get one of their own from the job's seed, so
    every rank of a group draws the same tokens (a fresh generator per rank would not)."""
    for req in requests:
        params = req.params
        if params is not None and not params.greedy and params.seed is None:
            digest = hashlib.sha256(f"{job_seed}/{req.index}".encode()).digest()
            seed = int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
            req = replace(req, params=replace(params, seed=seed))
        yield req


def merge_groups(output: Path, dp: int, total: int) -> None:
    """Write the groups' results in input order to `output` (atomically, fsynced) and remove
    the groups' partial files. Each of the `total` indices must appear exactly once."""
    partials = [
        group_output(output, dp, g).with_name(group_output(output, dp, g).name + ".partial")
        for g in range(dp)
    ]
    where = array.array("q", [-1]) * total  # index -> group * 2^40 + offset
    for group, path in enumerate(partials):
        with path.open("rb") as f:
            f.readline()  # the job fingerprint
            while True:
                pos = f.tell()
                line = f.readline()
                if not line:
                    break
                if not line.endswith(b"\n"):
                    break  # a torn last line: never a finished result
                index = json.loads(line)["_index"]
                assert where[index] == -1, f"request {index} was written twice"
                where[index] = (group << 40) + pos
    missing = where.count(-1)
    assert missing == 0, f"{missing} results missing at merge"
    files = [p.open("rb") for p in partials]
    try:
        with atomic_writer(output) as dst:
            for packed in where:
                src = files[packed >> 40]
                src.seek(packed & ((1 << 40) - 1))
                row = json.loads(src.readline())
                del row["_index"]
                dst.write(json.dumps(row, ensure_ascii=False) + "\n")
    finally:
        for f in files:
            f.close()
    for path in partials:
        path.unlink()
