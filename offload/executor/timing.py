"""Timing the executor on this machine: a synchronized wall time, a median decode step,
and a step's GPU kernels by name (`executor.probe` and `executor.fixed_costs` use them)."""

from __future__ import annotations

import itertools
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from offload.executor.executor import Executor
from offload.models.batch import PaddedBatch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synced_seconds(device: torch.device, fn) -> float:
    """Wall time of fn(), from an idle device to the end of its work."""
    sync(device)
    began = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - began


def decode_seconds(ex: Executor, batch: PaddedBatch, start: int, steps: int) -> float:
    """The median wall time of `steps` decode steps from slot `start` (after two that
    compile and capture graphs), each step synchronized: one slow step (a page fault, a
    clock change) would otherwise be multiplied by the layers a probe extrapolates to."""
    ids = torch.ones(batch.size, 1, dtype=torch.long)
    ex.forward(ids, ex.step_inputs(batch, start, 1))  # compiles, captures graphs
    ex.forward(ids, ex.step_inputs(batch, start + 1, 1))
    times = [
        synced_seconds(ex.device, lambda t=t: ex.forward(ids, ex.step_inputs(batch, start + t, 1)))
        for t in range(2, steps + 2)
    ]
    return statistics.median(times)


# kernels the cost model times itself, by name: the matmuls (ours and cuBLAS's) and the
# attention (ours and SDPA's); `profiled_kernels` separates them from the others
MODELED_KERNELS = ("_qmatmul_kernel", "gemm", "gemv", "nvjet", "cutlass", "xmma", "attention",
                   "flash", "fmha")  # fmt: skip
# a gap between two kernels of a step: the GPU waiting on a launch the host has already
# issued (a graph's, an eager kernel's: 1-3 us on the H100). Longer ones are the host
# behind the GPU (the host lane's) or the work between two steps (the loop's)
STEP_GAP_S = 20e-6


def profiled_kernels(device: torch.device, run) -> tuple[float, float, list[float]]:
    """One run() under the torch profiler (CUPTI sees the kernels of a graph's replay):
    the GPU seconds in kernels the cost model times itself (`MODELED_KERNELS`: the
    matmuls and the attention), in the others (norms, activations, residuals, the KV's
    write), and the gaps between kernels, each in seconds."""
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        sync(device)
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time > 0]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    modeled = other = 0.0
    for e in kernels:
        seconds = (e.time_range.end - e.time_range.start) / 1e6
        if any(name in e.name.lower() for name in MODELED_KERNELS):
            modeled += seconds
        else:
            other += seconds
    return modeled, other, [(b[0] - a[1]) / 1e6 for a, b in itertools.pairwise(spans)]


def decode_kernels(ex: Executor, batch: PaddedBatch, start: int, steps: int) -> tuple[float, float]:
    """A decode step's GPU time in kernels that the cost model does not time itself,
    and in gaps between kernels of STEP_GAP_S or less (`profiled_kernels`), after
    `decode_seconds`' warm-up."""
    ids = torch.ones(batch.size, 1, dtype=torch.long)

    def run() -> None:
        for t in range(steps):
            ex.forward(ids, ex.step_inputs(batch, start + t, 1))

    _, other, gaps = profiled_kernels(ex.device, run)
    waited = sum(gap for gap in gaps if 0 < gap <= STEP_GAP_S)
    return other / steps, waited / steps
