"""Compressed experts' matmuls on the CPU at DRAM speed, through a C kernel
(`cpu_expert.c`, built by `native.py`): each packed int4 / int8 byte read once and
dequantized in registers, all threads, the SwiGLU expert in one call.

- `qlinear`: x [n, K] times a `QTensor` W [N, K]^T, float32 [n, N].
- `expert_mlp`: down(silu(gate(x)) * up(x)) with [gate | up] in mlp_in, both matrices
  `QTensor`s, float32 [n, hidden]; silu(gate) * up is computed as the gate and up
  channels are, and never leaves the call.

The weights take the values `quant.dequantize` gives them (its float32 steps, then the
matrix's dtype), and the sums are float32: the plain-torch reference (dequantize, then
a float32 matmul) differs by the order of the sums only. Both return None where the
kernel does not run, and the caller runs its torch path: no C compiler or OpenMP
(`native.py`), OFFLOAD_NATIVE=0, tensors off the CPU, not contiguous or not of the
format's sizes, scales that are not float16.
"""

from __future__ import annotations

import ctypes
import functools
import math
import time

import torch

from offload.kernels import native
from offload.kernels.quant import QTensor

SOURCE = native.source("cpu_expert.c")  # the kernel's C source (`native.load_library`)
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# stored weight bytes a thread at least: a tiny expert runs on fewer threads, which
# costs no fork-join and no wait for a busy core
THREAD_BYTES = 1 << 18

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Matrix(ctypes.Structure):
    """The C source's `Matrix`, field for field."""

    _fields_ = [
        *[("codes", _ptr), ("scale", _ptr), ("minimum", _ptr)],
        *[(n, _i64) for n in ("rows", "cols", "group", "bits", "symmetric", "zero_point")],
        ("dtype", _i64),
    ]


class _Call(ctypes.Structure):
    """The C source's `Call`, field for field."""

    _fields_ = [
        *[("w_in", _Matrix), ("w_out", _Matrix)],
        *[("x", _ptr), ("y", _ptr), ("scratch", _ptr)],
        *[(n, _i64) for n in ("n", "threads", "mode")],
    ]


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native.load_library("cpu_expert", SOURCE)
    if lib is not None:
        lib.expert.argtypes, lib.expert.restype = [ctypes.POINTER(_Call)], ctypes.c_int
        lib.read_bytes.argtypes, lib.read_bytes.restype = [_ptr, _i64, _i64], ctypes.c_double
        lib.vector_bits.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the kernel runs here."""
    return native.enabled() and _library() is not None


def _matrix(w: QTensor) -> _Matrix | None:
    """The C view of a matrix, or None where the kernel cannot read it as stored."""
    parts = [w.codes, w.scale] + ([] if w.minimum is None else [w.minimum])
    if len(w.shape) != 2 or w.dtype not in DTYPES:
        return None
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in parts):
        return None
    if w.scale.dtype != torch.float16 or (
        w.minimum is not None and w.minimum.dtype != w.scale.dtype
    ):
        return None
    config = w.config
    rows, cols = w.shape
    groups = rows * (cols // config.group_size)
    sizes = [rows * cols * config.bits // 8, groups] + ([] if w.minimum is None else [groups])
    if cols % config.group_size or [t.numel() for t in parts] != sizes:
        return None
    return _Matrix(
        codes=w.codes.data_ptr(),
        scale=w.scale.data_ptr(),
        minimum=None if w.minimum is None else w.minimum.data_ptr(),
        rows=rows,
        cols=cols,
        group=config.group_size,
        bits=config.bits,
        symmetric=int(config.symmetric),
        zero_point=int(config.zero_point),
        dtype=DTYPES[w.dtype],
    )


def _run(call: _Call, x: torch.Tensor, out_cols: int, scratch: int, nbytes: int) -> torch.Tensor:
    rows = x.shape[0]
    y = torch.empty(rows, out_cols)
    buffer = torch.empty(max(1, scratch))
    call.x, call.y, call.scratch, call.n = x.data_ptr(), y.data_ptr(), buffer.data_ptr(), rows
    call.threads = max(1, min(torch.get_num_threads(), nbytes // THREAD_BYTES))
    assert _library().expert(ctypes.byref(call)) == 0, "unsupported matrix"
    return y


def qlinear(x: torch.Tensor, w: QTensor) -> torch.Tensor | None:
    """x [n, K] times W [N, K]^T in float32 (the module docstring); None where the
    kernel does not run."""
    matrix = _matrix(w) if available() and x.dim() == 2 else None
    if matrix is None or x.shape[0] == 0:
        return None
    x = x.float().contiguous()
    call = _Call(w_in=matrix, mode=0)
    return _run(call, x, w.shape[0], x.numel(), w.nbytes)


def expert_mlp(x: torch.Tensor, mlp_in: QTensor, mlp_out: QTensor) -> torch.Tensor | None:
    """The SwiGLU expert over rows x [n, hidden] in float32 (the module docstring);
    None where the kernel does not run."""
    if not available() or x.dim() != 2 or x.shape[0] == 0:
        return None
    first, second = _matrix(mlp_in), _matrix(mlp_out)
    inner = mlp_in.shape[0] // 2
    if first is None or second is None or mlp_out.shape[1] != inner or mlp_in.shape[0] % 2:
        return None
    x = x.float().contiguous()
    call = _Call(w_in=first, w_out=second, mode=1)
    scratch = x.numel() + 2 * x.shape[0] * inner
    return _run(call, x, mlp_out.shape[0], scratch, mlp_in.nbytes + mlp_out.nbytes)


def read_gbps(buffer: torch.Tensor, repeat: int = 3) -> float | None:
    """GB/s at which all of torch's threads read `buffer` (the best of `repeat` passes)
    through the kernel's own loads; None without the library."""
    if not available():
        return None
    nbytes = buffer.numel() * buffer.element_size() // 64 * 64
    best = math.inf
    for _ in range(repeat + 1):  # the first pass warms up
        started = time.perf_counter()
        _library().read_bytes(buffer.data_ptr(), nbytes, torch.get_num_threads())
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9
