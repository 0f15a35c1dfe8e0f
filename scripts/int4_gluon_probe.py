"""The int4 decode matmul in Gluon: W's dequantized codes as wgmma's register operand, its
tiles brought in by TMA, beside ours on the same weights.

    python scripts/int4_gluon_probe.py [--rows 1,14,16,32] [--out benchmarks/results]
    python scripts/int4_gluon_probe.py --compile-only   # no GPU: sm_90 SASS counts

Status: compiled offline for sm_90 with triton 3.6 (the GPU machine's); not yet run on
a GPU. Gluon has no path in the CPU interpreter, so nothing here is checked on the CPU.

The kernel computes out^T = W x^T: 64 W rows a program are wgmma's M side, x's rows its
N side (16 or 32), and x^T is read from shared memory as the B operand.
- W's codes stay in `QTensor`'s format. In wgmma's A fragment (per warp, that of
  `mma.m16n8k16`), lane l holds columns 2j, 2j + 1, 2j + 8 and 2j + 9 of each 16, with
  j = l mod 4: the low and high nibbles of bytes j and 4 + j of the chunk's 8 bytes.
  `CODES` loads exactly those bytes. The inline-PTX dequantization of `dequant.py`
  gives the two nibbles' values, and joined and reshaped they are the A operand with
  no data movement (`convert_layout(..., assert_trivial=True)` compiles).
- A ring of STAGES shared-memory slots, each filled by two TMA copies (the codes tile
  and x's tile) that complete on the slot's mbarrier. The wgmma runs asynchronously,
  one step behind its wait, and a slot is refilled once the wgmma that read it is done.
- The scales and minimums are plain loads, one step ahead. (A step's 4 groups are 8
  bytes a row, under TMA's 16-byte box.)
- Split-K as ours, partials in float32, which torch sums: timed with the sum (`gluon`)
  and without it (`gluon kernel`); ours sums inside its kernel.

int4-g64 asymmetric W, fp16 x, K a multiple of 256. Writes JSON and prints a table;
docs/throughput.md has the design and what it measured.
"""

from __future__ import annotations

import argparse
import collections
import functools
import re
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from offload.kernels.dequant import _NIBBLES_ASYMMETRIC
from offload.kernels.launch import arrival_counters, sm_count

# Names that changed between the Triton versions the project allows. TMA's load into
# shared memory: `async_copy_global_to_shared` in triton 3.6 (the GPU
# machine's), renamed `async_load` by 3.9, where the old name raises
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# a barrier of the program's threads: `thread_barrier` in 3.6, `barrier` in 3.9
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

W_ROWS = 64  # W rows a program: wgmma's M
K_STEP = 256  # codes a K step (4 groups of 64)
GROUP = 64
# A K step's codes [W rows, bytes]: lane l = 4 g + j holds rows g and g + 8 (16 more a
# warp) and bytes j and 4 + j of every 8 (the columns of wgmma's A fragment)
CODES = gl.DistributedLinearLayout(
    reg_bases=[[0, 4], [0, 8], [0, 16], [8, 0], [0, 32], [0, 64]],
    lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]],
    block_bases=[],
    shape=[W_ROWS, K_STEP // 2],
)
# The same bytes where each group's 32 are stored permuted (`permute_codes`): lane j's 8
# bytes of a group (bytes j and 4 + j of its 4 chunks) are contiguous, one 8-byte load
CODES_PERMUTED = gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0], [0, 32], [0, 64]],
    lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]],
    block_bases=[],
    shape=[W_ROWS, K_STEP // 2],
)
# the same by group: [W rows, groups a step, bytes a group]
CODES_BY_GROUP = gl.DistributedLinearLayout(
    reg_bases=[[0, 0, 4], [0, 0, 8], [0, 0, 16], [8, 0, 0], [0, 1, 0], [0, 2, 0]],
    lane_bases=[[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
    warp_bases=[[16, 0, 0], [32, 0, 0]],
    block_bases=[],
    shape=[W_ROWS, K_STEP // GROUP, GROUP // 2],
)


def permute_codes(codes: torch.Tensor) -> torch.Tensor:
    """int4-g64 codes [N, K / 2] with each group's 32 bytes reordered from (chunk c,
    half e, lane j), byte 8c + 4e + j, to (j, c, e): lane j's bytes made contiguous. A
    store format the probe measures beside `QTensor`'s (`CODES_PERMUTED`)."""
    n, half_k = codes.shape
    grouped = codes.reshape(n, half_k // 32, 4, 2, 4)
    return grouped.permute(0, 1, 4, 2, 3).contiguous().reshape(n, half_k)


# "Scales after the MMA" (`_qmm_scaled_kernel`): the codes in `permute_words`' order, as
# int32 words [W rows, 8 a group]: lane 4 g + j holds rows g and g + 8 (16 more a warp)
# and words 2 j and 2 j + 1 of every group
WORDS = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [8, 0], [0, 8], [0, 16]],
        lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]],
        block_bases=[],
        shape=[W_ROWS, 32],
    )
)
# one group's words, each spread over the 8 values the asm makes of it: [W rows, 8, 8]
WORD_VALUES = gl.constexpr(
    gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 1, 0], [8, 0, 0]],
        lane_bases=[[0, 2, 0], [0, 4, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16, 0, 0], [32, 0, 0]],
        block_bases=[],
        shape=[W_ROWS, 8, 8],
    )
)
# a word's 8 nibbles as wgmma A registers, each the float16 pair {1024 + code, 1024 +
# code}: nibbles k and k + 4 (bits 4 k and 16 + 4 k) by a shift and one lop3
_WORD_TO_A = gl.constexpr("""{
.reg .b32 t, mask, magic;
mov.b32 mask, 0x000F000F;
mov.b32 magic, 0x64006400;
lop3.b32 $0, $4, mask, magic, 0xEA;
shr.b32 t, $4, 4;
lop3.b32 $1, t, mask, magic, 0xEA;
shr.b32 t, $4, 8;
lop3.b32 $2, t, mask, magic, 0xEA;
shr.b32 t, $4, 12;
lop3.b32 $3, t, mask, magic, 0xEA;
}""")


def permute_words(codes: torch.Tensor) -> torch.Tensor:
    """int4-g64 codes [N, K / 2] (`QTensor`'s: column 2 b in byte b's low nibble) to the
    order `_qmm_scaled_kernel` reads: each group's 8 words, word 2 j + w holding
    wgmma's A columns for lane j of chunks 2 w and 2 w + 1, nibbles k and k + 4 one A
    register (a shift and a lop3 each)."""
    n, half_k = codes.shape
    values = torch.stack((codes & 0xF, codes >> 4), -1).reshape(n, half_k // 32, 64)
    p = torch.arange(64, device=codes.device)
    j, w, i = p // 16, p // 8 % 2, p % 8
    k = i % 4
    column = 16 * (2 * w + k // 2) + 8 * (k % 2) + 2 * j + i // 4
    ordered = values[:, :, column].reshape(n, half_k, 2)
    return (ordered[..., 0] | ordered[..., 1] << 4).to(torch.uint8)


@gluon.jit
def _a_operand(
    codes_slot, scale, low, a_layout: gl.constexpr, CODES_: gl.constexpr,
    BY_GROUP: gl.constexpr, PTX: gl.constexpr, PERMUTED: gl.constexpr,
):  # fmt: skip
    """A K step's codes tile (shared memory) dequantized into wgmma's A operand [W rows,
    STEP], with the step's scales and minimums [W rows, groups] (`BY_GROUP`'s slice)."""
    ROWS: gl.constexpr = codes_slot.shape[0]
    STEP_BYTES: gl.constexpr = codes_slot.shape[1]
    GROUPS: gl.constexpr = STEP_BYTES // 32
    codes = codes_slot.load(CODES_)
    if PERMUTED:  # back to QTensor's byte order, in the names only
        codes = gl.permute(gl.reshape(codes, [ROWS, GROUPS, 4, 4, 2]), [0, 1, 3, 4, 2])
    codes = gl.convert_layout(
        gl.reshape(codes, [ROWS, GROUPS, STEP_BYTES // GROUPS]), BY_GROUP, assert_trivial=True
    )
    even, odd = gl.inline_asm_elementwise(
        PTX, "=r,=r,=r,=r,r,r,r,r,r",
        [codes, gl.broadcast(scale[:, :, None], codes)[0],
         gl.broadcast(low[:, :, None], codes)[0]],
        dtype=(gl.float16, gl.float16), is_pure=False, pack=4,
    )  # fmt: skip
    w = gl.reshape(gl.join(even, odd), [ROWS, STEP_BYTES * 2])
    return gl.convert_layout(w, a_layout, assert_trivial=True)


@gluon.jit
def _load_step(c_desc, x_desc, bars, codes_smem, x_smem, slot, row0, step, pred):
    """TMA copies of K step `step`'s codes tile (W rows from row0) and x's tile into the
    ring's `slot`, completing on its mbarrier; nothing where pred is false."""
    nbytes: gl.constexpr = c_desc.block_type.nbytes + x_desc.block_type.nbytes
    mbarrier.expect(bars.index(slot), nbytes, pred=pred)
    _tma_load(
        c_desc, [row0, step * c_desc.block_type.shape[1]], bars.index(slot),
        codes_smem.index(slot), pred=pred,
    )  # fmt: skip
    _tma_load(
        x_desc, [0, step * x_desc.block_type.shape[1]], bars.index(slot), x_smem.index(slot),
        pred=pred,
    )  # fmt: skip


@gluon.jit
def _qmm_gluon_kernel(
    x_desc, c_desc, scale_ptr, min_ptr, partial_ptr, M, N,
    K: gl.constexpr, STAGES: gl.constexpr, PER_SPLIT: gl.constexpr,
    CODES_: gl.constexpr, BY_GROUP: gl.constexpr, PTX: gl.constexpr, PERMUTED: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    """Partial [split, M, N] (float32) of x @ dequantize(W)^T over this program's K range."""
    ROWS: gl.constexpr = c_desc.block_type.shape[0]
    STEP_BYTES: gl.constexpr = c_desc.block_type.shape[1]
    X_ROWS: gl.constexpr = x_desc.block_type.shape[0]
    STEP: gl.constexpr = x_desc.block_type.shape[1]
    GROUPS: gl.constexpr = STEP // 64
    n0 = gl.program_id(0) * ROWS
    first = gl.program_id(1) * PER_SPLIT
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, X_ROWS, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    codes_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, ROWS, STEP_BYTES], c_desc.layout)
    x_smem = gl.allocate_shared_memory(gl.float16, [STAGES, X_ROWS, STEP], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(STAGES - 1):  # the ring's first steps
        _load_step(c_desc, x_desc, bars, codes_smem, x_smem, s, n0, first + s, s < PER_SPLIT)
    by_row: gl.constexpr = gl.SliceLayout(2, BY_GROUP)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, by_row))
    groups = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, by_row))
    params = (n0 + rows)[:, None] * (K // 64) + first * GROUPS + groups[None, :]
    scale = gl.load(scale_ptr + params)
    low = gl.load(min_ptr + params)
    acc = gl.zeros((ROWS, X_ROWS), dtype=gl.float32, layout=mma)
    for i in range(PER_SPLIT):
        slot = i % STAGES
        # the next step's scales and minimums, while this step waits and computes
        ahead = gl.minimum(i + 1, PER_SPLIT - 1) * GROUPS
        next_scale = gl.load(scale_ptr + params + ahead)
        next_low = gl.load(min_ptr + params + ahead)
        mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
        a = _a_operand(
            codes_smem.index(slot), scale, low, a_layout, CODES_, BY_GROUP, PTX, PERMUTED
        )
        acc = warpgroup_mma(a, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
        # the wgmma of step i - 1 is done: its slot takes step i + STAGES - 1
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        _barrier()  # every warp's reads of that slot done,
        fence_async_shared()  # and ordered before the copy engine's writes
        refill = i + STAGES - 1
        _load_step(
            c_desc, x_desc, bars, codes_smem, x_smem, refill % STAGES, n0, first + refill,
            refill < PER_SPLIT,
        )  # fmt: skip
        scale = next_scale
        low = next_low
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
    out: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [num_warps, 1], [0, 1])
    result = gl.convert_layout(acc, out)  # [W rows, x rows]
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, out))
    c = gl.arange(0, X_ROWS, layout=gl.SliceLayout(0, out))
    offsets = gl.program_id(1) * M * N + c[None, :] * N + (n0 + r)[:, None]
    gl.store(partial_ptr + offsets, result, mask=(c < M)[None, :])


@gluon.jit
def _qmm_stream_kernel(
    x_desc, c_desc, scale_ptr, min_ptr, out_ptr, M, N,
    K: gl.constexpr, STAGES: gl.constexpr,
    CODES_: gl.constexpr, BY_GROUP: gl.constexpr, PTX: gl.constexpr, PERMUTED: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    """x @ dequantize(W)^T added into out [M, N] (float32, zeroed), persistent: the
    (W row block, K step) pairs, K fastest, are divided evenly among the programs, each
    a contiguous run through one ring; a program adds its sum over a block's steps when
    it leaves the block (stream-K, so no wave of programs runs partly empty)."""
    ROWS: gl.constexpr = c_desc.block_type.shape[0]
    STEP_BYTES: gl.constexpr = c_desc.block_type.shape[1]
    X_ROWS: gl.constexpr = x_desc.block_type.shape[0]
    STEP: gl.constexpr = x_desc.block_type.shape[1]
    GROUPS: gl.constexpr = STEP // 64
    STEPS: gl.constexpr = K // STEP
    total = N // ROWS * STEPS
    start = gl.program_id(0) * total // gl.num_programs(0)
    count = (gl.program_id(0) + 1) * total // gl.num_programs(0) - start
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, X_ROWS, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    codes_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, ROWS, STEP_BYTES], c_desc.layout)
    x_smem = gl.allocate_shared_memory(gl.float16, [STAGES, X_ROWS, STEP], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(STAGES - 1):  # the ring's first steps
        u = start + s
        _load_step(
            c_desc, x_desc, bars, codes_smem, x_smem, s, u // STEPS * ROWS, u % STEPS, s < count
        )
    by_row: gl.constexpr = gl.SliceLayout(2, BY_GROUP)
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, by_row))
    groups = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, by_row))
    # (row block, step) u's scales are at params + u // STEPS * ROWS * (K // 64) + u % STEPS * GROUPS
    params = rows[:, None] * (K // 64) + groups[None, :]
    block_params: gl.constexpr = ROWS * (K // 64)
    at = start // STEPS * block_params + start % STEPS * GROUPS
    scale = gl.load(scale_ptr + params + at)
    low = gl.load(min_ptr + params + at)
    acc = gl.zeros((ROWS, X_ROWS), dtype=gl.float32, layout=mma)
    for i in range(count):
        u = start + i
        step = u % STEPS
        slot = i % STAGES
        ahead = gl.minimum(u + 1, start + count - 1)
        at = ahead // STEPS * block_params + ahead % STEPS * GROUPS
        next_scale = gl.load(scale_ptr + params + at)
        next_low = gl.load(min_ptr + params + at)
        mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
        a = _a_operand(
            codes_smem.index(slot), scale, low, a_layout, CODES_, BY_GROUP, PTX, PERMUTED
        )
        acc = warpgroup_mma(
            a, x_smem.index(slot).permute((1, 0)), acc, use_acc=step != 0, is_async=True
        )
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        _barrier()
        fence_async_shared()
        refill = i + STAGES - 1
        v = start + refill
        _load_step(
            c_desc, x_desc, bars, codes_smem, x_smem, refill % STAGES, v // STEPS * ROWS,
            v % STEPS, refill < count,
        )  # fmt: skip
        if (step == STEPS - 1) | (i == count - 1):  # leaving the block: add its sum
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma)) + u // STEPS * ROWS
            c = gl.arange(0, X_ROWS, layout=gl.SliceLayout(0, mma))
            offsets = c[None, :] * N + r[:, None]
            gl.atomic_add(out_ptr + offsets, acc, mask=(c < M)[None, :], sem="relaxed")
        scale = next_scale
        low = next_low
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))


@gluon.jit
def _group_values(words, grp: gl.constexpr, a_layout: gl.constexpr):
    """Group grp's words (of a step's [W rows, 32]) as wgmma's A operand [W rows, 64]:
    the float16 values 1024 + code."""
    ROWS: gl.constexpr = words.shape[0]
    t = gl.permute(gl.reshape(words, [ROWS, 4, 8]), [0, 2, 1])
    t = gl.reshape(t, [ROWS, 8, 2, 2])  # [rows, word, group // 2, group % 2]
    t0, t1 = gl.split(t)
    t = t1 if grp % 2 else t0
    t0, t1 = gl.split(t)
    t = t1 if grp // 2 else t0
    t = gl.convert_layout(t, gl.SliceLayout(2, WORD_VALUES))
    t = gl.broadcast(gl.expand_dims(t, 2), gl.full([ROWS, 8, 8], 0, gl.int32, WORD_VALUES))[0]
    v = gl.inline_asm_elementwise(
        _WORD_TO_A, "=r,=r,=r,=r,r,r,r,r,r,r,r,r", [t], dtype=gl.float16, is_pure=True, pack=8
    )
    # [rows, word 2 j + w, 2 k + h] to A's columns 16 (2 w + k // 2) + 8 (k % 2) + 2 j + h
    v = gl.reshape(v, [ROWS, 4, 2, 2, 2, 2])  # [rows, j, w, k // 2, k % 2, h]
    v = gl.reshape(gl.permute(v, [0, 2, 3, 4, 1, 5]), [ROWS, 64])
    return gl.convert_layout(v, a_layout)


@gluon.jit
def _group_of(t, grp: gl.constexpr):
    """Column grp of t [rows, 4] (the 4 in each thread's registers)."""
    t0, t1 = gl.split(gl.reshape(t, [t.shape[0], 2, 2]))  # [rows, group // 2], by group % 2
    t = t1 if grp % 2 else t0
    t0, t1 = gl.split(t)
    return t1 if grp // 2 else t0


@gluon.jit
def _add_group(total, product, scales, biases, sums, g: gl.constexpr):
    """total + group g's scale x product + its bias x the group's sum of x (the bias:
    minimum - 1024 scale, for the 1024 in every value the product multiplied)."""
    mma: gl.constexpr = total.type.layout
    scale = gl.convert_layout(_group_of(scales, g), gl.SliceLayout(1, mma))
    bias = gl.convert_layout(_group_of(biases, g), gl.SliceLayout(1, mma))
    xsum = gl.convert_layout(_group_of(sums, g), gl.SliceLayout(0, mma))
    total = gl.fma(product, scale[:, None], total)
    return gl.fma(bias[:, None], xsum[None, :], total)


@gluon.jit
def _group_product(words, x_slot, g: gl.constexpr, a_layout: gl.constexpr, zero):
    """The asynchronous wgmma of group g's values (1024 + code) by x's columns of it."""
    a = _group_values(words, g, a_layout)
    b = x_slot.slice(g * 64, 64, dim=1).permute((1, 0))
    return warpgroup_mma(a, b, zero, use_acc=False, is_async=True)


@gluon.jit
def _load_scaled_step(descs, ring, bars, slot, row0, step, pred):
    """TMA copies of K step `step`'s tiles (W's codes from row0, x, W's scales and
    minimums from row0, x's group sums) into the ring's `slot`, on its mbarrier."""
    c_desc, x_desc, p_desc, s_desc = descs
    codes_smem, x_smem, p_smem, s_smem = ring
    nbytes: gl.constexpr = (
        c_desc.block_type.nbytes + x_desc.block_type.nbytes + p_desc.block_type.nbytes
        + s_desc.block_type.nbytes
    )  # fmt: skip
    bar = bars.index(slot)
    mbarrier.expect(bar, nbytes, pred=pred)
    _tma_load(c_desc, [row0, step * 32], bar, codes_smem.index(slot), pred=pred)
    _tma_load(x_desc, [0, step * x_desc.block_type.shape[1]], bar, x_smem.index(slot), pred=pred)
    _tma_load(p_desc, [row0, step * 8], bar, p_smem.index(slot), pred=pred)
    _tma_load(s_desc, [0, step * 4], bar, s_smem.index(slot), pred=pred)


@triton.jit
def _group_sums_kernel(x_ptr, sums_ptr, K: tl.constexpr, BLOCK: tl.constexpr):
    """sums [M, K / 64] (float32) of x [M, K] over each group of 64; a program a row and
    BLOCK groups."""
    groups = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = groups < K // 64
    offsets = tl.program_id(0) * K + groups[:, None] * 64 + tl.arange(0, 64)[None, :]
    x = tl.load(x_ptr + offsets, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(sums_ptr + tl.program_id(0) * (K // 64) + groups, tl.sum(x, axis=1), mask=ok)


def group_sums(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] (contiguous) summed over each group of 64 columns: [M, K / 64], float32."""
    m, k = x.shape
    sums = torch.empty((m, k // GROUP), dtype=torch.float32, device=x.device)
    _group_sums_kernel[(m, triton.cdiv(k // GROUP, 16))](x, sums, k, 16)
    return sums


def _by_col(x_rows: int):
    """A step's x sums [x rows, groups] as `_qmm_scaled_kernel` reads them: each thread
    those of its accumulator columns (2 j, 2 j + 1, and 8 and 16 on where there are)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [1, 0]] + [[8 * r, 0] for r in (1, 2) if 8 * r < x_rows],
        lane_bases=[[2, 0], [4, 0], [0, 0], [0, 0], [0, 0]],
        warp_bases=[[0, 0], [0, 0]],
        block_bases=[],
        shape=[x_rows, K_STEP // GROUP],
    )


@gluon.jit
def _qmm_scaled_kernel(
    x_desc, c_desc, p_desc, s_desc, out_ptr, partial_ptr, count_ptr, M, N,
    K: gl.constexpr, STAGES: gl.constexpr, PER_SPLIT: gl.constexpr, BY_COL: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    """out [M, N] (float16) = x @ dequantize(W)^T, with each group's scale applied after
    the MMA: wgmma multiplies x by the float16 values 1024 + code (two instructions a
    word of 8 codes), and a group's product P adds scale P + (minimum - 1024 scale)
    sum(x over the group) to a float32 sum.

    A K step's tiles come by TMA: W's codes (`permute_words`' int32 words), x, W's
    scales and minimums interleaved [N, K / 64 x 2] (float16) and x's sums over each
    group [M, K / 64] (float32, `group_sums`). Split-K as
    `qmatmul`'s: each program stores its partial [M, N] (float32), and the last to
    arrive at its tile's counter adds them in split order."""
    ROWS: gl.constexpr = c_desc.block_type.shape[0]
    X_ROWS: gl.constexpr = x_desc.block_type.shape[0]
    STEP: gl.constexpr = x_desc.block_type.shape[1]
    GROUPS: gl.constexpr = STEP // 64
    n0 = gl.program_id(0) * ROWS
    first = gl.program_id(1) * PER_SPLIT
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, X_ROWS, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    descs = (c_desc, x_desc, p_desc, s_desc)
    ring = (
        gl.allocate_shared_memory(gl.int32, [STAGES, ROWS, 32], c_desc.layout),
        gl.allocate_shared_memory(gl.float16, [STAGES, X_ROWS, STEP], x_desc.layout),
        gl.allocate_shared_memory(gl.float16, [STAGES, ROWS, 2 * GROUPS], p_desc.layout),
        gl.allocate_shared_memory(gl.float32, [STAGES, X_ROWS, GROUPS], s_desc.layout),
    )
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    for s in gl.static_range(STAGES):  # the ring's first steps
        _load_scaled_step(descs, ring, bars, s, n0, first + s, s < PER_SPLIT)
    # a step's scales and minimums [W rows, (scale, minimum) x groups] and x's sums [x
    # rows, groups] (`_by_col`), each thread's those of its accumulator rows (columns):
    # splitting the groups off leaves the accumulator's row (column) layout
    by_row: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
        lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]],
        block_bases=[],
        shape=[ROWS, 2 * GROUPS],
    )
    zero = gl.zeros((ROWS, X_ROWS), dtype=gl.float32, layout=mma)
    total = zero
    for i in range(PER_SPLIT):
        slot = i % STAGES
        mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
        sums = ring[3].index(slot).load(BY_COL)
        words = ring[0].index(slot).load(WORDS)
        x_slot = ring[1].index(slot)
        params = gl.reshape(ring[2].index(slot).load(by_row), [ROWS, GROUPS, 2])
        scales, lows = gl.split(params.to(gl.float32))
        biases = lows - 1024.0 * scales
        # each group's product is added in while the next group's is computed; none is
        # in flight past the step (ptxas serializes every wgmma if registers of one in
        # flight are read, which the loop's carried values would be)
        previous = _group_product(words, x_slot, 0, a_layout, zero)
        for g in gl.static_range(1, GROUPS):
            product = _group_product(words, x_slot, g, a_layout, zero)
            product, previous = warpgroup_mma_wait(num_outstanding=1, deps=(product, previous))
            total = _add_group(total, previous, scales, biases, sums, g - 1)
            previous = product
        previous = warpgroup_mma_wait(num_outstanding=0, deps=(previous,))
        total = _add_group(total, previous, scales, biases, sums, GROUPS - 1)
        # every wgmma of step i is done: its slot takes step i + STAGES
        _barrier()
        fence_async_shared()
        refill = i + STAGES
        _load_scaled_step(descs, ring, bars, slot, n0, first + refill, refill < PER_SPLIT)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
    rows = n0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
    cols = gl.arange(0, X_ROWS, layout=gl.SliceLayout(0, mma))
    offsets = cols[None, :] * N + rows[:, None]
    ok = (cols < M)[None, :]
    splits = gl.num_programs(1)
    if splits == 1:
        gl.store(out_ptr + offsets, total.to(gl.float16), mask=ok)
    else:
        gl.store(partial_ptr + gl.program_id(1) * M * N + offsets, total, mask=ok)
        _barrier()  # every thread's partial stored before the release below
        tile = count_ptr + gl.program_id(0)
        if gl.atomic_add(tile, 1, sem="acq_rel") == splits - 1:
            total = zero
            for part in range(splits):  # in split order: the same sum whoever arrives last
                total += gl.load(
                    partial_ptr + part * M * N + offsets, mask=ok, other=0.0, cache_modifier=".cg"
                )
            gl.atomic_xchg(tile, 0)
            gl.store(out_ptr + offsets, total.to(gl.float16), mask=ok)


def _descriptors(x, codes, x_rows):
    """TMA descriptors of x's tiles [x_rows, K_STEP] and W's codes tiles (a K step of
    W_ROWS rows: bytes, or int32 words for `_qmm_scaled_kernel`)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    codes_box = [W_ROWS, K_STEP // 2 // codes.element_size()]
    codes_type = gl.int32 if codes.dtype == torch.int32 else gl.uint8
    c_layout = gl.NVMMASharedLayout.get_default_for(codes_box, codes_type)
    x_layout = gl.NVMMASharedLayout.get_default_for([x_rows, K_STEP], gl.float16)
    return (
        TensorDescriptor.from_tensor(x, [x_rows, K_STEP], x_layout),
        TensorDescriptor.from_tensor(codes, codes_box, c_layout),
    )


def _splits(wanted: int, steps: int) -> int:
    """The programs K is divided among: the largest divisor of the K steps up to wanted
    (`qmatmul.qlinear`'s rule)."""
    return max(d for d in range(1, min(wanted, steps) + 1) if steps % d == 0)


def gluon_qlinear(
    x: torch.Tensor,
    w,
    split: int,
    stages: int = 3,
    reduce: bool = True,
    permuted: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M <= 32, K] fp16 @ dequantize(w)^T for int4-g64 asymmetric w. reduce=False:
    the split-K partials [split, M, N] unsummed (the kernel's time alone); permuted: w's
    codes as `permute_codes` gives them, read instead of w's."""
    n, k = w.shape
    m = x.shape[0]
    assert m <= 32 and n % W_ROWS == 0 and k % K_STEP == 0 and w.config.group_size == GROUP
    steps = k // K_STEP
    split = _splits(split, steps)
    codes = w.codes.view(n, k // 2) if permuted is None else permuted
    x_desc, c_desc = _descriptors(x, codes, 16 if m <= 16 else 32)
    out = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    _qmm_gluon_kernel[(n // W_ROWS, split)](
        x_desc, c_desc, w.scale, w.minimum, out, m, n, k, stages, steps // split,
        CODES if permuted is None else CODES_PERMUTED, CODES_BY_GROUP,
        _NIBBLES_ASYMMETRIC.value, permuted is not None, num_warps=4,
    )  # fmt: skip
    return out.sum(0).to(x.dtype) if reduce else out


def scaled_format(w) -> tuple[torch.Tensor, torch.Tensor]:
    """w's codes and parameters in the store format `_qmm_scaled_kernel` reads: the codes
    in `permute_words`' order, and each row's scales and minimums interleaved."""
    n = w.shape[0]
    params = torch.stack((w.scale, w.minimum), -1).view(n, -1)
    return permute_words(w.codes.view(n, -1)), params


# programs an SM by wgmma's N (x's rows in a tile), as shared memory and registers allow
SCALED_PER_SM = {8: 5, 16: 4, 32: 2}


def scaled_split(m: int, n: int, k: int, device: torch.device) -> int:
    """The programs K is divided among for each of `_qmm_scaled_kernel`'s tiles: the most
    that keep every program in one wave (at least 1). Measured on the H100 (run
    145213): OPT-30B's qkv read 76-78% of HBM at 1-16 rows unsplit (336 programs), 58-65%
    split in 2 (1.3 waves); its mlp_out 70-76% split in 4 (448 programs), 60-66% unsplit."""
    x_rows = 8 if m <= 8 else 16 if m <= 16 else 32
    slots = SCALED_PER_SM[x_rows] * sm_count(device)
    return _splits(max(1, slots // (n // W_ROWS)), k // K_STEP)


def gluon_scaled_qlinear(
    x: torch.Tensor,
    w,
    split: int | None,
    stored: tuple[torch.Tensor, torch.Tensor],
    stages: int = 3,
    sums: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M <= 32, K] fp16 (contiguous) @ dequantize(w)^T by `_qmm_scaled_kernel`, from
    w as `scaled_format` stores it, K split among up to `split` programs a tile (None:
    `scaled_split`); sums: x's `group_sums`, where made before (else here)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    n, k = w.shape
    m = x.shape[0]
    assert m <= 32 and n % W_ROWS == 0 and k % K_STEP == 0 and w.config.group_size == GROUP
    assert x.is_contiguous()
    steps = k // K_STEP
    split = _splits(split or scaled_split(m, n, k, x.device), steps)
    x_rows = 8 if m <= 8 else 16 if m <= 16 else 32  # wgmma's N
    words, params = stored
    x_desc, c_desc = _descriptors(x, words.view(torch.int32), x_rows)
    p_box = [W_ROWS, 2 * K_STEP // GROUP]
    p_layout = gl.NVMMASharedLayout.get_default_for(p_box, gl.float16)
    p_desc = TensorDescriptor.from_tensor(params, p_box, p_layout)
    s_box = [x_rows, K_STEP // GROUP]
    s_layout = gl.NVMMASharedLayout.get_default_for(s_box, gl.float32)
    s_desc = TensorDescriptor.from_tensor(group_sums(x) if sums is None else sums, s_box, s_layout)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    partial = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    counts = arrival_counters("gluon_qlinear", x.device, n // W_ROWS)
    _qmm_scaled_kernel[(n // W_ROWS, split)](
        x_desc, c_desc, p_desc, s_desc, out, partial, counts, m, n, k, stages, steps // split,
        _by_col(x_rows), num_warps=4, maxnreg=128 if x_rows <= 16 else None,  # 4 programs an SM
    )  # fmt: skip
    return out


def gluon_stream_qlinear(
    x: torch.Tensor,
    w,
    stages: int = 3,
    per_sm: int = 4,
    permuted: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M <= 32, K] fp16 @ dequantize(w)^T by `_qmm_stream_kernel`, per_sm programs an
    SM (each held to 65536 / 128 / per_sm registers a thread, so all are resident),
    converted to x's dtype. out: a float32 [M, N] buffer to add into as it is (the
    kernel's time alone; returned unconverted)."""
    n, k = w.shape
    m = x.shape[0]
    assert m <= 32 and n % W_ROWS == 0 and k % K_STEP == 0 and w.config.group_size == GROUP
    codes = w.codes.view(n, k // 2) if permuted is None else permuted
    x_desc, c_desc = _descriptors(x, codes, 16 if m <= 16 else 32)
    alone = out is not None
    if out is None:
        out = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    programs = min(per_sm * sm_count(x.device), n // W_ROWS * (k // K_STEP))
    _qmm_stream_kernel[(programs,)](
        x_desc, c_desc, w.scale, w.minimum, out, m, n, k, stages,
        CODES if permuted is None else CODES_PERMUTED, CODES_BY_GROUP,
        _NIBBLES_ASYMMETRIC.value, permuted is not None, num_warps=4,
        maxnreg=min(255, 65536 // 128 // per_sm // 8 * 8),
    )  # fmt: skip
    return out if alone else out.to(x.dtype)


def compile_only(k: int = 7168, stages: int = 3, dump: Path | None = None) -> None:
    """The kernels for sm_90 without a GPU: shared memory, registers and the SASS
    (written to dump, a folder, where given)."""
    import subprocess

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    variants = [(_qmm_gluon_kernel, 16, False), (_qmm_gluon_kernel, 32, False)]
    variants += [(kernel, 16, True) for kernel in (_qmm_gluon_kernel, _qmm_stream_kernel)]
    variants += [(_qmm_scaled_kernel, x_rows, True) for x_rows in (8, 16, 32)]
    for kernel, x_rows, permuted in variants:
        names = kernel.arg_names
        words = kernel is _qmm_scaled_kernel
        box, kind = ([W_ROWS, 32], "i32") if words else ([W_ROWS, K_STEP // 2], "u8")
        c_layout = gl.NVMMASharedLayout.get_default_for(box, gl.int32 if words else gl.uint8)
        x_layout = gl.NVMMASharedLayout.get_default_for([x_rows, K_STEP], gl.float16)
        signature = {
            "x_desc": f"tensordesc<fp16[{x_rows}, {K_STEP}],{x_layout!r}>",
            "c_desc": f"tensordesc<{kind}[{box[0]}, {box[1]}],{c_layout!r}>",
            "scale_ptr": "*fp16", "min_ptr": "*fp16", "xsum_ptr": "*fp32",
            "partial_ptr": "*fp32", "out_ptr": "*fp16" if words else "*fp32",
            "M": "i32", "N": "i32",
        }  # fmt: skip
        p_layout = gl.NVMMASharedLayout.get_default_for([W_ROWS, 8], gl.float16)
        signature["p_desc"] = f"tensordesc<fp16[{W_ROWS}, 8],{p_layout!r}>"
        s_layout = gl.NVMMASharedLayout.get_default_for([x_rows, 4], gl.float32)
        signature["s_desc"] = f"tensordesc<fp32[{x_rows}, 4],{s_layout!r}>"
        signature["count_ptr"] = "*i32"
        constexprs = {
            "K": k, "STAGES": stages, "PER_SPLIT": k // K_STEP // 2,
            "CODES_": CODES_PERMUTED if permuted else CODES, "BY_GROUP": CODES_BY_GROUP,
            "PTX": _NIBBLES_ASYMMETRIC.value, "PERMUTED": permuted, "BY_COL": _by_col(x_rows),
            "num_warps": 4,
        }  # fmt: skip
        constexprs = {name: value for name, value in constexprs.items() if name in names}
        signature.update({name: "constexpr" for name in constexprs})
        aligned = ("scale_ptr", "min_ptr", "x_ptr", "partial_ptr", "out_ptr", "count_ptr", "N")
        aligned = [a for a in aligned if a in names]
        source = GluonASTSource(
            fn=kernel,
            signature={name: signature[name] for name in names},
            constexprs=constexprs,
            attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned},
        )
        compiled = triton.compile(
            source,
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": 4, "maxnreg": 128 if x_rows <= 16 else None},
        )
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            sass, usage = (
                subprocess.run(
                    [bin_dir / tool, *flags, f.name], capture_output=True, text=True, check=True
                ).stdout
                for tool, flags in (("nvdisasm", ["-c"]), ("cuobjdump", ["--dump-resource-usage"]))
            )
        if dump is not None:
            name = f"{kernel.fn.__name__}_{x_rows}{'_permuted' if permuted else ''}.sass"
            dump.mkdir(parents=True, exist_ok=True)
            (dump / name).write_text(sass)
        loop = _k_loop(sass)
        mix = dict(collections.Counter(op.split(".")[0] for op in loop).most_common(12))
        resources = " ".join(re.findall(r"REG:\d+|STACK:\d+", usage))
        print(
            f"{kernel.fn.__name__}, x rows {x_rows}{', permuted codes' if permuted else ''}: "
            f"shared {compiled.metadata.shared} B, {resources}; the K loop: "
            f"{len(loop)} instructions, {len(loop) / 64:.2f} a code byte a thread, {mix}"
        )


def _k_loop(sass: str) -> list[str]:
    """The opcodes of the innermost loop that issues wgmma (a label to a branch back)."""
    ops: list[str] = []
    labels: dict[str, int] = {}
    loops = []
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_\w+):", line)
        if label:
            labels[label.group(1)] = len(ops)
            continue
        instruction = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", line)
        if instruction:
            ops.append(instruction.group(1))
            target = re.search(r"(\.L_\w+)", instruction.group(2))
            if ops[-1].startswith("BRA") and target and target.group(1) in labels:
                loops.append(ops[labels[target.group(1)] :])
    with_mma = [loop for loop in loops if any(op.startswith("HGMMA") for op in loop)]
    return min(with_mma, key=len) if with_mma else []


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,16,32")
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--splits", default="", help="the scaled kernel at these splits as well")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--dump", type=Path, help="with --compile-only: a folder for the SASS")
    p.add_argument(
        "--profile", action="store_true",
        help="run each kernel 3 times on the first matrix and row count, untimed, for a profiler",
    )  # fmt: skip
    args = p.parse_args()
    if args.compile_only:
        compile_only(stages=args.stages, dump=args.dump)
        return
    from bench_kernels import hbm_rate, int4_probe_cases, print_beside, time_beside

    from offload.bench import Results
    from offload.kernels import qmatmul

    dev = torch.device("cuda")
    hbm = hbm_rate(dev)
    results = Results(
        "int4_gluon_probe",
        {"device": torch.cuda.get_device_name(), "triton": triton.__version__,
         "hbm_copy_gbps": hbm, "stages": args.stages, "rows": []},
        args.out,
    )  # fmt: skip
    for record, x, q, reference, read in int4_probe_cases(dev, map(int, args.rows.split(","))):
        (m, k), n = x.shape, q.shape[0]
        split = qmatmul._tiles(m, n, k, GROUP, dev).split
        order = permute_codes(q.codes.view(n, -1))
        split_k = functools.partial(gluon_qlinear, x, q, split, args.stages, False, order)
        stored = scaled_format(q)
        scaled = functools.partial(gluon_scaled_qlinear, x, q, None, stored)
        calls = {
            "ours": functools.partial(qmatmul.qlinear, x, q),
            "split-K kernel": split_k,
            "scaled": functools.partial(scaled, args.stages),
            "scaled, 4 stages": functools.partial(scaled, 4),
        }
        for other in map(int, filter(None, args.splits.split(","))):
            calls[f"scaled, split {other}"] = functools.partial(
                gluon_scaled_qlinear, x, q, other, stored, args.stages
            )
        record["split"] = _splits(split, k // K_STEP)
        record["scaled_split"] = scaled_split(m, n, k, dev)
        outputs = {"split-K kernel": lambda f=split_k: f().sum(0)}
        if args.profile:
            for call in calls.values():
                for _ in range(3):
                    call()
            torch.cuda.synchronize()
            return
        record.update(time_beside(calls, reference, read, hbm, outputs))
        results.data["rows"].append(record)
        results.save()
    print_beside(results.data["rows"], tuple(calls), hbm)


if __name__ == "__main__":
    main()
