"""How the profile times things: a synchronized wall time, a kernel's GPU time from a
CUDA graph, a copy's rate, and a fixed-plus-rate fit of two calls."""

from __future__ import annotations

import time

import torch

from offload.io.pinned import PinnedPool
from offload.policies.hardware import GB


def timed(fn, repeat: int = 5) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeat


def kernel_seconds(fn, repeat: int = 10) -> float:
    """GPU seconds a call of fn (a kernel's rate): `repeat` calls captured in a CUDA graph
    and replayed, timed with CUDA events, as `scripts/bench_kernels.py` times kernels.
    Timed from the host, the int4 matmul at 16 rows read 125 us a call over 10 calls
    and 67 over 100 (its kernel: 67, from a graph), and CUDA events around eager calls
    varied 2-3x between two runs (H100); with the host figure the profile predicts W1c's
    decode step 33% slow (21.9 ms against 16.5; docs/cost_model.md).
    On the CPU: `timed`."""
    if not torch.cuda.is_available():
        return timed(fn, repeat)
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    graph.replay()  # (compiled and allocated during the first call and the capture)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeat


def copy_rate(src: torch.Tensor, dst: torch.Tensor) -> float:
    return src.numel() * src.element_size() / timed(lambda: dst.copy_(src, non_blocking=True)) / GB


def pin_rate(nbytes: int) -> float:
    """GB/s of host memory a `PinnedPool` maps and pins (registering fresh pages with
    CUDA faults them in). 0 without CUDA: the pool is plain memory there, whose pages
    the first copy into them faults in, which the placement's rate counts."""
    if not torch.cuda.is_available():
        return 0.0
    started = time.perf_counter()
    pool = PinnedPool(nbytes)
    seconds = time.perf_counter() - started
    pool.close()
    return nbytes / seconds / GB


def fit_call(small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
    """(GB/s, fixed seconds) of calls taking fixed + bytes / rate, from the (bytes,
    seconds) of a small and a large call. Where the small call is no slower a byte than
    the large one (no fixed cost to see, or noise), the large call's rate and no fixed
    cost."""
    (b_small, t_small), (b_large, t_large) = small, large
    slope = (t_large - t_small) / (b_large - b_small)
    fixed = t_small - b_small * slope
    if slope <= 0 or fixed <= 0:
        return b_large / t_large / GB, 0.0
    return 1 / slope / GB, fixed
