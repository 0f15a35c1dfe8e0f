"""Measurements of this machine's rates for `HardwareProfile` (`offload-profile`).

Each figure is measured the way the executor uses it: pinned copies (one way and both
ways at once), O_DIRECT disk reads and writes, the CPU attention with copies running,
and, per storage format (`hardware.format_name`), the matmul at decode and prefill
shapes and decode attention on the GPU through the kernels the executor runs. The
executor's own fixed costs are measured above this layer (`executor.probe`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F

from offload.io.direct import open_direct
from offload.io.pinned import PinnedPool, align_up
from offload.io.spill import SWITCH_INTERVAL_S, SpillFile
from offload.kernels.formats import Compression
from offload.kernels.kv_attention import decode_attention
from offload.kernels.kv_attention_cpu import decode_attention_cpu
from offload.kernels.kv_cache import QuantKV, kv_buffer_bytes
from offload.kernels.qmatmul import qlinear
from offload.kernels.quant import quantize
from offload.models.attention import attend
from offload.policies.hardware import (
    DECODE_ROWS,
    GB,
    MID_DECODE_ROWS,
    WIDE_DECODE_ROWS,
    HardwareProfile,
    code_version,
    format_name,
)
from offload.policies.measure_experts import expert_figures
from offload.policies.memory_limit import node_memory_limit

log = logging.getLogger(__name__)
_CPU = torch.device("cpu")

# the formats whose matmul and attention rates a profile holds
FORMATS = (None, Compression(8, 64, False), Compression(4, 64, False))


def _timed(fn, repeat: int = 5) -> float:
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
    varied 2-3x between two runs (H100 probes this session); with the host figure the
    profile predicted W1c's decode step 33% slow (21.9 ms against 16.5, run 235824).
    On the CPU: `_timed`."""
    if not torch.cuda.is_available():
        return _timed(fn, repeat)
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
    return src.numel() * src.element_size() / _timed(lambda: dst.copy_(src, non_blocking=True)) / GB


def disk_rates(directory: Path, nbytes: int) -> tuple[float, float]:
    """O_DIRECT write and read of one file in `directory` (GB/s)."""
    import mmap

    directory.mkdir(parents=True, exist_ok=True)
    buf = mmap.mmap(-1, 16 * 2**20)
    buf.write(os.urandom(len(buf)))
    fd, name = tempfile.mkstemp(dir=directory, prefix="offload-profile-")
    os.close(fd)
    try:
        fd, _ = open_direct(name, os.O_WRONLY)
        started = time.perf_counter()
        for off in range(0, nbytes, len(buf)):
            os.pwritev(fd, [buf], off)
        os.fsync(fd)
        write = nbytes / (time.perf_counter() - started) / GB
        os.close(fd)
        fd, _ = open_direct(name, os.O_RDONLY)
        started = time.perf_counter()
        for off in range(0, nbytes, len(buf)):
            os.preadv(fd, [buf], off)
        read = nbytes / (time.perf_counter() - started) / GB
        os.close(fd)
    finally:
        os.unlink(name)
    return read, write


def _spin(spinning: threading.Event) -> None:
    count = 0
    while spinning.is_set():
        count += 1


@contextlib.contextmanager
def beside_busy_host() -> Iterator[None]:
    """While the body runs, a Python thread holds the GIL as the executor's launching
    host thread does, at the executor's switch interval."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    spinning = threading.Event()
    spinning.set()
    thread = threading.Thread(target=_spin, args=(spinning,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        spinning.clear()
        thread.join()
        sys.setswitchinterval(previous)


def kv_disk_read_rate(directory: Path, homes: int = 8) -> float:
    """GB/s of disk KV home reads as the executor does them: `SpillFile.transfer` of one
    whole home after another, beside a busy host thread (`beside_busy_host`). The slope
    between 4 MiB and 32 MiB homes: a read's fixed part belongs to the profile's
    `disk_kv_s`, measured on the executor's own chain."""
    small, large = 4 * 2**20, 32 * 2**20
    with PinnedPool(large) as pool, SpillFile(directory, large * homes) as spill:
        buf = pool.alloc(large).tensor
        spill.transfer([(i * large, buf) for i in range(homes)], write=True)
        points = []
        with beside_busy_host():
            for size in (small, large):
                started = time.perf_counter()
                for i in range(homes):
                    spill.transfer([(i * large, buf[:size])], write=False)
                points.append((size * homes, time.perf_counter() - started))
    return fit_call(*points)[0]


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
# (H100 c103: 140 GB/s and 2.8 us a pair)
CPU_PAIR_MAX_SHARE = 2 / 3


def _cpu_attention_call(
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
# to back. On the lent H100 machine's 16-core VM the first calls after the host idled
# ran 7-12x slow and the rate ramped up over about 0.1 s (call c96: 8.7, 27.2, then 107
# GB/s a round of 3 calls after a 1 s sleep; a quick profile's figure 11.7 GB/s, 85.3
# measured again in the same process). A profile that held the cold figure (19.7)
# made the search pick GPU attention for OPT-30B fp16, 42.0 tok/s (bench_throughput
# 20261125-163936), where the CPU-attention plan measured 61.6 on the same machine start.
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
    """Seconds a call of each of `calls` (`_cpu_attention_call`'s), warm (`CPU_WARM_S`), as
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


def _cpu_attention_rates(
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
                    _cpu_attention_call(dtype, compressed, group, pool.buffer[i * half :][:half], n)
                    for i, n in enumerate(CPU_ATTENTION_SLOTS)
                ]
                seconds = _cpu_attention_seconds(calls, host, gpu, h2d_gbps)
                points = [(nbytes, s) for (_, nbytes), s in zip(calls, seconds, strict=True)]
                gbps[str(group)], fixed = fit_cpu_attention(*points)
                pair_s[str(group)] = fixed / CPU_ATTENTION_PAIRS
                del calls
            figures[compressed] = gbps, pair_s
    return CpuAttentionRates(*figures[False], *figures[True])


def _h2d_rate_under_cpu_attention(
    attention: Callable[[], object], host: torch.Tensor, gpu: torch.Tensor, h2d_gbps: float
) -> float:
    """GB/s of pinned host -> GPU copies while the CPU attention (`_cpu_attention_call`'s)
    runs beside them without pause, as a CPU-attention policy's weight stream does: both
    read DRAM. W1u's layer (0.93 GB of weights beside 1.3 GB of KV) copied at 48-50 GB/s
    where the copy alone ran at 53 (H100 machine, 2026-11-25)."""
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


def _matmul_tflops(m: int, k: int, n: int, device: torch.device, dtype: torch.dtype) -> float:
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    return 2 * m * k * n / _timed(lambda: a @ b, repeat=3) / 1e12


# the rows at which a compressed format's fused prefill kernel is measured: a micro-
# batch of a few short prompts (fewer than qmatmul.DENSE_ROWS tokens) runs it
FUSED_PREFILL_ROWS = 512


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


@dataclass(frozen=True)
class MatmulRates:
    """Per format (`hardware.format_name`), the profile's matmul figures."""

    decode_gbps: dict[str, float]  # stored bytes a second, DECODE_ROWS rows
    wide_gbps: dict[str, float]  # the same at WIDE_DECODE_ROWS
    mid_gbps: dict[str, float]  # and at MID_DECODE_ROWS
    call_s: dict[str, float]  # a decode call's fixed time
    prefill_tflops: dict[str, float]
    dequant_gbps: dict[str, float]


# (N, K) of the four matmuls of two layers that a profile times at decode rows: a
# 4096-wide (Llama-3.1-8B's: qkv, out, gate and up, down) and an 8192-wide one (a
# 70B-class model's), so the fitted rate and call time are those of whole layers,
# which is what the cost model charges a layer (one 8192 x 28672 matrix stood for
# every layer before). The fused kernel's rate depends on a matrix's shape, not only
# its bytes: at 16 rows on the H100, OPT-30B's qkv (21504 x 7168) read 55% of HBM and
# Llama-2-70B's gate and up (57344 x 8192) 74% (docs/throughput.md). OPT-30B's layer
# is slower than both of these (about 1.7 TB/s in W1c's job against 2.31 fitted, call
# c65): a rate by matrix shape is not modeled
LAYER_MATRICES = {
    "cuda": (
        ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)),
        ((10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)),
    ),
    "cpu": (
        ((384, 256), (256, 256), (1024, 256), (256, 512)),
        ((768, 512), (512, 512), (2048, 512), (512, 1024)),
    ),
}


def _layer_matrices(
    shapes: tuple[tuple[int, int], ...], config, device: torch.device, dtype: torch.dtype
) -> list:
    """A layer's matrices (N x K), stored in `config`'s format (None: dense)."""
    out = []
    for n, k in shapes:
        w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
        out.append(w if config is None else quantize(w, config))
        del w
    return out


def _layer_seconds(matrices: list, rows: int, device: torch.device, dtype: torch.dtype) -> float:
    """The kernel time of a layer's matmuls at `rows` rows, one after another."""
    call = F.linear if isinstance(matrices[0], torch.Tensor) else qlinear
    inputs = [torch.randn(rows, w.shape[1], device=device, dtype=dtype) for w in matrices]

    def layer() -> None:
        for x, w in zip(inputs, matrices, strict=True):
            call(x, w)

    return kernel_seconds(layer)


def _matmul_rates(k: int, n: int, device: torch.device, dtype: torch.dtype) -> MatmulRates:
    """Per format: the stored weight bytes a layer's decode matmuls read a second at
    DECODE_ROWS, MID_DECODE_ROWS and WIDE_DECODE_ROWS rows beyond each call's fixed
    time, fitted from LAYER_MATRICES' two layers (`fit_call` at DECODE_ROWS; the wide
    layer beyond that fixed time at the others); on one [n, k] matrix, TFLOP/s at
    prefill rows (dense: cuBLAS at 4096 rows; compressed: the fused kernel at
    FUSED_PREFILL_ROWS) and, compressed, the stored bytes a second the 4096-row matmul
    dequantizes (its time beyond cuBLAS's on the dense weight)."""
    w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
    prefill_rows = 4096 if device.type == "cuda" else 256
    prefill_x = torch.randn(prefill_rows, k, device=device, dtype=dtype)
    fused_x = prefill_x[: min(FUSED_PREFILL_ROWS, prefill_rows // 2)]
    rates = MatmulRates({}, {}, {}, {}, {}, {})
    dense_s = _timed(lambda: F.linear(prefill_x, w), repeat=3)
    narrow_shapes, wide_shapes = LAYER_MATRICES[device.type]
    calls = len(narrow_shapes)
    for config in FORMATS:
        name = format_name(config)
        layers = []
        for shapes in (narrow_shapes, wide_shapes):
            matrices = _layer_matrices(shapes, config, device, dtype)
            nbytes = sum(m.nbytes for m in matrices)  # (dense or `QTensor`: as stored)
            layers.append((matrices, nbytes, _layer_seconds(matrices, DECODE_ROWS, device, dtype)))
        (_, narrow_bytes, narrow_s), (wide, wide_bytes, wide_s) = layers
        rate, fixed = fit_call((narrow_bytes, narrow_s), (wide_bytes, wide_s))
        rates.decode_gbps[name], rates.call_s[name] = rate, fixed / calls
        for figure, rows in (
            (rates.wide_gbps, WIDE_DECODE_ROWS),
            (rates.mid_gbps, MID_DECODE_ROWS),
        ):
            seconds = _layer_seconds(wide, rows, device, dtype)
            figure[name] = wide_bytes / max(seconds - fixed, 0.5 * seconds) / GB
        del layers, wide
        if config is None:
            rates.prefill_tflops[name] = 2 * prefill_rows * k * n / dense_s / 1e12
            continue
        stored = quantize(w, config)
        seconds = _timed(lambda s=stored: qlinear(fused_x, s), repeat=3)
        rates.prefill_tflops[name] = 2 * fused_x.shape[0] * k * n / seconds / 1e12
        # noise can make the difference tiny: at least 2% of the matmul
        extra = _timed(lambda s=stored: qlinear(prefill_x, s), repeat=3) - dense_s
        rates.dequant_gbps[name] = stored.nbytes / max(extra, 0.02 * dense_s) / GB
        del stored
    return rates


def _prefill_attention_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """TFLOP/s (4 x rows x T x S x heads x dim) of the executor's masked prefill
    attention at a 512-token prompt."""
    rows, heads, t, dim = (4, 32, 512, 128) if device.type == "cuda" else (1, 4, 128, 64)
    q, k, v = (torch.randn(rows, heads, t, dim, device=device, dtype=dtype) for _ in range(3))
    bias = torch.zeros(rows, 1, t, t, device=device, dtype=dtype)
    bias.masked_fill_(torch.ones(t, t, device=device, dtype=torch.bool).triu(1), float("-inf"))
    return 4 * rows * t * t * heads * dim / _timed(lambda: attend(q, k, v, bias)) / 1e12


# (rows, slots) of the three decode attention calls a profile fits its GPU attention
# figures to (`fit_attention`), 32 heads of 128 channels each: few and many sequences at
# a short context, many at a long one. The slots hold a tail (an incomplete group of a
# compressed cache's, as a decode step's context almost always does)
ATTENTION_POINTS = ((4, 544), (32, 544), (32, 2080))


def fit_attention(
    points: list[tuple[int, float, float]],
) -> tuple[float, float, float]:
    """(GB/s, fixed seconds a call, seconds a (sequence, KV head) pair) of decode
    attention calls taking fixed + pairs x pair + bytes / rate, from the (pairs, bytes,
    seconds) of ATTENTION_POINTS' calls: the rate from the two with many pairs (the
    same pairs, more bytes), the pair's time from the two at the short context (the
    time beyond their bytes, by pairs), the fixed time from the small call. A term
    that comes out negative (noise, or none to see) is 0, and the rate is then the
    long call's alone."""
    (p_small, b_small, t_small), (p_short, b_short, t_short), (_, b_long, t_long) = points
    if t_long <= t_short:
        return b_long / t_long / GB, 0.0, 0.0
    per_byte = (t_long - t_short) / (b_long - b_short)
    pair = max(0.0, (t_short - t_small - per_byte * (b_short - b_small)) / (p_short - p_small))
    fixed = max(0.0, t_small - pair * p_small - per_byte * b_small)
    return 1 / per_byte / GB, fixed, pair


def _gpu_attention_rates(
    device: torch.device, dtype: torch.dtype
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """Per format: the cache bytes (as stored) decode attention on the GPU reads a
    second, a call's fixed time and a (sequence, KV head) pair's (`fit_attention`)."""
    heads, dim = 32, 128
    rates, call_s, pair_s = {}, {}, {}
    for config in FORMATS:
        points = []
        for rows, slots in ATTENTION_POINTS:
            q = torch.randn(rows, heads, 1, dim, device=device, dtype=dtype)
            k = torch.randn(rows, heads, slots, dim, device=device, dtype=dtype)
            v = torch.randn_like(k)
            bias = torch.zeros(rows, 1, 1, slots, device=device, dtype=dtype)
            if config is None:
                nbytes = 2 * k.numel() * k.element_size()
                seconds = kernel_seconds(functools.partial(attend, q, k, v, bias))
            else:
                cache = QuantKV(rows, heads, dim, slots, config, dtype, device)
                cache.write(k, v, 0)
                nbytes = cache.nbytes
                seconds = kernel_seconds(functools.partial(decode_attention, q, cache, bias, slots))
            points.append((rows * heads, nbytes, seconds))
        name = format_name(config)
        rates[name], call_s[name], pair_s[name] = fit_attention(points)
    return rates, call_s, pair_s


def measure(nvme: Path | None, quick: bool = False) -> HardwareProfile:
    """Measure this machine. Without CUDA the compute device is the CPU: host copies
    stand in for PCIe and the CPU's matmul rate for the GPU's."""
    size = 2**26 if quick else 2**29
    disk_dir = nvme or Path(tempfile.gettempdir())
    disk_read, disk_write = disk_rates(disk_dir, min(size * 2, 2**30))
    disk_kv_read = kv_disk_read_rate(disk_dir)
    dram = copy_rate(torch.empty(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)) * 2
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        host2 = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        gpu = torch.empty(size, dtype=torch.uint8, device=dev)
        gpu2 = torch.empty(size, dtype=torch.uint8, device=dev)
        h2d, d2h = copy_rate(host, gpu), copy_rate(gpu, host)
        dense_attention = _cpu_attention_call(torch.float16, compressed=False)
        cpu_attention = _cpu_attention_rates(torch.float16, host, gpu, h2d)
        h2d_under_attention = _h2d_rate_under_cpu_attention(dense_attention[0], host, gpu, h2d)
        del dense_attention
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

        def both() -> None:
            with torch.cuda.stream(s1):
                gpu.copy_(host, non_blocking=True)
            with torch.cuda.stream(s2):
                host2.copy_(gpu2, non_blocking=True)

        bidir = 2 * size / _timed(both) / GB
        pageable = copy_rate(torch.empty(size, dtype=torch.uint8), gpu)
        hbm = 2 * copy_rate(gpu, gpu2)
        del host, host2, gpu, gpu2
        prefill = _matmul_tflops(4096, 8192, 8192, dev, torch.float16)
        decode = _matmul_tflops(64, 8192, 28672, dev, torch.float16)
        matmuls = _matmul_rates(8192, 28672, dev, torch.float16)
        attention, attention_call, attention_pair = _gpu_attention_rates(dev, torch.float16)
        prefill_attention = _prefill_attention_tflops(dev, torch.float16)
        gpu_mem, name = (
            torch.cuda.get_device_properties(dev).total_memory,
            torch.cuda.get_device_name(),
        )
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        context = total - free - torch.cuda.memory_reserved(dev)
    else:
        h2d = d2h = bidir = pageable = hbm = dram / 2
        cpu_attention = _cpu_attention_rates(torch.float32)
        h2d_under_attention = 0.0  # no copy lane beside the CPU's own attention
        prefill = decode = _matmul_tflops(1024, 2048, 2048, torch.device("cpu"), torch.float32)
        cpu = torch.device("cpu")
        matmuls = _matmul_rates(1024, 2048, cpu, torch.float32)
        prefill_attention = _prefill_attention_tflops(cpu, torch.float32)
        # no GPU: decode attention runs on the CPU (cpu_*attention_gbps)
        attention, attention_call, attention_pair = {}, {}, {}
        gpu_mem, name = psutil.virtual_memory().total, f"CPU only ({platform.processor() or 'cpu'})"
        context = 0
    grouped = [str(g) for g in CPU_ATTENTION_GROUPS]
    return HardwareProfile(
        device_name=name,
        has_gpu=torch.cuda.is_available(),
        gpu_mem_bytes=gpu_mem,
        cpu_mem_bytes=node_memory_limit()[0],  # the cgroup's limit where there is one
        h2d_gbps=h2d,
        d2h_gbps=d2h,
        bidir_gbps=bidir,
        pageable_h2d_gbps=pageable,
        disk_read_gbps=disk_read,
        disk_write_gbps=disk_write,
        disk_kv_read_gbps=disk_kv_read,
        prefill_tflops=prefill,
        decode_tflops=decode,
        hbm_gbps=hbm,
        cpu_attention_gbps=cpu_attention.gbps["1"],
        cpu_quant_attention_gbps=cpu_attention.quant_gbps["1"],
        cpu_attention_grouped_gbps={g: cpu_attention.gbps[str(g)] for g in grouped},
        cpu_quant_attention_grouped_gbps={g: cpu_attention.quant_gbps[str(g)] for g in grouped},
        cpu_attention_pair_s=cpu_attention.pair_s,
        cpu_quant_attention_pair_s=cpu_attention.quant_pair_s,
        dram_gbps=dram,
        h2d_under_cpu_attention_gbps=h2d_under_attention,
        gpu_context_bytes=int(context),
        process_base_bytes=psutil.Process().memory_info().rss,
        measured_at=time.strftime("%Y-%m-%d %H:%M:%S"),
        matmul_gbps=matmuls.decode_gbps,
        matmul_gbps_wide=matmuls.wide_gbps,
        matmul_gbps_mid=matmuls.mid_gbps,
        matmul_call_s=matmuls.call_s,
        prefill_format_tflops=matmuls.prefill_tflops,
        dequant_gbps=matmuls.dequant_gbps,
        prefill_attention_tflops=prefill_attention,
        gpu_attention_gbps=attention,
        attention_call_s=attention_call,
        attention_pair_s=attention_pair,
        **expert_figures(quick),
        code_version=code_version(),
    )
