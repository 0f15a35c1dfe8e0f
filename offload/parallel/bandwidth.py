"""The node's shared figures, measured for the cost model (`offload-profile`): the
all-reduce between its GPUs, the wait for the slowest rank at it, and the GPUs' H2D
rate when all of them copy at once.

Tensor parallelism all-reduces a layer's [rows, hidden] activations twice a layer and
micro-batch (`cost_parallel.allreduce_s`). Its time is a latency plus the bytes over the bus
bandwidth; both are measured here with the collective the ranks run (NCCL on CUDA,
gloo on the CPU), in ranks started through the same elastic launcher as offload-run's.
Bus bandwidth follows NCCL's convention: a ring all-reduce moves 2 (n - 1) / n of the
buffer through each link.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from offload.parallel.affinity import pin_rank
from offload.parallel.launch import local_config

SMALL_BYTES = 4096  # latency-bound
LARGE_BYTES = 64 * 2**20  # bandwidth-bound (a few thousand tokens of a wide model)


def _timed_allreduce(buf: torch.Tensor, repeat: int) -> float:
    dist.all_reduce(buf)  # warm-up: the communicator's setup
    if buf.is_cuda:
        torch.cuda.synchronize(buf.device)
    began = time.perf_counter()
    for _ in range(repeat):
        dist.all_reduce(buf)
    if buf.is_cuda:
        torch.cuda.synchronize(buf.device)
    return (time.perf_counter() - began) / repeat


def _host_work_waits(device: torch.device, repeat: int = 20) -> tuple[float, float]:
    """(host work s, wait s) a round: the same CPU work on every rank (a DRAM read by the
    rank's threads, as its CPU attention reads KV), then an all-reduce; a rank waits
    there for the slowest (`HardwareProfile.rank_skew`)."""
    work = torch.ones(16 << 20)  # 64 MB of fp32
    flag = torch.zeros(1, device=device)
    dist.all_reduce(flag)
    busy = waited = 0.0
    for _ in range(repeat):
        began = time.perf_counter()
        work.sum()
        done = time.perf_counter()
        dist.all_reduce(flag)
        if flag.is_cuda:
            torch.cuda.synchronize(device)
        busy, waited = busy + done - began, waited + time.perf_counter() - done
    return busy / repeat, waited / repeat


def _h2d_all_gbps(device: torch.device, nbytes: int, repeat: int = 5) -> float:
    """Pinned host -> this rank's GPU while every rank copies to its own at once."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    gpu.copy_(host)
    torch.cuda.synchronize(device)
    dist.barrier()
    began = time.perf_counter()
    for _ in range(repeat):
        gpu.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return repeat * nbytes / (time.perf_counter() - began) / 1e9


def _worker(large_bytes: int) -> tuple[float, ...]:
    """One rank, on its share of the cores as offload-run's ranks are: (small all-reduce
    s, large all-reduce s, host work s, wait s, all-at-once H2D GB/s or 0)."""
    local, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    pin_rank(local, local_world, device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://")
    try:
        small = torch.zeros(SMALL_BYTES // 2, dtype=torch.float16, device=device)
        large = torch.zeros(large_bytes // 2, dtype=torch.float16, device=device)
        timed = _timed_allreduce(small, 20), _timed_allreduce(large, 5)
        copied = _h2d_all_gbps(device, 4 * large_bytes) if cuda else 0.0
        return (*timed, *_host_work_waits(device), copied)
    finally:
        dist.destroy_process_group()


def measure_node(ranks: int, large_bytes: int = LARGE_BYTES) -> dict[str, float]:
    """The figures of a node's ranks together, for `HardwareProfile`: the all-reduce's
    bus GB/s and latency, the ranks' skew at it, and each GPU's H2D rate while all copy
    at once (0 without a GPU a rank). One rank a GPU where there are that many GPUs,
    else over gloo on the CPU."""
    from torch.distributed.launcher.api import elastic_launch

    # spawned, never forked: a caller that has started threads (an executor's readers,
    # a pytest run's earlier tests) can leave a lock held in a forked child, which then
    # hangs in its first collective
    config = local_config(ranks, fork=False, name="offload-allreduce")
    results = list(elastic_launch(config, entrypoint=_worker)(large_bytes).values())
    latency, large = results[0][0], results[0][1]
    moved = 2 * (ranks - 1) / ranks * large_bytes
    busy = sum(r[2] for r in results) / ranks
    waited = sum(r[3] for r in results) / ranks
    return {
        "allreduce_gbps": moved / max(large - latency, 1e-9) / 1e9,
        "allreduce_latency_s": latency,
        "rank_skew": max(0.0, waited - latency) / max(busy, 1e-9),
        "h2d_all_gbps": min(r[4] for r in results),
    }


def measure_allreduce(ranks: int, large_bytes: int = LARGE_BYTES) -> tuple[float, float]:
    """(bus GB/s, latency s) of an all-reduce among `ranks` processes (`measure_node`)."""
    node = measure_node(ranks, large_bytes)
    return node["allreduce_gbps"], node["allreduce_latency_s"]
