"""The all-reduce between this node's GPUs, measured for the cost model (`offload-profile`).

Tensor parallelism all-reduces a layer's [rows, hidden] activations twice a layer and
micro-batch (`cost._allreduce_s`). Its time is a latency plus the bytes over the bus
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


def _worker(large_bytes: int) -> tuple[float, float]:
    """One rank: (small all-reduce s, large all-reduce s)."""
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= int(
        os.environ["LOCAL_WORLD_SIZE"]
    )
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://")
    try:
        small = torch.zeros(SMALL_BYTES // 2, dtype=torch.float16, device=device)
        large = torch.zeros(large_bytes // 2, dtype=torch.float16, device=device)
        return _timed_allreduce(small, 20), _timed_allreduce(large, 5)
    finally:
        dist.destroy_process_group()


def measure_allreduce(ranks: int, large_bytes: int = LARGE_BYTES) -> tuple[float, float]:
    """(bus GB/s, latency s) of an all-reduce among `ranks` processes, one per GPU where
    there are that many GPUs, else over gloo on the CPU."""
    from torch.distributed.launcher.api import elastic_launch

    # spawned, never forked: a caller that has started threads (an executor's readers,
    # a pytest run's earlier tests) can leave a lock held in a forked child, which then
    # hangs in its first collective
    config = local_config(ranks, fork=False, name="offload-allreduce")
    results = elastic_launch(config, entrypoint=_worker)(large_bytes)
    small, large = results[0]
    latency = small
    moved = 2 * (ranks - 1) / ranks * large_bytes
    return moved / max(large - latency, 1e-9) / 1e9, latency
