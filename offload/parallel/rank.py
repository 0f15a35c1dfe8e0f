"""One tensor-parallel rank's runner: the existing executor over the rank's shard.

`RankRunner` offers the runner interface the engine drives (start, step_inputs,
forward): it slices the step's ALiBi bias to the rank's heads, runs the executor (which
all-reduces through the decoder's `parallel` seam) and gathers the vocab-parallel
logits, so the engine samples from the full logits on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from offload.core.errors import UserError
from offload.executor.executor import Executor
from offload.executor.placing import SharedWeights
from offload.io.pinned import align_up
from offload.io.shared import SharedMemory
from offload.models.batch import PaddedBatch
from offload.models.decoder import StepInputs
from offload.models.weights import WeightSource
from offload.parallel.comm import TensorParallel, Topology
from offload.parallel.shard import ShardSource
from offload.policies.policy import Policy

log = logging.getLogger(__name__)


class RankRunner:
    """The executor of one rank, seen by the engine as a whole-model runner."""

    def __init__(self, executor: Executor, parallel: TensorParallel) -> None:
        self.executor, self.parallel = executor, parallel

    def start(self, batch: PaddedBatch) -> None:
        self.executor.start(batch)

    def step_inputs(self, batch: PaddedBatch, cache_start: int, num_new: int) -> StepInputs:
        """The batch's step inputs; an ALiBi bias [B, heads, T, S] keeps the rank's heads
        (its slopes follow its heads)."""
        step = self.executor.step_inputs(batch, cache_start, num_new)
        if step.bias.shape[1] == 1:
            return step
        bias = step.bias[:, self.parallel.shard.heads].contiguous()
        return dataclasses.replace(step, bias=bias)

    def forward(
        self,
        token_ids: torch.Tensor,
        step: StepInputs,
        last_only: bool = True,
        wait: bool = True,
    ) -> torch.Tensor:
        """Full fp32 logits [B, V] (or [B, T, V]), the same on every rank (it waits: the
        ranks run eagerly)."""
        return self.parallel.gather_vocab(self.executor.forward(token_ids, step, last_only))

    def __getattr__(self, name: str):
        # ledger, tracer, traces, kv_pool_bytes, memory_report, close: the executor's
        return getattr(self.executor, name)


def rank_dir(nvme: Path, world_rank: int) -> Path:
    """A rank's own directory for its weight store and KV spill: <nvme>/rank<i>."""
    return nvme / f"rank{world_rank}"


def rank_nvme(nvme: Path | None, world_rank: int) -> Path | None:
    """`rank_dir`, made (None without an --nvme directory)."""
    if nvme is None:
        return None
    path = rank_dir(nvme, world_rank)
    path.mkdir(parents=True, exist_ok=True)
    return path


def share_weights(topo: Topology, nbytes: int) -> SharedWeights | None:
    """One pinned copy of this rank's weights' CPU homes (`nbytes`) for the data-parallel
    groups on its node: the node's first group's rank of each TP rank makes it, the
    others of that TP rank map the same pages (`io.shared`). None with one group on the
    node or no weights in CPU memory. Every rank calls it (a collective), after the plan;
    a rank that cannot open the owner's memory keeps a copy of its own, and says so."""
    if topo.local_world // topo.tp <= 1:
        return None
    size = align_up(max(4096, nbytes))
    owner = topo.local_rank < topo.tp
    mine = SharedMemory.create(size) if owner and nbytes else None
    host = socket.gethostname()
    entries: list = [None] * topo.world
    dist.all_gather_object(
        entries, (host, topo.tp_rank, mine.handle if mine else None), group=topo.control
    )
    if mine is not None:
        return SharedWeights(mine, owner=True)
    found = [h for node, tp_rank, h in entries if (node, tp_rank) == (host, topo.tp_rank) and h]
    if not nbytes or not found:
        return None
    try:
        return SharedWeights(SharedMemory.attach(found[0]), owner=False)
    except UserError as exc:
        log.warning("%s; this group keeps a pinned copy of its own", exc)
        return None


def make_rank_runner(
    source: WeightSource,
    parallel: TensorParallel,
    policy: Policy,
    dtype: torch.dtype,
    device: torch.device,
    nvme: Path | None,
    trace: bool | int = False,
    progress: bool = False,
) -> RankRunner:
    """The executor over this rank's shard of `source` (nvme: the rank's own directory).
    A group of one rank (data parallelism alone) runs the plain executor over the whole
    model: no collective, so decode steps replay CUDA graphs where the plan allows."""
    alone = parallel.size == 1
    executor = Executor(
        source if alone else ShardSource(source, parallel.shard),
        policy,
        dtype,
        device,
        nvme_dir=nvme,
        trace=trace,
        progress=progress,
        parallel=None if alone else parallel,
        shared_weights=parallel.shared_weights,
    )
    parallel.tracer = executor.tracer  # its all-reduces are spans of the rank's trace
    return RankRunner(executor, parallel)
