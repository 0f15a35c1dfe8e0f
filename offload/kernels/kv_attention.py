"""Decode attention over a compressed KV cache: one new token a sequence attends over
slots 0 .. end - 1 of a `kv_cache.QuantKV` (the format is in that module's docstring).

`decode_attention_reference` is the plain-torch definition: dequantize the cache, then
SDPA. `decode_attention` sends the int4 caches that `kv_attention_mma` serves (float16,
128 channels, up to 8 query heads a KV head, sm_80 on) to its kernel, one launch.
Otherwise it launches two Triton kernels (flash-decoding): the first splits each
(sequence, KV head)'s token groups among programs, dequantizes K and V in registers
(`kv_attention_loads.py`, `dequant.py`), runs the query heads of one KV head together
(grouped-query) with any additive bias (padding, causality, ALiBi) and writes each
split's softmax partial; the second merges the splits. Where the kernels do not run (no CUDA, no
interpreter) it runs `kv_attention_cpu.decode_attention_cpu` instead.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from offload.kernels import kv_attention_mma
from offload.kernels.kv_attention_cpu import decode_attention_cpu
from offload.kernels.kv_cache import QuantKV
from offload.kernels.launch import Launcher, arrival_counters, sm_count, use_kernel

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs instead
    triton = None
else:
    from offload.kernels.kv_attention_loads import (
        load_bias,
        load_keys,
        load_values,
        tail_keys,
        tail_values,
    )


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


# Sequence splits (flash-decoding): each program of the first kernel takes a run of
# whole token groups of one (sequence, KV head), or that row's tail, so even a small
# batch fills the GPU; the row's last program to finish merges the splits' softmax
# partials (fused_merge), or a second kernel does. Splits are sized for about
# SPLIT_WAVES programs an SM (`_split_groups`). H100 sweep (`bench_kernels --kernels
# attention-sweep`, OPT-30B, Llama-2-70B/13B, BLOOM shapes; docs/throughput.md): fixed split
# sizes of 4-32 groups came within 3-8% of this either way; 4 warps lost 40%. The fused
# merge is the default: its time was within -3.5%..+2.6% of the two kernels', it saves
# a launch a layer in the eager decode attention, and the merge kernel's BLOCK_S (the
# splits, to a power of two) changes with the context, a compile in the job where the
# warm-up's short context had fewer splits.
SPLIT_WAVES = 8
# stages of the loads' pipeline: 2 was 4-13% faster than 3 on the MHA shapes (more
# programs an SM in the shared memory), even on the 70B one; 4 lost 6%
STAGES = 2


def _split_groups(rows: int, full_groups: int, tile_groups: int, device: torch.device) -> int:
    """Token groups a program takes: the fewest that still give about SPLIT_WAVES
    programs an SM over the rows' (sequence, KV head) pairs, in whole tiles."""
    splits = max(1, -(-SPLIT_WAVES * sm_count(device) // rows))
    groups = max(1, -(-full_groups // splits))
    return -(-groups // tile_groups) * tile_groups


def decode_attention(
    q: torch.Tensor,
    cache: QuantKV,
    bias: torch.Tensor,
    end: int,
    split_groups: int | None = None,
    warps: int = 2,
    stages: int = STAGES,
    tile_groups: int = 1,
    fused_merge: bool = True,
    mma: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over the compressed cache; [B, 1, H x D]
    (into out, contiguous, where given: the decode graphs' input buffer).

    q [B, H, 1, D]; bias [B, 1 | H, 1, >= end] additive (padding, ALiBi). The new token's
    own K/V must already be written. split_groups (token groups a program; None: sized
    from the SM count), warps, stages (of the loads' pipeline), tile_groups (token
    groups a loop step) and fused_merge (the last split of a row merges, no second
    kernel): the kernel benchmark's sweep. mma: whether `kv_attention_mma`'s kernel
    attends (None: where it is eligible; of the others only split_groups applies to it,
    None: its own choice)."""
    if not use_kernel(q):
        context = decode_attention_cpu(q, cache, bias, end)
        return context if out is None else out.copy_(context)
    batch, heads, _, dim = q.shape
    # the kernel steps over channels by 1 and over the cache's tensors by their shapes
    assert q.shape[2] == 1 and q.stride(3) == 1, "one query a sequence, contiguous channels"
    assert cache.k_codes.is_contiguous(), "the kernel reads the usual (not slot-major) layout"
    kv_heads = cache.k_codes.shape[1]
    rep = heads // kv_heads
    g = cache.group
    full_groups = end // g
    if mma is None:
        mma = kv_attention_mma.eligible(q, cache)
    # a loop step's token planes are the K dimension of a tl.dot: 16 at least
    tile_groups = max(tile_groups, 32 // g)
    if split_groups is None and not mma:
        split_groups = _split_groups(batch * kv_heads, full_groups, tile_groups, q.device)
    if out is None:
        out = torch.empty((batch, 1, heads * dim), dtype=q.dtype, device=q.device)
    assert out.shape == (batch, 1, heads * dim) and out.is_contiguous()
    if mma:
        return kv_attention_mma.decode_attention_mma(q, cache, bias, end, out, split_groups)
    # and a last program for the tail, if there is one
    splits = -(-full_groups // split_groups) + (end % g > 0)
    block_d = triton.next_power_of_2(dim)
    part_acc = torch.empty((batch, heads, splits, block_d), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((2, batch, heads, splits), dtype=torch.float32, device=q.device)
    per_head = bias.shape[1] > 1
    counts = arrival_counters("attention", q.device, batch * kv_heads) if fused_merge else part_ml
    _launch_split(
        (batch, kv_heads, splits), warps,
        q, q.stride(0), q.stride(1),
        bias, bias.stride(0), bias.stride(1) if per_head else 0, bias.stride(3),
        cache.k_codes, cache.k_scale, cache.k_scale if cache.k_min is None else cache.k_min,
        cache.k_tail,
        cache.v_codes, cache.v_scale, cache.v_scale if cache.v_min is None else cache.v_min,
        cache.v_tail,
        part_acc, part_ml, part_ml[1], out, counts,
        full_groups, end % g, cache.k_codes.shape[2], cache.v_codes.shape[2], splits,
        split_groups, 1.0 / math.sqrt(dim),
        # HEAD_DIM, BLOCK_D, REP, BLOCK_R, GROUP, VGROUP, BITS, SYMMETRIC
        dim, block_d, rep, triton.next_power_of_2(rep),
        g, cache.value_config.group_size, cache.config.bits, cache.config.symmetric,
        # BIAS_PER_HEAD, TILE_GROUPS, STAGES, PRECISION, FUSED_MERGE
        per_head, tile_groups, stages, "ieee" if q.dtype == torch.float32 else "tf32",
        fused_merge,
    )  # fmt: skip
    if fused_merge:
        return out
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
            "full_groups", "tail_len", "num_groups", "max_slots", "splits", "split_groups",
        ]
    )  # fmt: skip
    def _attention_split_kernel(
        q_ptr, q_sb, q_sh,
        bias_ptr, bias_sb, bias_sh, bias_ss,
        kc_ptr, ks_ptr, km_ptr, kt_ptr,
        vc_ptr, vs_ptr, vm_ptr, vt_ptr,
        acc_ptr, m_ptr, l_ptr, out_ptr, count_ptr,
        full_groups, tail_len, num_groups, max_slots, splits, split_groups,
        qk_scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, REP: tl.constexpr, BLOCK_R: tl.constexpr,
        GROUP: tl.constexpr, VGROUP: tl.constexpr, BITS: tl.constexpr, SYMMETRIC: tl.constexpr,
        BIAS_PER_HEAD: tl.constexpr, TILE_GROUPS: tl.constexpr, STAGES: tl.constexpr,
        PRECISION: tl.constexpr, FUSED_MERGE: tl.constexpr,
    ):  # fmt: skip
        """One (sequence, KV head, split): its REP query heads against split_groups
        compressed token groups, or (a last split, where the tail holds tokens) against
        the tail; writes the split's softmax maximum m and sum l and its unnormalized
        output.

        Tokens are the rows of the products (the M side of tl.dot) and the query heads
        its columns, so one query head a KV head wastes no MMA rows and the softmax
        works on tokens x heads only. Everything is worked in planes, so codes are never
        interleaved: keys and values by even and odd tokens (the low and high nibbles of
        a key byte), values also by even and odd channels (of a value byte). A loop step
        takes TILE_GROUPS groups; its loads are pipelined STAGES deep (cp.async), except
        the bias, whose stride is not known to be aligned: it is loaded a step ahead.
        FUSED_MERGE: the row's last program to finish (an arrival counter) merges the
        splits into out, in split order, so the sum does not depend on which was last."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        kv_heads = tl.num_programs(1)
        r = tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        r_ok = r < REP
        heads = kvh * REP + r
        q = tl.load(
            q_ptr + b * q_sb + heads[None, :] * q_sh + d[:, None],
            mask=r_ok[None, :] & (d < HEAD_DIM)[:, None],
            other=0.0,
        )  # [D, R]
        dtype = q.dtype
        row = b * kv_heads + kvh  # index of this (sequence, KV head) in the cache
        bias_row = bias_ptr + b * bias_sb
        m_i = tl.full((BLOCK_R,), -float("inf"), tl.float32)
        l_i = tl.zeros((BLOCK_R,), tl.float32)
        acc_e = tl.zeros((BLOCK_D // 2, BLOCK_R), tl.float32)  # even output channels
        acc_o = tl.zeros((BLOCK_D // 2, BLOCK_R), tl.float32)  # odd
        TOKENS: tl.constexpr = TILE_GROUPS * GROUP // 2  # a plane's tokens a step
        i = tl.arange(0, TOKENS)
        if split * split_groups >= full_groups:
            # the tail: tokens of the incomplete last group, in the compute dtype
            e_ok = 2 * i < tail_len
            o_ok = 2 * i + 1 < tail_len
            k_e, k_o = tail_keys(kt_ptr, row, i, d, e_ok, o_ok, HEAD_DIM, GROUP)
            b_e, b_o = load_bias(
                bias_row, heads, r_ok, bias_sh, bias_ss, full_groups * GROUP + 2 * i, e_ok,
                o_ok, BIAS_PER_HEAD,
            )  # fmt: skip
            m_i, l_i, p_e, p_o, alpha = _softmax_step(
                q, k_e, k_o, b_e, b_o, e_ok, o_ok, qk_scale, m_i, l_i, True, PRECISION
            )  # fmt: skip
            v_ee, v_eo = tail_values(vt_ptr, row, 2 * i, e_ok, HEAD_DIM, BLOCK_D, GROUP)
            v_oe, v_oo = tail_values(vt_ptr, row, 2 * i + 1, o_ok, HEAD_DIM, BLOCK_D, GROUP)
            acc_e, acc_o = _accumulate(
                acc_e, acc_o, alpha, p_e, p_o, v_ee, v_eo, v_oe, v_oo, PRECISION
            )  # fmt: skip
        else:
            first = split * split_groups
            last = tl.minimum(first + split_groups, full_groups)
            slot = first * GROUP + 2 * i
            b_e, b_o = load_bias(
                bias_row, heads, r_ok, bias_sh, bias_ss, slot, slot < last * GROUP,
                slot + 1 < last * GROUP, BIAS_PER_HEAD,
            )  # fmt: skip
            for j in tl.range(first, last, TILE_GROUPS, num_stages=STAGES):
                # a tile's groups past the split's last are masked (TILE_GROUPS > 1)
                t_ok = j + i // (GROUP // 2) < last
                bias_e, bias_o = b_e, b_o  # loaded a step ahead
                slot = (j + TILE_GROUPS) * GROUP + 2 * i
                b_e, b_o = load_bias(
                    bias_row, heads, r_ok, bias_sh, bias_ss, slot, slot < last * GROUP,
                    slot + 1 < last * GROUP, BIAS_PER_HEAD,
                )  # fmt: skip
                k_e, k_o = load_keys(
                    kc_ptr, ks_ptr, km_ptr, row * num_groups + j, j, last, HEAD_DIM, BLOCK_D,
                    GROUP, BITS, SYMMETRIC, TILE_GROUPS, dtype,
                )  # fmt: skip
                # the scores first: their operands' shared memory is then free for the values'
                m_i, l_i, p_e, p_o, alpha = _softmax_step(
                    q, k_e, k_o, bias_e, bias_o, t_ok, t_ok, qk_scale, m_i, l_i,
                    TILE_GROUPS > 1, PRECISION,
                )  # fmt: skip
                slots = row * max_slots + j * GROUP + 2 * i
                v_ee, v_eo, v_oe, v_oo = load_values(
                    vc_ptr, vs_ptr, vm_ptr, slots, t_ok, TOKENS, HEAD_DIM, BLOCK_D, VGROUP, BITS,
                    SYMMETRIC, dtype,
                )  # fmt: skip
                acc_e, acc_o = _accumulate(
                    acc_e, acc_o, alpha, p_e, p_o, v_ee, v_eo, v_oe, v_oo, PRECISION
                )  # fmt: skip
        part = (b * kv_heads * REP + heads) * splits + split  # [BLOCK_R]
        tl.store(m_ptr + part, m_i, mask=r_ok)
        tl.store(l_ptr + part, l_i, mask=r_ok)
        partial = acc_ptr + part[None, :] * BLOCK_D + 2 * tl.arange(0, BLOCK_D // 2)[:, None]
        tl.store(partial, acc_e, mask=r_ok[None, :])
        tl.store(partial + 1, acc_o, mask=r_ok[None, :])
        if FUSED_MERGE:
            tl.debug_barrier()  # every thread's partial stored before the release below
            if tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == splits - 1:
                _merge_row(
                    acc_ptr, m_ptr, l_ptr, out_ptr, (b * kv_heads * REP + heads) * splits,
                    r_ok, splits, b * kv_heads * REP + heads, HEAD_DIM, BLOCK_D, BLOCK_R,
                )  # fmt: skip
                tl.atomic_xchg(count_ptr + row, 0)

    @triton.jit
    def _merge_row(
        acc_ptr, m_ptr, l_ptr, out_ptr, first, r_ok, splits, heads,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    ):  # fmt: skip
        """The splits' partials (from first [R] on) of query heads heads [R] merged into
        their normalized output, in split order. The partials are read past L1 (.cg):
        other programs wrote them."""
        d = tl.arange(0, BLOCK_D)
        m_run = tl.full((BLOCK_R,), -float("inf"), tl.float32)
        l_run = tl.zeros((BLOCK_R,), tl.float32)
        o_run = tl.zeros((BLOCK_D, BLOCK_R), tl.float32)
        s = 0
        while s < splits:
            m_s = tl.load(m_ptr + first + s, mask=r_ok, other=-float("inf"), cache_modifier=".cg")
            l_s = tl.load(l_ptr + first + s, mask=r_ok, other=0.0, cache_modifier=".cg")
            o_s = tl.load(
                acc_ptr + (first + s)[None, :] * BLOCK_D + d[:, None],
                mask=r_ok[None, :],
                other=0.0,
                cache_modifier=".cg",
            )
            m_new = tl.maximum(m_run, m_s)
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # nothing valid yet
            old = tl.exp(m_run - m_safe)
            new = tl.exp(m_s - m_safe)
            l_run = l_run * old + l_s * new
            o_run = o_run * old[None, :] + o_s * new[None, :]
            m_run = m_new
            s += 1
        tl.store(
            out_ptr + heads[None, :] * HEAD_DIM + d[:, None],
            (o_run / l_run[None, :]).to(out_ptr.dtype.element_ty),
            mask=r_ok[None, :] & (d < HEAD_DIM)[:, None],
        )

    @triton.jit
    def _softmax_step(
        q, k_e, k_o, b_e, b_o, e_ok, o_ok, qk_scale, m_i, l_i,
        MASKED: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """The running softmax over one step's tokens: keys k_e / k_o [T, D] (even / odd
        tokens), q [D, R], bias b_e / b_o [T, R | 1]; MASKED: only the tokens e_ok / o_ok
        [T] count. The new maximum and sum, the probabilities p_e / p_o [T, R] in the
        compute dtype and alpha [R], the old terms' factor."""
        s_e = tl.dot(k_e, q, input_precision=PRECISION) * qk_scale + b_e.to(tl.float32)
        s_o = tl.dot(k_o, q, input_precision=PRECISION) * qk_scale + b_o.to(tl.float32)
        if MASKED:
            s_e = tl.where(e_ok[:, None], s_e, -float("inf"))
            s_o = tl.where(o_ok[:, None], s_o, -float("inf"))
        m_new = tl.maximum(m_i, tl.maximum(tl.max(s_e, axis=0), tl.max(s_o, axis=0)))
        m_safe = m_new
        if MASKED:
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # nothing valid yet
        alpha = tl.exp(m_i - m_safe)
        p_e = tl.exp(s_e - m_safe[None, :])
        p_o = tl.exp(s_o - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(p_e, axis=0) + tl.sum(p_o, axis=0)
        return m_new, l_i, p_e.to(q.dtype), p_o.to(q.dtype), alpha

    @triton.jit
    def _accumulate(
        acc_e, acc_o, alpha, p_e, p_o, v_ee, v_eo, v_oe, v_oo, PRECISION: tl.constexpr
    ):  # fmt: skip
        """The output's even and odd channels [D / 2, R] rescaled by alpha, plus one
        step's values v_<token><channel> [D / 2, T] weighted by p_e / p_o [T, R]."""
        acc_e = acc_e * alpha[None, :]
        acc_e += tl.dot(v_ee, p_e, input_precision=PRECISION)
        acc_e += tl.dot(v_oe, p_o, input_precision=PRECISION)
        acc_o = acc_o * alpha[None, :]
        acc_o += tl.dot(v_eo, p_e, input_precision=PRECISION)
        acc_o += tl.dot(v_oo, p_o, input_precision=PRECISION)
        return acc_e, acc_o

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
