"""A rank's view of its node: what it has to itself and what it shares.

Each GPU of a node has its own PCIe link, HBM and compute; the CPU cores, DRAM and disk
are the node's, and every rank on it (every tensor-parallel rank of every data-parallel
group) takes its share of them. `rank_profile` derives one rank's `HardwareProfile` from
the node's (as `offload-profile` measured it, one process holding the whole machine) and
the ranks on the node, and the plan search costs a rank's plan with it:

    CPU attention     its rates over ranks, its time a (sequence, KV head) times ranks
                      (each rank's threads are pinned to its share of the cores)
    DRAM, disk        their rates over ranks (the KV homes' reads too)
    CPU memory        the node's over ranks (the default CPU cap)
    PCIe              the rate measured with every GPU copying at once where the profile
                      has it (`h2d_all_gbps`), else each link's own rate

So a plan bound by CPU attention gets no faster with more ranks (each rank attends its
heads with its share of the cores: the same time a step), and a plan bound by each
GPU's link runs each rank's half of the weights over its own link (about twice as
fast at two ranks). Where ranks meet at every all-reduce, the slowest of them sets the
pace: `cost_parallel.rank_wait_s` adds that wait (the profile's `rank_skew`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from offload.policies.hardware import HardwareProfile


def rank_profile(hw: HardwareProfile, ranks: int) -> HardwareProfile:
    """The profile as one of `ranks` processes of one node sees it (`hw`: the node's,
    measured by one process). One rank: `hw` itself."""
    if ranks < 1:
        raise ValueError(f"ranks on a node must be positive, got {ranks}")
    if ranks == 1:
        return hw
    assert hw.node_ranks == 1, "a rank's view is derived from the node's profile, once"

    def share(rates: dict[str, float]) -> dict[str, float]:
        return {key: rate / ranks for key, rate in rates.items()}

    def longer(seconds: dict[str, float]) -> dict[str, float]:
        return {key: s * ranks for key, s in seconds.items()}

    h2d = hw.h2d_all_gbps or hw.h2d_gbps
    under = hw.h2d_under_cpu_attention_gbps
    return dataclasses.replace(
        hw,
        node_ranks=ranks,
        cpu_mem_bytes=hw.cpu_mem_bytes // ranks,
        cpu_attention_gbps=hw.cpu_attention_gbps / ranks,
        cpu_quant_attention_gbps=hw.cpu_quant_attention_gbps / ranks,
        cpu_attention_grouped_gbps=share(hw.cpu_attention_grouped_gbps),
        cpu_quant_attention_grouped_gbps=share(hw.cpu_quant_attention_grouped_gbps),
        cpu_attention_pair_s=longer(hw.cpu_attention_pair_s),
        cpu_quant_attention_pair_s=longer(hw.cpu_quant_attention_pair_s),
        dram_gbps=hw.dram_gbps / ranks,
        disk_read_gbps=hw.disk_read_gbps / ranks,
        disk_write_gbps=hw.disk_write_gbps / ranks,
        disk_kv_read_gbps=hw.disk_kv_read_gbps / ranks,
        h2d_gbps=h2d,
        # the copy beside the CPU attention: no faster than the links all at once
        h2d_under_cpu_attention_gbps=min(under, h2d) if under else 0.0,
    )


@dataclass(frozen=True)
class Layout:
    """A job's processes on one node: `tp` tensor-parallel ranks a group (one GPU each)
    and `dp` data-parallel groups of them. Its tp x dp ranks share the node's cores,
    DRAM and disk, and its groups one pinned copy of the weights."""

    tp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.dp < 1:
            raise ValueError(f"tp and dp must be positive, got {self.tp} and {self.dp}")

    @property
    def ranks(self) -> int:
        return self.tp * self.dp
