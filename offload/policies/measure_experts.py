"""A mixture of experts' figures for the hardware profile: the CPU's expert matmul rate
and its fixed cost (`kernels.cpu_expert`), and the executor's time an expert beyond its
matmuls' bytes (`executor.moe_layer`).

- cpu_expert_gbps: weight bytes a second that `cpu_expert_mlp` reads over 8 rows, per
  storage format (int4 and int8: the C kernel, `kernels.cpu_expert_native`), fitted
  with its fixed time from a 4096-wide expert (1024 without a GPU) and one a quarter
  its size (as `measure.fit_call` fits the GPU's matmuls); each call reads another
  copy of the expert, COPY_BYTES of copies, so the rate is DRAM's, not the cache's
  (a cold expert's weights are not in cache);
- cpu_expert_fixed_s: that fixed time, plus (with a GPU) the round trip an expert on the
  CPU adds: its rows to the host, the worker thread's hand-off, its output back;
- expert_fixed_s: an expert's `moe.apply_expert` on the compute device at a decode's
  few rows and small matrices (its gather, activation and weighted add, and the
  launches of them), with the views and events the fetcher makes for it.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from offload.kernels.cpu_expert import cpu_expert_mlp
from offload.kernels.formats import Compression
from offload.kernels.quant import QTensor, assemble_stage, compress_stage
from offload.models import moe
from offload.policies.hardware import GB, format_name

FORMATS = (None, Compression(8, 64, False), Compression(4, 64, False))
ROWS = 8  # a decode's rows an expert (a block of 256 sequences, 8 of 128 experts, 16)
COPY_BYTES = 1 << 29  # copies of an expert a rate cycles through (past the last-level cache)


def _seconds(fn, repeat: int, budget_s: float = 0.25) -> float:
    """Wall seconds a call of fn, after one call to warm it (synchronized on CUDA):
    over `repeat` calls, or as many as `budget_s` holds (at least one)."""
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started, calls = time.perf_counter(), 0
    while calls < repeat and (calls == 0 or time.perf_counter() - started < budget_s):
        fn()
        calls += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / calls


def _expert(hidden: int, inter: int, dtype: torch.dtype, compression, device) -> tuple:
    """An expert's (mlp_in, mlp_out) as stored in a format, on `device`."""
    shapes = {"mlp_in.weight": (2 * inter, hidden), "mlp_out.weight": (hidden, inter)}
    dense = {
        n: torch.randn(s, device=device).div_(s[1] ** 0.5).to(dtype) for n, s in shapes.items()
    }
    views = assemble_stage(compress_stage(dense, compression), shapes, dtype, compression)
    return views["mlp_in.weight"], views["mlp_out.weight"]


def _cpu_rates(
    dtype: torch.dtype, repeat: int, hidden: int, copy_bytes: int = COPY_BYTES
) -> tuple[dict[str, float], float]:
    """Per format the CPU expert's rate, and its fixed time (the formats' least), from
    an expert `hidden` wide and one a quarter its size."""
    rates, fixed = {}, []
    for compression in FORMATS:
        points = []
        for width in (hidden // 4, hidden):
            weights = _expert(width, width // 2, dtype, compression, torch.device("cpu"))
            nbytes = sum(_stored(w) for w in weights)
            more = range(copy_bytes // nbytes)
            copies = itertools.cycle([weights] + [_clone(weights) for _ in more])
            x = torch.randn(ROWS, width).to(dtype)
            call = lambda c=copies, x=x: cpu_expert_mlp(x, *next(c))  # noqa: E731
            points.append((nbytes, _seconds(call, repeat)))
        (b0, t0), (b1, t1) = points
        slope = (t1 - t0) / (b1 - b0)
        rate = b1 / t1 / GB if slope <= 0 else 1 / slope / GB
        rates[format_name(compression)] = rate
        fixed.append(max(0.0, t0 - b0 / (rate * GB)))
    return rates, min(fixed)


def _clone(weights: tuple) -> tuple:
    """Another copy of an expert's matrices (full precision or `QTensor`s)."""
    return tuple(
        dataclasses.replace(
            w, codes=w.codes.clone(), scale=w.scale.clone(),
            minimum=None if w.minimum is None else w.minimum.clone(),
        )
        if isinstance(w, QTensor) else w.clone()
        for w in weights
    )  # fmt: skip


def _stored(w) -> int:
    return w.nbytes if hasattr(w, "codes") else w.numel() * w.element_size()


def _round_trip_s(device: torch.device, dtype: torch.dtype, repeat: int) -> float:
    """An expert's rows to the host, a worker thread's hand-off and its output back."""
    rows = torch.randn(ROWS, 4096, device=device).to(dtype)
    worker = ThreadPoolExecutor(1)

    def trip() -> None:
        host = torch.empty(rows.shape, dtype=dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        back = worker.submit(lambda: (done.synchronize(), host.clone())[1]).result()
        back.to(device, non_blocking=True)

    try:
        return _seconds(trip, repeat)
    finally:
        worker.shutdown()


def _expert_fixed_s(device: torch.device, dtype: torch.dtype, repeat: int) -> float:
    """An expert's executor time over small matrices at a decode's rows (module doc)."""
    hidden, inter, tokens = 256, 64, 64
    h = torch.randn(tokens, hidden, device=device).to(dtype)
    out = torch.zeros_like(h)
    rows = torch.arange(0, tokens, tokens // ROWS, device=device)
    weights = torch.rand(rows.shape, device=device)
    shapes = {"mlp_in.weight": (2 * inter, hidden), "mlp_out.weight": (hidden, inter)}
    stored = {n: torch.randn(s, device=device).to(dtype) for n, s in shapes.items()}

    def one() -> None:
        views = assemble_stage(stored, shapes, dtype, None)
        moe.apply_expert(out, h, rows, weights, views["mlp_in.weight"], views["mlp_out.weight"])
        if device.type == "cuda":  # the fetcher's wait for the expert's copy and record
            torch.cuda.current_stream().wait_event(torch.cuda.Event())
            torch.cuda.Event().record()

    return _seconds(one, repeat)


def expert_figures(quick: bool = False) -> dict:
    """The profile's expert figures by field name (module docstring)."""
    repeat = 3 if quick else 10
    cuda = torch.cuda.is_available()
    dtype = torch.float16 if cuda else torch.float32
    device = torch.device("cuda" if cuda else "cpu")
    copy_bytes = COPY_BYTES // 8 if quick else COPY_BYTES
    rates, fixed = _cpu_rates(dtype, repeat, 4096 if cuda else 1024, copy_bytes)
    if cuda:
        fixed += _round_trip_s(device, dtype, repeat)
    return {
        "cpu_expert_gbps": rates,
        "cpu_expert_fixed_s": fixed,
        "expert_fixed_s": _expert_fixed_s(device, dtype, 10 * repeat),
    }
