"""Decode attention over a compressed KV cache: one new token a sequence attends over
slots 0 .. end - 1 of a `kv_cache.QuantKV` (the format is in that module's docstring).

`decode_attention_reference` is the plain-torch definition: dequantize the cache, then
SDPA. `decode_attention` launches two Triton kernels (flash-decoding): the first
splits each (sequence, KV head)'s token groups among programs, dequantizes K and V in
registers (`dequant.py`), runs the query heads of one KV head together (grouped-query)
with any additive bias (padding, causality, ALiBi) and writes each split's softmax
partial; the second merges the splits. Where the kernels do not run (no CUDA, no
interpreter) it runs `kv_attention_cpu.decode_attention_cpu` instead.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from offload.kernels.kv_attention_cpu import decode_attention_cpu
from offload.kernels.kv_cache import QuantKV
from offload.kernels.launch import Launcher, use_kernel

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs instead
    triton = None
else:
    from offload.kernels.dequant import dequant, dequant_nibbles


def decode_attention_reference(
    q: torch.Tensor, cache: QuantKV, bias: torch.Tensor, end: int
) -> torch.Tensor:
    """Attention of q [B, H, 1, D] over slots 0 .. end - 1 of the cache; [B, 1, H x D]."""
    keys, values = cache.dequantized(end)
    batch, heads, _, dim = q.shape
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=bias[..., :end], enable_gqa=keys.shape[1] != heads
    )
    return out.transpose(1, 2).reshape(batch, 1, heads * dim)


# Sequence splits of the decode attention: each program of the first kernel takes
# PER_SPLIT token groups of one (sequence, KV head), so even a small batch fills
# the GPU (flash-decoding); the second kernel merges the splits' softmax partials.
MAX_SPLITS = 64


def decode_attention(
    q: torch.Tensor,
    cache: QuantKV,
    bias: torch.Tensor,
    end: int,
    max_splits: int = MAX_SPLITS,
    warps: int = 2,
) -> torch.Tensor:
    """Attention of one new token per sequence over the compressed cache; [B, 1, H x D].

    q [B, H, 1, D]; bias [B, 1 | H, 1, >= end] additive (padding, ALiBi). The new token's
    own K/V must already be written. max_splits and warps: the kernel benchmark's sweep."""
    if not use_kernel(q):
        return decode_attention_cpu(q, cache, bias, end)
    batch, heads, _, dim = q.shape
    # the kernel steps over channels by 1 and over the cache's tensors by their shapes
    assert q.shape[2] == 1 and q.stride(3) == 1, "one query a sequence, contiguous channels"
    assert cache.k_codes.is_contiguous(), "the kernel reads the usual (not slot-major) layout"
    kv_heads = cache.k_codes.shape[1]
    rep = heads // kv_heads
    g = cache.group
    blocks = end // g + 1  # the full groups, then the tail
    per_split = triton.next_power_of_2(-(-blocks // max_splits))
    splits = -(-blocks // per_split)
    block_d = triton.next_power_of_2(dim)
    # tensor cores where the query heads of a KV head fill some of the 16 MMA rows and
    # the planes are at least 16 wide (tl.dot's smallest)
    dot = rep > 1 and g >= 32 and block_d >= 32
    block_r = max(16, triton.next_power_of_2(rep)) if dot else triton.next_power_of_2(rep)
    part_acc = torch.empty((batch, heads, splits, block_d), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((2, batch, heads, splits), dtype=torch.float32, device=q.device)
    _launch_split(
        (batch, kv_heads, splits), warps,
        q, q.stride(0), q.stride(1),
        bias, bias.stride(0), bias.stride(1) if bias.shape[1] > 1 else 0, bias.stride(3),
        cache.k_codes, cache.k_scale, cache.k_scale if cache.k_min is None else cache.k_min,
        cache.k_tail,
        cache.v_codes, cache.v_scale, cache.v_scale if cache.v_min is None else cache.v_min,
        cache.v_tail,
        part_acc, part_ml, part_ml[1],
        end // g, end % g, cache.k_codes.shape[2], cache.v_codes.shape[2], splits,
        1.0 / math.sqrt(dim),
        # HEAD_DIM, BLOCK_D, REP, BLOCK_R, GROUP, VGROUP, BITS, SYMMETRIC, PER_SPLIT
        dim, block_d, rep, block_r,
        g, cache.value_config.group_size, cache.config.bits, cache.config.symmetric, per_split,
        dot,
    )  # fmt: skip
    out = torch.empty((batch, 1, heads * dim), dtype=q.dtype, device=q.device)
    _launch_merge(
        (batch, heads), 4,
        part_acc, part_ml, part_ml[1], out, splits,
        dim, block_d, triton.next_power_of_2(splits),  # HEAD_DIM, BLOCK_D, BLOCK_S
    )  # fmt: skip
    return out


if triton is not None:
    # Triton specializes integer arguments equal to 1 or divisible by 16 (a new compile
    # each, about a second): the context-dependent ones change every decode step
    @triton.jit(
        do_not_specialize=[
            "bias_sb", "bias_sh",
            "full_groups", "tail_len", "num_groups", "max_slots", "splits",
        ]
    )  # fmt: skip
    def _attention_split_kernel(
        q_ptr, q_sb, q_sh,
        bias_ptr, bias_sb, bias_sh, bias_ss,
        kc_ptr, ks_ptr, km_ptr, kt_ptr,
        vc_ptr, vs_ptr, vm_ptr, vt_ptr,
        acc_ptr, m_ptr, l_ptr,
        full_groups, tail_len, num_groups, max_slots, splits,
        sm_scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, REP: tl.constexpr, BLOCK_R: tl.constexpr,
        GROUP: tl.constexpr, VGROUP: tl.constexpr, BITS: tl.constexpr, SYMMETRIC: tl.constexpr,
        PER_SPLIT: tl.constexpr, DOT: tl.constexpr,
    ):  # fmt: skip
        """One (sequence, KV head, split): its REP query heads against PER_SPLIT token
        groups (the compressed groups j < full_groups; the last split also takes the
        tail); writes the split's softmax max m, sum l and unnormalized output.

        Everything is worked in planes, so int4 codes are never interleaved: keys by
        even and odd tokens (the low and high nibbles of a key byte), values by even
        and odd tokens (rows) and even and odd channels (the nibbles of a value byte).
        The loop over the compressed groups has no branch (a group past the last is
        masked), so the loads of later groups can be issued early. DOT: the products
        on tensor cores (tl.dot, 16 query rows at least), else as sums of products
        (one query head a KV head: 15 of 16 MMA rows would be wasted)."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        kv_heads = tl.num_programs(1)
        r = tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        dh = tl.arange(0, BLOCK_D // 2)  # even / odd channel planes
        th = tl.arange(0, GROUP // 2)  # even / odd token planes
        r_ok = r < REP
        d_ok = d < HEAD_DIM
        dh_ok = dh < HEAD_DIM // 2
        heads = kvh * REP + r
        q = tl.load(
            q_ptr + b * q_sb + heads[:, None] * q_sh + d[None, :],
            mask=r_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        dtype = q.dtype
        row = b * kv_heads + kvh  # index of this (sequence, KV head) in the cache
        k_bytes: tl.constexpr = GROUP * BITS // 8
        v_bytes: tl.constexpr = HEAD_DIM * BITS // 8
        v_groups: tl.constexpr = HEAD_DIM // VGROUP
        m_i = tl.full((BLOCK_R,), -float("inf"), tl.float32)
        l_i = tl.zeros((BLOCK_R,), tl.float32)
        acc_e = tl.zeros((BLOCK_R, BLOCK_D // 2), tl.float32)  # even output channels
        acc_o = tl.zeros((BLOCK_R, BLOCK_D // 2), tl.float32)  # odd
        bias_rows = bias_ptr + b * bias_sb + heads[:, None] * bias_sh
        for i in tl.static_range(PER_SPLIT):
            j = split * PER_SPLIT + i
            # a one-element block, not a scalar: triton 3.9's interpreter rejects a mask
            # made of a block & a scalar condition ('mask has unsupported dtype')
            ok = (j + tl.zeros((1,), tl.int32)) < full_groups
            # keys [D, GROUP / 2] a plane: channel d of token t is byte d * k_bytes + t * BITS / 8
            kbase = (row * num_groups + j) * HEAD_DIM
            kscale = tl.load(ks_ptr + kbase + d, mask=d_ok & ok, other=0.0)[:, None]
            kmin = tl.load(km_ptr + kbase + d, mask=d_ok & ok, other=0.0)[:, None]
            krows = kc_ptr + (kbase + d[:, None]) * k_bytes
            kmask = d_ok[:, None] & ok
            if BITS == 4:
                kbyte = tl.load(krows + th[None, :], mask=kmask, other=0)
                k_e, k_o = dequant_nibbles(kbyte, kscale, kmin, SYMMETRIC, dtype)
            else:
                kbyte = tl.load(krows + tl.arange(0, GROUP)[None, :], mask=kmask, other=0)
                k_e, k_o = _pairs(kbyte, BLOCK_D, GROUP // 2)
                k_e = dequant(k_e, kscale, kmin, BITS, SYMMETRIC, dtype)
                k_o = dequant(k_o, kscale, kmin, BITS, SYMMETRIC, dtype)
            # values [GROUP / 2, D / 2] a plane: token t's channel c is byte t * v_bytes + c * BITS / 8
            slot_e = j * GROUP + 2 * th
            v_ee, v_eo = _value_planes(
                vc_ptr, vs_ptr, vm_ptr, row * max_slots + slot_e, dh, dh_ok, ok,
                v_bytes, v_groups, VGROUP, BLOCK_D, GROUP, BITS, SYMMETRIC, dtype,
            )  # fmt: skip
            v_oe, v_oo = _value_planes(
                vc_ptr, vs_ptr, vm_ptr, row * max_slots + slot_e + 1, dh, dh_ok, ok,
                v_bytes, v_groups, VGROUP, BLOCK_D, GROUP, BITS, SYMMETRIC, dtype,
            )  # fmt: skip
            block_ok = (th >= 0) & ok  # every token of a compressed group, or none
            m_i, l_i, acc_e, acc_o = _attend(
                q, k_e, k_o, v_ee, v_eo, v_oe, v_oo, bias_rows, slot_e, bias_ss,
                block_ok, block_ok, r_ok, sm_scale, m_i, l_i, acc_e, acc_o, DOT,
            )  # fmt: skip
        if split == splits - 1:
            # the tail: tokens of the incomplete last group, in the compute dtype
            t = tl.arange(0, GROUP)
            t_ok = t < tail_len
            keys = tl.load(
                kt_ptr + (row * GROUP + t[None, :]) * HEAD_DIM + d[:, None],
                mask=t_ok[None, :] & d_ok[:, None],
                other=0.0,
            )
            k_e, k_o = _pairs(keys, BLOCK_D, GROUP // 2)
            tail = vt_ptr + (row * GROUP + 2 * th[:, None]) * HEAD_DIM + d[None, :]
            e_ok = 2 * th < tail_len
            o_ok = 2 * th + 1 < tail_len
            v_ee, v_eo = _pairs(
                tl.load(tail, mask=e_ok[:, None] & d_ok[None, :], other=0.0),
                GROUP // 2,
                BLOCK_D // 2,
            )
            v_oe, v_oo = _pairs(
                tl.load(tail + HEAD_DIM, mask=o_ok[:, None] & d_ok[None, :], other=0.0),
                GROUP // 2,
                BLOCK_D // 2,
            )
            m_i, l_i, acc_e, acc_o = _attend(
                q, k_e, k_o, v_ee, v_eo, v_oe, v_oo, bias_rows, full_groups * GROUP + 2 * th,
                bias_ss, e_ok, o_ok, r_ok, sm_scale, m_i, l_i, acc_e, acc_o, DOT,
            )  # fmt: skip
        part = (b * kv_heads * REP + heads) * splits + split  # [BLOCK_R]
        tl.store(m_ptr + part, m_i, mask=r_ok)
        tl.store(l_ptr + part, l_i, mask=r_ok)
        out = acc_ptr + part[:, None] * BLOCK_D + 2 * dh[None, :]
        tl.store(out, acc_e, mask=r_ok[:, None])
        tl.store(out + 1, acc_o, mask=r_ok[:, None])

    @triton.jit
    def _pairs(x, ROWS: tl.constexpr, HALF: tl.constexpr):
        """x [ROWS, 2 x HALF] as its even and odd columns."""
        return tl.split(tl.reshape(x, (ROWS, HALF, 2)))

    @triton.jit
    def _value_planes(
        vc_ptr, vs_ptr, vm_ptr, vrow, dh, dh_ok, ok,
        v_bytes: tl.constexpr, v_groups: tl.constexpr, VGROUP: tl.constexpr,
        BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr,
        SYMMETRIC: tl.constexpr, dtype: tl.constexpr,
    ):  # fmt: skip
        """The values of cache rows vrow [GROUP / 2], dequantized: even and odd channels."""
        mask = dh_ok[None, :] & ok
        # both channels of a pair are in one group (VGROUP is even)
        params = vrow[:, None] * v_groups + (2 * dh[None, :]) // VGROUP
        vscale = tl.load(vs_ptr + params, mask=mask, other=0.0)
        vmin = tl.load(vm_ptr + params, mask=mask, other=0.0)
        if BITS == 4:
            vbyte = tl.load(vc_ptr + vrow[:, None] * v_bytes + dh[None, :], mask=mask, other=0)
            return dequant_nibbles(vbyte, vscale, vmin, SYMMETRIC, dtype)
        vbyte = tl.load(
            vc_ptr + vrow[:, None] * v_bytes + tl.arange(0, BLOCK_D)[None, :],
            mask=(tl.arange(0, BLOCK_D) < v_bytes)[None, :] & ok,
            other=0,
        )
        v_e, v_o = _pairs(vbyte, GROUP // 2, BLOCK_D // 2)
        return (
            dequant(v_e, vscale, vmin, BITS, SYMMETRIC, dtype),
            dequant(v_o, vscale, vmin, BITS, SYMMETRIC, dtype),
        )

    @triton.jit
    def _mm(a, b, DOT: tl.constexpr):
        """a [R, K] @ b [K, N] in float32: tensor cores, or sums of products."""
        if DOT:
            return tl.dot(a, b)
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)

    @triton.jit
    def _attend(
        q, k_e, k_o, v_ee, v_eo, v_oe, v_oo, bias_rows, slot_e, bias_ss, e_ok, o_ok, r_ok,
        sm_scale, m_i, l_i, acc_e, acc_o, DOT: tl.constexpr,
    ):  # fmt: skip
        """One block of tokens folded into the running softmax: keys k_e / k_o [D, T]
        (even / odd tokens), values v_<token><channel> [T, D / 2], e_ok / o_ok [T] which
        tokens count; slot_e [T] the even tokens' slots (the bias's columns)."""
        s_e = _mm(q, k_e, DOT) * sm_scale
        s_o = _mm(q, k_o, DOT) * sm_scale
        bias = bias_rows + slot_e[None, :] * bias_ss
        s_e += tl.load(bias, mask=r_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
        s_o += tl.load(bias + bias_ss, mask=r_ok[:, None] & o_ok[None, :], other=0.0).to(tl.float32)
        s_e = tl.where(e_ok[None, :], s_e, -float("inf"))
        s_o = tl.where(o_ok[None, :], s_o, -float("inf"))
        m_new = tl.maximum(m_i, tl.maximum(tl.max(s_e, axis=1), tl.max(s_o, axis=1)))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # nothing valid yet
        alpha = tl.exp(m_i - m_safe)
        p_e = tl.exp(s_e - m_safe[:, None])
        p_o = tl.exp(s_o - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p_e, axis=1) + tl.sum(p_o, axis=1)
        p_e = p_e.to(q.dtype)
        p_o = p_o.to(q.dtype)
        acc_e = acc_e * alpha[:, None] + _mm(p_e, v_ee, DOT) + _mm(p_o, v_oe, DOT)
        acc_o = acc_o * alpha[:, None] + _mm(p_e, v_eo, DOT) + _mm(p_o, v_oo, DOT)
        return m_new, l_i, acc_e, acc_o

    @triton.jit(do_not_specialize=["splits"])
    def _attention_merge_kernel(
        acc_ptr, m_ptr, l_ptr, out_ptr, splits,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        """One (sequence, query head): the splits' partial softmaxes merged, normalized."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        heads = tl.num_programs(1)
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        part = (b * heads + h) * splits + s
        s_ok = s < splits
        m = tl.load(m_ptr + part, mask=s_ok, other=-float("inf"))
        l_s = tl.load(l_ptr + part, mask=s_ok, other=0.0)
        acc = tl.load(acc_ptr + part[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0)
        m_max = tl.max(m, axis=0)
        w = tl.where(m == -float("inf"), 0.0, tl.exp(m - m_max))
        total = tl.sum(w * l_s, axis=0)
        out = tl.sum(w[:, None] * acc, axis=0) / total
        tl.store(
            out_ptr + (b * heads + h) * HEAD_DIM + d,
            out.to(out_ptr.dtype.element_ty),
            mask=d < HEAD_DIM,
        )

    _launch_split = Launcher(_attention_split_kernel)
    _launch_merge = Launcher(_attention_merge_kernel)
