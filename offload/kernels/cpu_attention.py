"""Decode attention on the CPU at DRAM speed: one new token a sequence over its cached
keys and values, through a C kernel (`cpu_attention.c`, built by `native.py`).

- `decode_attention_dense`: a full-precision cache (fp32, fp16, bf16), keys/values
  [B, Hkv, S, D] with any strides but contiguous channels (the executor's CPU home is a
  view of a larger buffer, its disk home a permuted view).
- `decode_attention_quant`: a compressed `QuantKV` (int4 / int8, the format in
  `kv_cache.py`, either layout), used as stored.

Both take q [B, H, 1, D] (grouped-query heads share their KV head's bytes) and an
additive bias [B | 1, H | 1, 1, >= end], and return [B, 1, H x D] in q's dtype; the
math is the float32 online softmax of flash-decoding. Both return None where the
kernel does not run, and the caller runs its torch path: no C compiler or OpenMP
(`native.py`), OFFLOAD_NATIVE=0, a head_dim that is not a multiple of 16 or above 256,
more than 64 query heads a KV head, or a full-precision cache on a CPU without AVX2
(the generic build ran 5x slower than SDPA there, one core; its compressed path still
beat the torch path's, 1.7x).

Measured on one core of the 2-core CI machine (docs/cpu_attention.md): the profile's
shape (16 x 32 heads x 1024 x 128) fp16 in 20 ms against SDPA's 40, int4-g64 in 10 ms
against the torch path's 87.
"""

from __future__ import annotations

import ctypes
import functools
import math
import time

import torch

from offload.kernels import native
from offload.kernels.kv_cache import QuantKV

SOURCE = native.source("cpu_attention.c")  # the kernel's C source (`native.load_library`)

# tokens a work item takes at most: longer contexts are split and the splits merged, so
# a sequence's result depends on its context length only (never on the batch or the
# threads), and a small batch still fills every core
SPLIT_TOKENS = 1024
DENSE_BLOCK = 64  # tokens of a full-precision block (the C source's DENSE_BLOCK)
DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# K/V bytes a thread at least: a small call (the demo's decode, 40 KB a layer) runs on
# one thread, which costs no fork-join and no wait for a busy core
THREAD_BYTES = 1 << 18
MAX_DIM, MAX_REP = 256, 64

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Args(ctypes.Structure):
    """The C source's `Args`, field for field."""

    _fields_ = [
        *[("q", _ptr), ("bias", _ptr), ("bias_sb", _i64), ("bias_sh", _i64)],
        *[("out", _ptr), ("partial", _ptr)],
        *[(n, _i64) for n in ("batch", "heads", "kv_heads", "dim", "end", "splits", "threads")],
        *[("k", _ptr), ("v", _ptr)],
        *[(n, _i64) for n in ("k_sb", "k_sh", "k_st", "v_sb", "v_sh", "v_st")],
        *[("dtype", _i64), ("dense_from", _i64)],
        *[(n, _i64) for n in ("bits", "group", "vgroup", "symmetric", "full_groups")],
        *[("kc", _ptr), ("kc_sb", _i64), ("kc_sh", _i64), ("kc_sg", _i64)],
        *[("ks", _ptr), ("km", _ptr), ("ks_sb", _i64), ("ks_sh", _i64), ("ks_sg", _i64)],
        *[("vc", _ptr), ("vc_sb", _i64), ("vc_sh", _i64), ("vc_st", _i64)],
        *[("vs", _ptr), ("vm", _ptr), ("vs_sb", _i64), ("vs_sh", _i64), ("vs_st", _i64)],
    ]


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native.load_library("cpu_attention", SOURCE)
    if lib is not None:
        lib.attend.argtypes, lib.attend.restype = [ctypes.POINTER(_Args)], ctypes.c_int
        lib.read_bytes.argtypes, lib.read_bytes.restype = [_ptr, _i64, _i64], ctypes.c_double
        lib.vector_bits.restype = ctypes.c_int
    return lib


def available(compressed: bool) -> bool:
    """Whether the kernel runs here for a compressed (or a full-precision) cache."""
    lib = _library() if native.enabled() else None
    return lib is not None and (compressed or lib.vector_bits() >= 256)


def _runs(q: torch.Tensor, kv_heads: int, compressed: bool) -> bool:
    _, heads, new, dim = q.shape
    return (
        q.device.type == "cpu"
        and new == 1
        and dim % 16 == 0
        and dim <= MAX_DIM
        and heads % kv_heads == 0
        and heads // kv_heads <= MAX_REP
        and available(compressed)
    )


def _bias_rows(bias: torch.Tensor, q: torch.Tensor, end: int) -> torch.Tensor | None:
    """Additive bias [B | 1, H | 1, 1, >= end] as float32 [B | 1, H | 1, end], tokens
    contiguous; None for another shape or a boolean mask."""
    batch, heads = q.shape[:2]
    if bias.dim() != 4 or bias.shape[0] not in (1, batch) or bias.shape[1] not in (1, heads):
        return None
    if not bias.is_floating_point():
        return None
    return bias[:, :, -1, :end].float().contiguous()


def _launch(
    args: _Args, q: torch.Tensor, bias: torch.Tensor, end: int, units: int, per: int, nbytes: int
):
    """Fill the common fields, run, return [B, 1, H x D] in q's dtype. units: blocks or
    token groups to split by `per` a split; nbytes: the K/V the call reads."""
    batch, heads, _, dim = q.shape
    query = (q.float() * (1.0 / math.sqrt(dim))).reshape(batch, heads, dim).contiguous()
    out = torch.empty(batch, heads, dim)
    splits = max(1, -(-units // per))
    partial = None
    if splits > 1:
        rep = heads // args.kv_heads
        partial = torch.empty(batch * args.kv_heads * splits * rep * (dim + 2))
    args.q, args.out = query.data_ptr(), out.data_ptr()
    args.partial = partial.data_ptr() if partial is not None else None
    args.bias = bias.data_ptr()
    args.bias_sb = bias.stride(0) if bias.shape[0] > 1 else 0
    args.bias_sh = bias.stride(1) if bias.shape[1] > 1 else 0
    args.batch, args.heads, args.dim, args.end = batch, heads, dim, end
    items = batch * args.kv_heads * splits
    args.splits = splits
    args.threads = max(1, min(torch.get_num_threads(), items, nbytes // THREAD_BYTES))
    assert _library().attend(ctypes.byref(args)) == 0, "unsupported shape"
    return out.view(batch, 1, heads * dim).to(q.dtype)


def _dense_fields(args: _Args, keys: torch.Tensor, values: torch.Tensor) -> None:
    args.k, args.v = keys.data_ptr(), values.data_ptr()
    args.k_sb, args.k_sh, args.k_st = keys.stride()[:3]
    args.v_sb, args.v_sh, args.v_st = values.stride()[:3]
    args.dtype = DTYPES[keys.dtype]


def decode_attention_dense(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor | None:
    """Attention of q [B, H, 1, D] over keys/values [B, Hkv, S, D]; [B, 1, H x D], or
    None where the kernel does not run (the module docstring)."""
    end = keys.shape[2]
    if not (
        _runs(q, keys.shape[1], compressed=False)
        and keys.dtype == values.dtype
        and keys.dtype in DTYPES
        and keys.stride(3) == values.stride(3) == 1
        and keys.device.type == values.device.type == "cpu"
        and end > 0
    ):
        return None
    rows = _bias_rows(bias, q, end)
    if rows is None:
        return None
    args = _Args(kv_heads=keys.shape[1])
    _dense_fields(args, keys, values)
    blocks = -(-end // DENSE_BLOCK)
    nbytes = 2 * keys[..., :1, :].numel() * end * keys.element_size()
    return _launch(args, q, rows, end, blocks, SPLIT_TOKENS // DENSE_BLOCK, nbytes)


def _quant_layout_ok(cache: QuantKV) -> bool:
    """The kernel steps over rows, KV heads and slots by stride; within, it needs the
    format's inner axes contiguous (both layouts have them so)."""
    codes = cache.k_codes
    inner = (
        codes.stride(4) == 1
        and codes.stride(3) == codes.shape[4]
        and all(t.stride(3) == 1 for t in (cache.k_scale, cache.v_codes, cache.v_scale))
        and all(t.stride(3) == 1 for t in (cache.k_tail, cache.v_tail))
    )
    same = all(
        other is None or other.stride() == t.stride()
        for t, other in ((cache.k_scale, cache.k_min), (cache.v_scale, cache.v_min))
    )
    return inner and same and cache.dtype in DTYPES and codes.device.type == "cpu"


def decode_attention_quant(
    q: torch.Tensor, cache: QuantKV, bias: torch.Tensor, end: int
) -> torch.Tensor | None:
    """Attention of q [B, H, 1, D] over slots 0 .. end - 1 of a compressed cache;
    [B, 1, H x D], or None where the kernel does not run (the module docstring)."""
    kv_heads = cache.k_codes.shape[1]
    if not (_runs(q, kv_heads, compressed=True) and end > 0 and _quant_layout_ok(cache)):
        return None
    rows = _bias_rows(bias, q, end)
    if rows is None:
        return None
    group = cache.group
    full = end // group
    args = _Args(kv_heads=kv_heads, dense_from=full * group, full_groups=full)
    _dense_fields(args, cache.k_tail, cache.v_tail)
    args.bits, args.group = cache.config.bits, group
    args.vgroup, args.symmetric = cache.value_config.group_size, int(cache.config.symmetric)
    args.kc = cache.k_codes.data_ptr()
    args.kc_sb, args.kc_sh, args.kc_sg = cache.k_codes.stride()[:3]
    args.ks, args.km = cache.k_scale.data_ptr(), _pointer(cache.k_min)
    args.ks_sb, args.ks_sh, args.ks_sg = cache.k_scale.stride()[:3]
    args.vc = cache.v_codes.data_ptr()
    args.vc_sb, args.vc_sh, args.vc_st = cache.v_codes.stride()[:3]
    args.vs, args.vm = cache.v_scale.data_ptr(), _pointer(cache.v_min)
    args.vs_sb, args.vs_sh, args.vs_st = cache.v_scale.stride()[:3]
    nbytes = 2 * cache.k_tail[..., :1, :].numel() * end * cache.config.bits // 8
    return _launch(args, q, rows, end, full, max(1, SPLIT_TOKENS // group), nbytes)


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def read_gbps(buffer: torch.Tensor, repeat: int = 3) -> float | None:
    """GB/s at which all of torch's threads read `buffer` (the best of `repeat` passes),
    through the kernel's own loads; None without the library."""
    lib = _library() if native.enabled() else None
    if lib is None:
        return None
    nbytes = buffer.numel() * buffer.element_size() // 64 * 64
    best = math.inf
    for _ in range(repeat + 1):  # the first pass warms up
        started = time.perf_counter()
        lib.read_bytes(buffer.data_ptr(), nbytes, torch.get_num_threads())
        best = min(best, time.perf_counter() - started)
    return nbytes / best / 1e9
