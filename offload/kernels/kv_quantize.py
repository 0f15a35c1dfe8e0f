"""Quantizing the completed token groups of a compressed KV cache (`kv_cache.QuantKV`;
the format is in that module's docstring).

When a write completes groups of G tokens, each group's keys are quantized per channel
over its G tokens (codes [D, G x bits / 8] a group, int4 two tokens a byte, low nibble
first; an fp16 scale and minimum a channel) and its values per token in groups of
VGROUP = gcd(G, D) channels (codes [G, D x bits / 8]; a scale and minimum a group).

`quantize_groups_reference` is the plain-torch definition (`quant.quantize` over
regrouped views). `quantize_groups` launches one Triton kernel that is bit-exact with
it: each program reads one group of G tokens of K and V once and writes their codes
and parameters (the reference's dozen full-size float32 passes took about a tenth of
an OPT-30B prefill). `QuantKV.write` picks between them (`launch.use_kernel`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from offload.kernels.launch import Launcher
from offload.kernels.quant import quantize

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs instead
    triton = None

if TYPE_CHECKING:
    from offload.kernels.kv_cache import QuantKV


def quantize_groups_reference(
    cache: QuantKV, part: slice, k: torch.Tensor, v: torch.Tensor, first: int, full: int
) -> None:
    """Groups first .. first + full - 1 of the cache's rows `part`, from k, v
    [rows, Hkv, >= full x G, D] (`part`'s sequences)."""
    g = cache.group
    rows, heads, _, dim = k.shape
    grouped = k[:, :, : full * g].reshape(rows, heads, full, g, dim).transpose(-1, -2)
    qk = quantize(grouped, cache.config)  # groups of g tokens, per channel
    cache.k_codes[part, :, first : first + full] = qk.codes.squeeze(-2)
    cache.k_scale[part, :, first : first + full] = qk.scale.flatten(-3)
    if qk.minimum is not None:
        cache.k_min[part, :, first : first + full] = qk.minimum.flatten(-3)
    slots = slice(first * g, (first + full) * g)
    qv = quantize(v[:, :, : full * g], cache.value_config)  # per token
    cache.v_codes[part, :, slots] = qv.codes.flatten(-2)
    cache.v_scale[part, :, slots] = qv.scale.flatten(-2)
    if qv.minimum is not None:
        cache.v_min[part, :, slots] = qv.minimum.flatten(-2)


def quantize_groups(
    cache: QuantKV, part: slice, k: torch.Tensor, v: torch.Tensor, first: int, full: int
) -> None:
    """`quantize_groups_reference` in one Triton kernel (CUDA tensors, or interpreted)."""
    rows, heads, _, dim = k.shape
    # the kernel steps over channels by 1 and over the cache's tensors by their shapes
    assert k.stride(3) == 1 and v.stride(3) == 1, "k and v need contiguous channels"
    assert cache.k_codes.is_contiguous(), "the kernel writes the usual (not slot-major) layout"
    cfg = cache.config
    _launch_quantize(
        (rows * heads, full), 4,
        k, k.stride(0), k.stride(1), k.stride(2),
        v, v.stride(0), v.stride(1), v.stride(2),
        cache.k_codes, cache.k_scale, cache.k_scale if cache.k_min is None else cache.k_min,
        cache.v_codes, cache.v_scale, cache.v_scale if cache.v_min is None else cache.v_min,
        part.start or 0, heads, first, cache.k_codes.shape[2], cache.v_codes.shape[2],
        # HEAD_DIM, BLOCK_D, GROUP, VGROUP, BITS, SYMMETRIC
        dim, triton.next_power_of_2(dim), cache.group, cache.value_config.group_size,
        cfg.bits, cfg.symmetric,
    )  # fmt: skip


if triton is not None:

    @triton.jit
    def _round_half_even(y):
        """torch.round's rounding (ties to even) for y >= 0 (y + 0.5 is exact here)."""
        r = tl.floor(y + 0.5)
        return tl.where((r - y == 0.5) & (r % 2 == 1), r - 1, r)

    @triton.jit
    def _group_codes(x, valid, BITS: tl.constexpr, SYMMETRIC: tl.constexpr):
        """`quant.quantize` of the groups along x's last axis (float32, masked by valid):
        (codes as float, scale, minimum), the same arithmetic and rounding (a true
        division for the codes, as torch's tensor division)."""
        levels: tl.constexpr = (1 << BITS) - 1
        if SYMMETRIC:
            half: tl.constexpr = levels // 2
            amax = tl.max(tl.where(valid, tl.abs(x), 0.0), axis=-1, keep_dims=True)
            scale = tl.maximum(amax, 1e-12) * (1.0 / half)
            y = tl.math.div_rn(x, scale)
            r = _round_half_even(tl.abs(y))  # mirrored for negatives, as torch.round
            r = tl.where(y < 0, -r, r)
            codes = tl.minimum(tl.maximum(r, -half), half) + half
            return codes, scale, scale
        low = tl.min(tl.where(valid, x, float("inf")), axis=-1, keep_dims=True)
        high = tl.max(tl.where(valid, x, -float("inf")), axis=-1, keep_dims=True)
        scale = tl.maximum(high - low, 1e-12) * (1.0 / levels)
        codes = _round_half_even(tl.math.div_rn(x - low, scale))
        return tl.minimum(tl.maximum(codes, 0.0), levels), scale, low

    @triton.jit
    def _pack4(codes):
        """Float codes [m, n] in [0, 15] to bytes [m, n / 2], two a byte, low first."""
        c = codes.to(tl.uint8)
        lo, hi = tl.split(tl.reshape(c, (c.shape[0], c.shape[1] // 2, 2)))
        return lo | (hi << 4)

    # the cache's shape and where the groups go vary with the job (its prompt length and
    # generation budget) and the step, so they are not specialized on: each new case
    # (1, a multiple of 16) was a compile of about a second in the job, after the warm-up
    # (W1c's first prefill: 544 slots against the warm-up's 99)
    @triton.jit(do_not_specialize=["row0", "first", "num_groups", "max_slots"])
    def _quantize_kv_kernel(
        k_ptr, k_sr, k_sh, k_st,
        v_ptr, v_sr, v_sh, v_st,
        kc_ptr, ks_ptr, km_ptr,
        vc_ptr, vs_ptr, vm_ptr,
        row0, heads, first, num_groups, max_slots,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
        VGROUP: tl.constexpr, BITS: tl.constexpr, SYMMETRIC: tl.constexpr,
    ):  # fmt: skip
        """One (sequence, KV head) and group j of G tokens: keys per channel over the
        tokens, values per token over VGROUP channels, into cache group first + j."""
        rh = tl.program_id(0)
        j = tl.program_id(1)
        row = rh // heads
        h = rh % heads
        t = tl.arange(0, GROUP)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        tokens = j * GROUP + t
        cache_row = (row0 + row) * heads + h
        # keys [BLOCK_D, GROUP]: the groups along the tokens
        keys = tl.load(
            k_ptr + row * k_sr + h * k_sh + tokens[None, :] * k_st + d[:, None],
            mask=d_ok[:, None],
            other=0.0,
        ).to(tl.float32)
        codes, scale, low = _group_codes(keys, d_ok[:, None], BITS, SYMMETRIC)
        k_bytes: tl.constexpr = GROUP * BITS // 8
        kb = tl.arange(0, k_bytes)
        group_at = (cache_row * num_groups + first + j) * HEAD_DIM + d  # [BLOCK_D]
        k_at = kc_ptr + group_at[:, None] * k_bytes + kb[None, :]
        if BITS == 4:
            tl.store(k_at, _pack4(codes), mask=d_ok[:, None])
        else:
            tl.store(k_at, codes.to(tl.uint8), mask=d_ok[:, None])
        tl.store(ks_ptr + group_at[:, None], scale.to(tl.float16), mask=d_ok[:, None])
        if not SYMMETRIC:
            tl.store(km_ptr + group_at[:, None], low.to(tl.float16), mask=d_ok[:, None])
        # values [GROUP, BLOCK_D / VGROUP, VGROUP]: the groups along the channels
        values = tl.load(
            v_ptr + row * v_sr + h * v_sh + tokens[:, None] * v_st + d[None, :],
            mask=d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        v_groups: tl.constexpr = BLOCK_D // VGROUP
        grouped = tl.reshape(values, (GROUP, v_groups, VGROUP))
        g_ok = tl.reshape(d_ok, (v_groups, VGROUP))[None, :, :]
        codes, scale, low = _group_codes(grouped, g_ok, BITS, SYMMETRIC)
        slot = cache_row * max_slots + (first + j) * GROUP + t  # [GROUP]
        v_bytes: tl.constexpr = HEAD_DIM * BITS // 8
        vb = tl.arange(0, BLOCK_D * BITS // 8)
        v_at = vc_ptr + slot[:, None] * v_bytes + vb[None, :]
        codes = tl.reshape(codes, (GROUP, BLOCK_D))
        if BITS == 4:
            tl.store(v_at, _pack4(codes), mask=(vb < v_bytes)[None, :])
        else:
            tl.store(v_at, codes.to(tl.uint8), mask=(vb < v_bytes)[None, :])
        c = tl.arange(0, v_groups)
        c_ok = (c < HEAD_DIM // VGROUP)[None, :]
        per_token = HEAD_DIM // VGROUP
        scale = tl.reshape(scale, (GROUP, v_groups))
        tl.store(vs_ptr + slot[:, None] * per_token + c[None, :], scale.to(tl.float16), mask=c_ok)
        if not SYMMETRIC:
            low = tl.reshape(low, (GROUP, v_groups))
            tl.store(vm_ptr + slot[:, None] * per_token + c[None, :], low.to(tl.float16), mask=c_ok)

    _launch_quantize = Launcher(_quantize_kv_kernel)
