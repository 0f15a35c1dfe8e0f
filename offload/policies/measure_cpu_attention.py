"""The profile's CPU attention figures: the executor's CPU attention timed at decode
shapes, warm, with the weight stream's copies beside it, at one query head a KV head
and at grouped-query shapes; and the copies' rate under it."""

from __future__ import annotations

import functools
import itertools
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from offload.io.pinned import PinnedPool, align_up
from offload.kernels.formats import Compression
from offload.kernels.kv_attention_cpu import decode_attention_cpu
from offload.kernels.kv_cache import QuantKV, kv_buffer_bytes
from offload.models.attention import attend
from offload.policies.hardware import GB
from offload.policies.timers import fit_call

log = logging.getLogger(__name__)
_CPU = torch.device("cpu")

# query heads a KV head at which the CPU attention is timed beside the MHA shape
# (`HardwareProfile.cpu_attention_grouped_gbps`): Mistral's and Llama-3's 4, Llama-2-70B's 8
CPU_ATTENTION_GROUPS = (4, 8)
# (sequence, KV head) pairs of each timed call, and the two context lengths from which
# a rate and a time a pair are fitted (`HardwareProfile.cpu_attention_pair_s`)
CPU_ATTENTION_PAIRS = 512
CPU_ATTENTION_SLOTS = (256, 1024)
# bytes of caches that the calls of one shape take in turn, so no call finds its cache in
# the CPU's last-level cache, as the executor's CPU homes never are (a step reads each
# once): the short shape's cache is 67 MB at fp16 (18 MB int4), within the L3 of a
# large server CPU, where the long one's 268 MB is not
CPU_ATTENTION_SWEEP_BYTES = 256 * 2**20
# the most of the long call's time a fitted time a pair may explain: beyond it the two
# calls' noise made the fit, not a cost (3.0 and 3.3 ms would fit 670 GB/s and 5.7 us a
# pair), and the long call's own rate stands. Llama-3.1-8B's executor shapes fitted 43%
# (H100: 140 GB/s and 2.8 us a pair)
CPU_PAIR_MAX_SHARE = 2 / 3


def cpu_attention_call(
    dtype: torch.dtype,
    compressed: bool,
    group: int = 1,
    home: torch.Tensor | None = None,
    slots: int = 1024,
) -> tuple[Callable[[], object], int]:
    """The executor's CPU attention (`decoder.attend`: the C kernel, else torch SDPA) at a
    decode shape, warmed up, and the K/V bytes a call reads at the dtype's size;
    `compressed`: its attention over an int4-g64 cache (`kv_attention_cpu.decode_attention_cpu`).
    group: query heads a KV head. Every group reads the same bytes over the same number
    of (sequence, KV head) work items: 16 sequences x 32 KV heads, or 64 x 8 grouped.
    home: pool memory (uint8) for the cache, as the executor's CPU homes are held
    (pinned where CUDA exists): it holds as many copies of the cache as fit, and the
    calls take them in turn (`CPU_ATTENTION_SWEEP_BYTES`)."""
    kv_heads = 32 if group == 1 else 8
    rows, dim = CPU_ATTENTION_PAIRS // kv_heads, 128
    k = torch.randn(rows, kv_heads, slots, dim).to(dtype)
    v = torch.randn_like(k)
    nbytes = 2 * k.numel() * k.element_size()
    q = torch.randn(rows, kv_heads * group, 1, dim).to(dtype)
    bias = torch.zeros(rows, 1, 1, slots, dtype=dtype)
    config = Compression(4, 64)
    size = kv_buffer_bytes(rows, kv_heads, dim, slots, dtype, config) if compressed else nbytes
    stride = align_up(size)
    copies = 1 if home is None else max(1, home.numel() // stride)
    memory = [None if home is None else home[i * stride : i * stride + size] for i in range(copies)]
    if compressed:
        caches = [QuantKV(rows, kv_heads, dim, slots, config, dtype, _CPU, m) for m in memory]
        caches[0].write(k, v, 0)
        calls = [functools.partial(decode_attention_cpu, q, c, bias, slots) for c in caches]
    elif home is None:
        calls = [functools.partial(attend, q, k, v, bias)]
    else:
        first = memory[0].view(dtype).view(2, *k.shape)
        first[0].copy_(k)
        first[1].copy_(v)
        kv = [m.view(dtype).view(2, *k.shape) for m in memory]
        calls = [functools.partial(attend, q, pair[0], pair[1], bias) for pair in kv]
    for m in memory[1:]:  # the same cache in every copy
        m.copy_(memory[0])
    turns = itertools.cycle(calls)

    def attention() -> object:
        return next(turns)()

    attention()  # warm up
    return attention, nbytes


# The CPU attention is timed over CPU_TIMED_S of calls after CPU_WARM_S of calls back
# to back. On an H100 machine's 16-core VM the first calls after the host idles run
# 7-12x slow and the rate ramps up over about 0.1 s (8.7, 27.2, then 107 GB/s a round
# of 3 calls after a 1 s sleep; a quick profile's figure 11.7 GB/s, 85.3 measured again
# in the same process). A profile that holds the cold figure (19.7) makes the search
# pick GPU attention for OPT-30B fp16, 42.0 tok/s, where the CPU-attention plan runs
# at 61.6 on the same machine (docs/cost_model.md).
# A shape's two lengths are timed in turn, CPU_ROUNDS rounds of CPU_TIMED_S / CPU_ROUNDS
# each, and the median taken: the fit is a difference of the two, and a drift of the
# host's speed between them would be read as a cost
CPU_WARM_S = 0.3
CPU_TIMED_S = 0.2
CPU_ROUNDS = 3


def _run_for(call: Callable[[], object], seconds: float) -> tuple[int, float]:
    """call() back to back until `seconds` have passed: the calls and the time taken."""
    calls, started = 0, time.perf_counter()
    while True:
        call()
        calls += 1
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            return calls, elapsed


def _cpu_attention_seconds(
    calls: list[tuple[Callable[[], object], int]],
    host: torch.Tensor | None = None,
    gpu=None,
    h2d_gbps: float = 0.0,
) -> list[float]:
    """Seconds a call of each of `calls` (`cpu_attention_call`'s), warm (`CPU_WARM_S`), as
    a policy's steps keep it: the calls timed in turn over CPU_ROUNDS rounds, the
    median of each.

    Given a pinned `host` buffer, a `gpu` one and their measured copy rate, host -> GPU
    copies run all the while,
    as the executor's weight stream does during its CPU attention: both read DRAM, and
    the contended rate is the one the executor gets (OPT-30B on the H100 machine: 67
    GB/s alone, 47-50 inside the executor)."""
    for attention, _ in calls:
        _run_for(attention, CPU_WARM_S / len(calls))
    if host is not None:
        # queue enough copies to outlast the timing; no host thread waits on them (a
        # spinning waiter would take a core from SDPA's threads, which the executor's
        # copies never do)
        side = torch.cuda.Stream()
        overrun = CPU_ROUNDS * sum(nbytes for _, nbytes in calls) / (20 * GB)  # a call a turn
        expected = 1.5 * (len(calls) * CPU_TIMED_S + overrun)  # >= the timed calls
        with torch.cuda.stream(side):
            for _ in range(int(expected * h2d_gbps * GB / host.numel()) + 2):
                gpu.copy_(host, non_blocking=True)
    # the CPU attention never touches the device: timed directly
    seconds: list[list[float]] = [[] for _ in calls]
    for _ in range(CPU_ROUNDS):
        for (attention, _), times in zip(calls, seconds, strict=True):
            count, elapsed = _run_for(attention, CPU_TIMED_S / CPU_ROUNDS)
            times.append(elapsed / count)
    if host is not None:
        side.synchronize()
    return [statistics.median(times) for times in seconds]


@dataclass(frozen=True)
class CpuAttentionRates:
    """The CPU attention's figures per group (query heads a KV head, "1" and each of
    CPU_ATTENTION_GROUPS): GB/s of K/V at the dtype's size and seconds a (sequence, KV
    head) beyond them, over a full-precision and over a compressed cache."""

    gbps: dict[str, float]
    pair_s: dict[str, float]
    quant_gbps: dict[str, float]
    quant_pair_s: dict[str, float]


def fit_cpu_attention(short: tuple[float, float], long: tuple[float, float]) -> tuple[float, float]:
    """(GB/s, seconds a call beyond its bytes) from the (bytes, seconds) of a shape's two
    lengths (`fit_call`); where the fitted fixed time is more than CPU_PAIR_MAX_SHARE of
    the long call's, the long call's rate and none."""
    rate, fixed = fit_call(short, long)
    if fixed > CPU_PAIR_MAX_SHARE * long[1]:
        log.warning(
            "CPU attention: %.2f and %.2f ms for 4x the bytes fit %.0f GB/s and %.2f ms a "
            "call, implausible; taking the long call's rate",
            short[1] * 1e3, long[1] * 1e3, rate, fixed * 1e3,
        )  # fmt: skip
        return long[0] / long[1] / GB, 0.0
    return rate, fixed


def cpu_attention_rates(
    dtype: torch.dtype, host: torch.Tensor | None = None, gpu=None, h2d_gbps: float = 0.0
) -> CpuAttentionRates:
    """The CPU attention timed at each group over CPU_ATTENTION_SLOTS' two context
    lengths (the same pairs, 4x the bytes), in turn, with copies beside where `host` is
    given (`_cpu_attention_seconds`); a rate and a time a pair fitted from the two
    (`fit_cpu_attention`). Each length's caches fill half of one pool."""
    figures: dict[bool, tuple[dict[str, float], dict[str, float]]] = {}
    elt = dtype.itemsize
    half = 2 * CPU_ATTENTION_PAIRS * max(CPU_ATTENTION_SLOTS) * 128 * elt
    half = align_up(max(half, CPU_ATTENTION_SWEEP_BYTES))
    with PinnedPool(2 * half) as pool:  # registered once, each call's caches in it
        for compressed in (False, True):
            gbps, pair_s = {}, {}
            for group in (1, *CPU_ATTENTION_GROUPS):
                calls = [
                    cpu_attention_call(dtype, compressed, group, pool.buffer[i * half :][:half], n)
                    for i, n in enumerate(CPU_ATTENTION_SLOTS)
                ]
                seconds = _cpu_attention_seconds(calls, host, gpu, h2d_gbps)
                points = [(nbytes, s) for (_, nbytes), s in zip(calls, seconds, strict=True)]
                gbps[str(group)], fixed = fit_cpu_attention(*points)
                pair_s[str(group)] = fixed / CPU_ATTENTION_PAIRS
                del calls
            figures[compressed] = gbps, pair_s
    return CpuAttentionRates(*figures[False], *figures[True])


def h2d_rate_under_cpu_attention(
    attention: Callable[[], object], host: torch.Tensor, gpu: torch.Tensor, h2d_gbps: float
) -> float:
    """GB/s of pinned host -> GPU copies while the CPU attention (`cpu_attention_call`'s)
    runs beside them without pause, as a CPU-attention policy's weight stream does: both
    read DRAM. W1u's layer (0.93 GB of weights beside 1.3 GB of KV) copied at 48-50 GB/s
    where the copy alone ran at 53 (H100 machine; docs/cost_model.md)."""
    _run_for(attention, CPU_WARM_S)
    copies = max(2, int(0.2 * h2d_gbps * GB / host.numel()))  # about 0.2 s of copies
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        first.record()
        for _ in range(copies):
            gpu.copy_(host, non_blocking=True)
        last.record()
    while not last.query():  # the attention outlasts the copies
        attention()
    return copies * host.numel() / (first.elapsed_time(last) / 1e3) / GB
