"""The node's real memory limit: the smaller of MemTotal and the cgroup's limit.

On the multi-GPU machines RAM grows as it is used: MemTotal reads about 31 GiB at start
against a 256 GiB cgroup limit, and on a shared host a container's cgroup limit can be
far below MemTotal. `node_memory_limit` reads both and says which one set the cap.
`policies.measure.measure` records it as the profile's `cpu_mem_bytes` (whence the
default CPU cap), and `offload.parallel` divides it among a node's ranks.
"""

from __future__ import annotations

from pathlib import Path

CGROUP_V2 = Path("/sys/fs/cgroup/memory.max")
CGROUP_V1 = Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")
MEMINFO = Path("/proc/meminfo")
# cgroup v1 writes "no limit" as a huge page-aligned number (2^63 rounded down)
_UNLIMITED = 1 << 60


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text or text == "max" or not text.isdigit():
        return None
    value = int(text)
    return value if 0 < value < _UNLIMITED else None


def _mem_total(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def node_memory_limit(
    cgroup_v2: Path = CGROUP_V2, cgroup_v1: Path = CGROUP_V1, meminfo: Path = MEMINFO
) -> tuple[int, str]:
    """(bytes, where they came from): the smallest real limit of the cgroup (v2
    memory.max, else v1 memory.limit_in_bytes) and MemTotal.

    A cgroup limit above MemTotal wins over it too: MemTotal can read low on machines
    whose memory grows as it is used, and the cgroup's limit is what the kernel enforces.
    """
    total = _mem_total(meminfo)
    for path in (cgroup_v2, cgroup_v1):
        limit = _read_limit(path)
        if limit is not None:
            if total is not None and limit < total:
                return limit, f"cgroup limit {path} (below MemTotal {total / 2**30:.1f} GiB)"
            return limit, f"cgroup limit {path}" + (
                f" (MemTotal reads {total / 2**30:.1f} GiB)" if total is not None else ""
            )
    assert total is not None, f"cannot read MemTotal from {meminfo}"
    return total, f"MemTotal in {meminfo} (no cgroup memory limit)"


def rank_cpu_bytes(node_bytes: int, ranks_on_node: int) -> int:
    """A rank's share of the node's CPU memory budget (--cpu-mem is for the node)."""
    return node_bytes // max(1, ranks_on_node)
