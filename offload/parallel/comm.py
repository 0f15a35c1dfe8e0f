"""Process groups and the collectives of tensor parallelism, over torch.distributed.

`Topology.from_env` reads what torchrun / the elastic launcher put in the environment
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR/PORT), joins the default
process group (nccl on CUDA, gloo on the CPU) and cuts the world into data-parallel
groups of `tp` consecutive ranks, each one tensor-parallel group:

    world rank = dp_index * tp + tp_rank

`TensorParallel` is one rank's side of the decoder's seam (`decoder.Parallel`): the
all-reduce after a row-parallel matmul, the vocab-parallel embedding, and the gather
of the vocab-parallel logits for sampling.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from offload.core.errors import UserError
from offload.executor.lanes import Tracer
from offload.executor.placing import SharedWeights
from offload.kernels.quant import QTensor, embedding
from offload.parallel.shard import RankShard
from offload.policies.node import Layout

# overrides the backend (nccl on CUDA, gloo on the CPU): gloo lets two ranks share one
# GPU, which NCCL refuses (a correctness run on a one-GPU machine)
BACKEND_ENV = "OFFLOAD_DIST_BACKEND"


def env_world() -> tuple[int, int, int, int] | None:
    """(rank, world size, local rank, local world size) set by a launcher, or None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return rank, world, local, local_world


@dataclass
class Topology:
    """Where this process sits: its world rank, its TP group and its DP group index."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    tp: int
    dp: int
    device: torch.device
    tp_group: dist.ProcessGroup | None = None
    control: dist.ProcessGroup | None = None  # gloo, for Python objects (world)
    tp_control: dist.ProcessGroup | None = None  # gloo, for Python objects (TP group)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_index(self) -> int:
        return self.rank // self.tp

    @property
    def tp_leader(self) -> int:
        """World rank of this TP group's rank 0 (writes the group's results)."""
        return self.dp_index * self.tp

    @property
    def is_leader(self) -> bool:
        return self.tp_rank == 0

    @classmethod
    def from_env(cls, tp: int | None, dp: int, device: torch.device) -> Topology:
        """Join the process group the launcher set up. tp=None: world size / dp."""
        found = env_world()
        assert found is not None, "called outside a torch.distributed launcher"
        rank, world, local_rank, local_world = found
        tp = tp or world // dp
        if tp * dp != world:
            raise UserError(
                f"--tp {tp} x --dp {dp} is {tp * dp} ranks but the launcher started {world}; "
                f"give --nproc-per-node/--nnodes that multiply to {tp * dp}"
            )
        if device.type == "cuda":
            # one GPU per rank; fewer GPUs than ranks only with gloo, for correctness runs
            device = torch.device("cuda", local_rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        backend = os.environ.get(BACKEND_ENV) or ("nccl" if device.type == "cuda" else "gloo")
        if not dist.is_initialized():
            # bound to its GPU, NCCL makes its communicator now, not in the first step
            bound = {"device_id": device} if backend == "nccl" else {}
            dist.init_process_group(backend, init_method="env://", **bound)
        topo = cls(rank, world, local_rank, local_world, tp, dp, device)
        # every rank creates every group, in the same order (torch.distributed's rule)
        for index in range(dp):
            members = list(range(index * tp, (index + 1) * tp))
            group = dist.new_group(members, backend=backend)
            control = group if backend == "gloo" else dist.new_group(members, backend="gloo")
            if index == topo.dp_index:
                topo.tp_group, topo.tp_control = group, control
        topo.control = None if backend == "gloo" else dist.new_group(backend="gloo")
        topo.warm_up()
        return topo

    def warm_up(self) -> None:
        """One all-reduce in this rank's TP group: its communicator and buffers are set
        up here, before the load, so none of that falls in the job's first step."""
        if self.tp > 1:
            dist.all_reduce(torch.zeros(1, device=self.device), group=self.tp_group)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    # -- agreeing on Python objects -------------------------------------------------------
    def share(self, obj, tp_only: bool = False):
        """`obj` as rank 0 of the world (or of the TP group) has it, on every rank."""
        box = [obj]
        if tp_only:
            dist.broadcast_object_list(box, src=self.tp_leader, group=self.tp_control)
        else:
            dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    def tensor_parallel(self, shard_of) -> TensorParallel:
        """This rank's `TensorParallel` for model config `shard_of` (a full config)."""
        shard = RankShard.of(shard_of, self.tp, self.tp_rank)
        return TensorParallel(shard, self.tp_group, self.device, self.layout)

    @property
    def layout(self) -> Layout:
        """This node's ranks: the TP groups that run on it share its cores and memory."""
        return Layout(self.tp, max(1, self.local_world // self.tp))

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class TensorParallel:
    """One rank's collectives over its TP group (implements `decoder.Parallel`).

    Where its executor traces a step (`tracer`, set by `rank.make_rank_runner`), each
    all-reduce is a span on the "allreduce" lane: on the GPU its events on the compute
    stream, so a span is the collective's time there, the wait for the slowest rank
    included (the per-rank traces show the skew)."""

    shard: RankShard
    group: dist.ProcessGroup | None
    device: torch.device  # the rank's compute device (its own GPU)
    layout: Layout = field(default_factory=Layout)  # the job's ranks on this node
    # the weights' CPU homes shared with the node's other groups (`rank.share_weights`)
    shared_weights: SharedWeights | None = None
    tracer: Tracer | None = None

    @property
    def size(self) -> int:
        return self.shard.tp

    @property
    def rank(self) -> int:
        return self.shard.rank

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial outputs of a row-parallel matmul, in place."""
        if self.size == 1:  # data parallelism alone: nothing to sum
            return x
        if self.tracer is None or not self.tracer.enabled:
            dist.all_reduce(x, group=self.group)
            return x
        if x.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dist.all_reduce(x, group=self.group)
            end.record()
        else:
            start = time.perf_counter()
            dist.all_reduce(x, group=self.group)
            end = time.perf_counter()
        self.tracer.host_span("allreduce", f"all-reduce {tuple(x.shape)}", start, end, x.nbytes)
        return x

    def embed(self, token_ids: torch.Tensor, table: torch.Tensor | QTensor) -> torch.Tensor:
        """Vocab-parallel lookup: rows outside this rank's slice are zero here and come
        from their owner in the all-reduce (a gathered table's rows reduce on device)."""
        local = token_ids.to(self.device) - self.shard.vocab.start
        outside = (local < 0) | (local >= table.shape[0])
        x = embedding(local.masked_fill(outside, 0), table, self.device)
        x.masked_fill_(outside[..., None], 0)
        return self.reduce(x)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's vocabulary slice of logits [..., V_rank] -> the full [..., V],
        identical on every rank (so every rank samples the same tokens)."""
        sizes = self.shard.vocab_sizes
        if len(sizes) == 1:
            return logits
        widest = max(sizes)
        if logits.shape[-1] < widest:  # all_gather wants equal pieces
            logits = torch.nn.functional.pad(logits, (0, widest - logits.shape[-1]))
        pieces = [torch.empty_like(logits) for _ in sizes]
        dist.all_gather(pieces, logits.contiguous(), group=self.group)
        return torch.cat([p[..., :n] for p, n in zip(pieces, sizes, strict=True)], dim=-1)


def allreduce_bus_gbps(
    group: dist.ProcessGroup | None, device: torch.device, nbytes: int = 64 << 20, repeats: int = 5
) -> float:
    """Measured all-reduce bus bandwidth over `group` (GB/s, as nccl-tests reports it:
    2 (n - 1) / n of the buffer crosses each link per all-reduce)."""
    size = dist.get_world_size(group)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    buffer = torch.ones(nbytes // dtype.itemsize, dtype=dtype, device=device)
    dist.all_reduce(buffer, group=group)  # warm-up: connections, buffers
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(buffer, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - started) / repeats
    return 2 * (size - 1) / size * nbytes / seconds / 1e9
