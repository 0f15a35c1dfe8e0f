"""Each rank on its share of the node's cores, on its GPU's NUMA node where there is one.

The ranks of a node share its cores: left alone, every rank's OpenMP pool (the CPU
attention, torch's host ops) takes as many threads as the node has cores, and the
reader, KV and spill threads float over all of them, so the ranks preempt each other
and the slowest sets the pace at every all-reduce. `pin_rank` gives a rank a disjoint
set of cores before any of its pools start (threads inherit their creator's set), and
sizes torch's pool to it. A GPU's NUMA node comes from sysfs (its PCI device's
`numa_node`); ranks whose GPUs sit on one node split that node's cores, and where the
machine tells no NUMA node (a VM's -1) the ranks split all the cores this process may
use.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SYSFS = Path("/sys")


def cpu_list(text: str) -> list[int]:
    """A sysfs CPU list ("0-3,8,10-11") as CPU numbers."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def gpu_numa_node(index: int, sysfs: Path = SYSFS) -> int | None:
    """The NUMA node of CUDA device `index` (None: no GPU, or sysfs does not say)."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(index)
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    domain, device = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
    path = sysfs / "bus/pci/devices" / f"{domain:04x}:{bus:02x}:{device:02x}.0" / "numa_node"
    try:
        node = int(path.read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def node_cpus(node: int, sysfs: Path = SYSFS) -> list[int]:
    try:
        return cpu_list((sysfs / f"devices/system/node/node{node}/cpulist").read_text())
    except OSError:
        return []


def rank_cpus(
    local_rank: int, numa_of_rank: list[int | None], allowed: list[int], cpus_of_node
) -> list[int]:
    """The cores of `local_rank` among the node's ranks: the allowed cores of its GPU's
    NUMA node split evenly among the ranks on that node, else all allowed cores split
    evenly among all ranks. `numa_of_rank`: each local rank's NUMA node (None: unknown);
    `cpus_of_node(node)`: that node's cores."""
    node = numa_of_rank[local_rank]
    pool = [c for c in cpus_of_node(node) if c in allowed] if node is not None else []
    peers = [r for r, n in enumerate(numa_of_rank) if n == node]
    if node is None or len(pool) < len(peers):
        pool, peers = sorted(allowed), list(range(len(numa_of_rank)))
    share, extra = divmod(len(pool), len(peers))
    position = peers.index(local_rank)
    start = position * share + min(position, extra)
    return pool[start : start + share + (1 if position < extra else 0)] or pool[:1]


def pin_rank(local_rank: int, local_world: int, device: torch.device) -> list[int]:
    """Pin this process (and the threads it starts from now on) to its share of the
    node's cores and size torch's intra-op pool to it; the cores chosen."""
    allowed = sorted(os.sched_getaffinity(0))
    if device.type == "cuda":
        gpus = torch.cuda.device_count()
        numa = [gpu_numa_node(r % gpus) for r in range(local_world)]
    else:
        numa = [None] * local_world
    cpus = rank_cpus(local_rank, numa, allowed, node_cpus)
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    log.debug("rank %d of %d on cores %s", local_rank, local_world, cpus)
    return cpus
