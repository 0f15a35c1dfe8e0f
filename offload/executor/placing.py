"""Placing a model's weights before a run: the weight store (for weights on disk), the
pinned pools, every stage's homes (`weights.WeightHomes`) and the fetcher that streams
them in (`weights.WeightFetcher`), with a mixture of experts' expert fetcher
(`experts.ExpertFetcher`) beside it.

The data-parallel groups of a node can share one pinned copy of the weights' CPU homes
(`SharedWeights`): its pool lives in shared memory (`io.shared`), every process
allocates its blocks in the same order (so at the same offsets), the owner writes them
and the others make only what they hold elsewhere (GPU parts, disk tails). The disk
staging of each process is its own pool. Shared experts keep their places: moving the
most used to the GPU (`ExpertFetcher.rebalance`) rewrites pinned bytes that other
processes read.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from offload.executor.experts import ExpertFetcher
from offload.executor.lanes import Lanes
from offload.executor.weights import WeightFetcher, WeightHomes
from offload.io.pinned import PinnedPool
from offload.io.reader import ExtentReader
from offload.io.shared import SharedMemory
from offload.io.store import ensure_store
from offload.io.tiers import MemoryLedger
from offload.models.weights import WeightSource
from offload.policies.memory import weight_plan
from offload.policies.policy import Policy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharedWeights:
    """One pinned copy of the weights' CPU homes for several processes of a node: `memory`
    holds it; the `owner` writes it, the others read what the owner wrote (after the
    caller's barrier)."""

    memory: SharedMemory
    owner: bool


@dataclass
class PlacedWeights:
    pool: PinnedPool  # the weights' CPU homes
    staging: PinnedPool  # disk staging (the same pool unless the homes are shared)
    reader: ExtentReader
    homes: WeightHomes
    fetcher: WeightFetcher
    experts: ExpertFetcher  # a mixture of experts' routed experts (none in a dense model)
    shared: SharedWeights | None
    seconds: float
    # the load's parts (`policies.job.load_estimate` predicts each): store_s, pin_s, place_s
    parts: dict[str, float]

    def close(self) -> None:
        self.fetcher.close()
        self.experts.close()
        self.reader.close()
        if self.staging is not self.pool:
            self.staging.close()
        self.pool.close()
        if self.shared is not None:
            self.shared.memory.close()


def _pools(plan: dict[str, int], shared: SharedWeights | None) -> tuple[PinnedPool, PinnedPool]:
    """(homes, staging): one pool, or the homes in the shared memory and staging apart."""
    if shared is None:
        pool = PinnedPool(max(4096, plan["weights_cpu"] + plan["weight_staging_cpu"]))
        return pool, pool
    homes = PinnedPool(max(4096, plan["weights_cpu"]), memory=shared.memory)
    return homes, PinnedPool(max(4096, plan["weight_staging_cpu"]))


def place_weights(
    source: WeightSource,
    policy: Policy,
    dtype: torch.dtype,
    device: torch.device,
    lanes: Lanes,
    ledger: MemoryLedger,
    nvme_dir: Path | None,
    progress: bool,
    shared: SharedWeights | None = None,
) -> PlacedWeights:
    started = time.perf_counter()
    store = None
    if policy.weights.disk > 0:  # first: a disk short of room fails before pinning
        assert nvme_dir is not None, "the caller checks --nvme for disk policies"
        store = ensure_store(
            source, nvme_dir, dtype, progress, policy.weight_compression, policy.weights
        )
    stored = time.perf_counter()
    pool, staging = _pools(weight_plan(source.config, policy, dtype), shared)
    reader = ExtentReader(threads=8)
    pinned = time.perf_counter()
    homes = WeightHomes(
        source,
        policy.weights,
        dtype,
        device,
        pool,
        ledger,
        store,
        policy.weight_compression,
        progress,
        fill_cpu=shared is None or shared.owner,
    )
    if device.type == "cuda":  # the load's transient segments go back before the run's
        torch.cuda.empty_cache()
    fetcher = WeightFetcher(homes, lanes, device, staging, reader, ledger)
    experts = ExpertFetcher(fetcher, device, staging, ledger, policy, movable=shared is None)
    seconds = time.perf_counter() - started
    parts = {
        "store_s": stored - started,
        "pin_s": pinned - stored,
        "place_s": started + seconds - pinned,
    }
    if progress:
        log.info(
            "loaded in %.1f s: weight store %.1f s, pinning %.1f s, placing weights %.1f s%s",
            seconds,
            stored - started,
            pinned - stored,
            started + seconds - pinned,
            "" if shared is None else " (the pinned copy shared by the node's groups)",
        )
    return PlacedWeights(pool, staging, reader, homes, fetcher, experts, shared, seconds, parts)
