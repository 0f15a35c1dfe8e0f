"""The cost model's tensor-parallel terms (`cost.estimate` adds them a layer): the
all-reduces after the attention and the MLP, and a rank's wait at them for the slowest
of its group.
"""

from __future__ import annotations

from offload.core.config import ModelConfig
from offload.policies.hardware import GB, HardwareProfile


def rank_wait_s(host_side_s: float, hw: HardwareProfile, tp: int) -> float:
    """A decode layer's wait of a tensor-parallel rank for the slowest of its group at the
    layer's all-reduces: the measured skew (`rank_skew`) of the host-side work between
    them, `host_side_s` (the CPU attention and the executor's issue: the GPU's kernels
    take the same time on every rank). 0 for one rank, or where the profile has no skew
    figure."""
    if tp == 1:
        return 0.0
    return hw.rank_skew * host_side_s


def allreduce_s(
    cfg: ModelConfig, hw: HardwareProfile, tp: int, rows: int, micro: int, elt: int
) -> float:
    """A layer's two all-reduces (after attention and after the MLP) for each micro-
    batch: ring all-reduce moves 2 (tp - 1) / tp of the [rows, hidden] activations.
    0 where the profile has no all-reduce figure (`choose_policy` says so)."""
    if tp == 1 or not hw.allreduce_gbps:
        return 0.0
    nbytes = rows * cfg.hidden_size * elt
    return 2 * (
        micro * hw.allreduce_latency_s + 2 * (tp - 1) / tp * nbytes / (hw.allreduce_gbps * GB)
    )
