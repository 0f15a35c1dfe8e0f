"""Decode attention over an int4 KV cache with both products on the tensor cores and both
operands made in registers.

`kv_attention.decode_attention` sends here float16 q over a cache of int4-g64 asymmetric
K and V with 128 channels a head and at most 8 query heads a KV head, on a GPU with
mma.sync (sm_80 and later). The Triton kernel dequantizes K and V in registers too, but
tl.dot then takes its operands through shared memory: on the H100 that round trip, not
HBM, set its time (docs/throughput.md: L1 throughput 76% against DRAM 33%). Here only
the codes pass through shared memory (cp.async, a group ahead), about a fifth of the
bytes.

One warp takes a (sequence, KV head, run of whole token groups: `split_groups`), a group
(64 tokens) a loop step:

- **Scores** S [64 tokens (the MMA's rows), 8 query heads] = K [64, 128 channels] (the A
  operand) times q^T [128, 8] (the B operand, loaded once): 32 MMAs a group, none on
  padding rows. An A register holds channels c and c + 1 of one token, where a byte of
  the cache holds two tokens of one channel: a prmt takes the same byte of channel c's
  and c + 1's words, and a lop3 makes each nibble pair a float16 pair 1024 + code (a
  high nibble, left in place, 1024 + 16 code: times 1/16, less 64), less 1024, then
  times the channels' scales plus their minimums (`_words_to_values`: 14 instructions
  for 8 pairs). Lane 4 g + j reads word g (tokens 8 g .. 8 g + 7) of its channels, so
  the MMA's row 8 nt + g is token 8 g + nt.
- **Values**: O [128 channels (the A operand's rows), 8 query heads] += V^T [128, 64
  tokens] times P [64, 8] (the B operand). P is the scores' accumulator with each 8 x 8
  block transposed by a movmatrix (8 a group), so the MMA's K index of a token is the
  scores' row of it. An A register holds tokens t and t + 8 of one channel, where a
  byte holds two channels of one token: the same asm, with the pair of the two tokens'
  scales and minimums made inside it (made once outside, ptxas copied each pair again
  for each use, short of registers).
- Online softmax by query head, in base 2. The row's last split also attends the tail
  (the incomplete group's float16 tokens, read as the operands), and the row's last
  program to finish merges the splits' partials in split order: one launch a call.

Written in Triton's Gluon dialect (explicit layouts, cp.async, mma_v2), which has no CPU
interpreter: the GPU tests check it against the float64 SDPA of the dequantized cache.
"""

from __future__ import annotations

import math

import torch

from offload.kernels.kv_cache import QuantKV
from offload.kernels.launch import INTERPRETED, Launcher, arrival_counters, sm_count

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
except ImportError:  # no Triton, or one without Gluon: the Triton kernel serves
    gluon = None

GROUP = 64  # tokens a K group (and channels a V group)
HEAD_DIM = 128
MAX_REP = 8  # query heads a KV head: the values' MMA has N = 8
# a thread's registers (None: ptxas's choice, 255 on sm_90) and the one-warp programs an
# SM that they allow (65536 registers an SM)
REGISTERS: int | None = None
PER_SM = 8
# groups a program's ring holds in shared memory: the one attended and STAGES - 1
# arriving (one program's copies in flight)
STAGES = 2
# splits a row considered (each adds its partial to the merge)
MAX_SPLITS = 16
# a program's time besides its groups' (q, the first group's copies, the tail, the
# partials and the merge), in groups' time: `split_groups`'s cost model. With 1.5 (or 1
# or 2) it picks the fastest split measured on each of six shapes (docs/throughput.md);
# with none it chose the slower on four of them.
PROGRAM_GROUPS = 1.5
LOG2E = 1.4426950408889634


def eligible(q: torch.Tensor, cache: QuantKV) -> bool:
    """Whether `decode_attention` takes this kernel for q [B, H, 1, D] over cache."""
    cfg, values = cache.config, cache.value_config
    heads, dim = q.shape[1], q.shape[3]
    kv_heads = cache.k_codes.shape[1]
    return (
        gluon is not None
        and q.is_cuda
        and not INTERPRETED
        and torch.cuda.get_device_capability(q.device)[0] >= 8
        and q.dtype == torch.float16
        and dim == HEAD_DIM
        and heads % kv_heads == 0
        and heads // kv_heads <= MAX_REP
        and cfg.bits == 4
        and not cfg.symmetric
        and cfg.group_size == GROUP
        and values.bits == 4
        and not values.symmetric
        and values.group_size == GROUP
        and cache.k_codes.is_contiguous()
        and cache.v_codes.is_contiguous()
    )


def split_groups(
    rows: int, full_groups: int, device: torch.device, fixed: float | None = None
) -> int:
    """Groups a program takes: the split of each of rows (sequence, KV head) pairs' full
    groups whose waves of programs (`PER_SM` an SM) take the least time, the fewest
    splits where several tie. A program takes its groups' time plus `fixed` groups'
    (None: `PROGRAM_GROUPS`), so a second wave that is half full costs as much as a
    full one."""
    fixed = PROGRAM_GROUPS if fixed is None else fixed
    slots = PER_SM * sm_count(device)
    best, best_cost = 1, math.inf
    for splits in range(1, min(full_groups, MAX_SPLITS) + 1):
        groups = -(-full_groups // splits)
        cost = -(-rows * -(-full_groups // groups) // slots) * (groups + fixed)
        if cost < best_cost:
            best, best_cost = groups, cost
    return best


def decode_attention_mma(
    q: torch.Tensor,
    cache: QuantKV,
    bias: torch.Tensor,
    end: int,
    out: torch.Tensor,
    groups: int | None = None,
) -> torch.Tensor:
    """Attention of q [B, H, 1, 128] over slots 0 .. end - 1 of cache (`eligible`) into out
    [B, 1, H x 128] (float16): one launch. Programs take groups whole groups each (None:
    `split_groups`), the last of a row the tail too; the row's last program to finish
    merges the splits."""
    batch, heads, _, dim = q.shape
    kv_heads = cache.k_codes.shape[1]
    full_groups = end // GROUP
    if groups is None:
        groups = split_groups(batch * kv_heads, full_groups, q.device)
    splits = max(1, -(-full_groups // groups))
    part_acc = torch.empty((batch, heads, splits, dim), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((2, batch, heads, splits), dtype=torch.float32, device=q.device)
    per_head = bias.shape[1] > 1
    _launch(
        (batch, kv_heads, splits), 1,
        q, q.stride(0), q.stride(1),
        bias, bias.stride(0), bias.stride(1) if per_head else 0, bias.stride(3),
        cache.k_codes, cache.k_scale, cache.k_min, cache.k_tail,
        cache.v_codes, cache.v_scale, cache.v_min, cache.v_tail,
        part_acc, part_ml, part_ml[1], out, arrival_counters("attention", q.device, batch * kv_heads),
        full_groups, end % GROUP, cache.k_codes.shape[2], cache.v_codes.shape[2], splits,
        groups, LOG2E / math.sqrt(dim),
        heads // kv_heads, STAGES,  # REP, STAGES
        registers=REGISTERS,
    )  # fmt: skip
    return out


if gluon is not None:
    _D = gl.constexpr(HEAD_DIM)
    _LOG2E = gl.constexpr(LOG2E)
    MMA = gl.constexpr(
        gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])
    )
    A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=2))
    B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA.value, k_width=2))
    # shared memory, rows as in global memory
    # (of a stage: a ring's first dimension)
    ROWS_1D = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ROWS_2D = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))

    def _one_warp(reg_bases, lane_bases, shape):
        """The linear layout of one warp's registers and lanes over shape."""
        return gl.DistributedLinearLayout(
            reg_bases=reg_bases, lane_bases=lane_bases, warp_bases=[], block_bases=[], shape=shape
        )

    # the tail's [64 tokens, 128 channels] (float16): 8 a thread
    TAIL = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0]))
    # the merge's [8 query heads, 128 channels]
    MERGE = gl.constexpr(gl.BlockedLayout([1, 4], [1, 32], [1, 1], [1, 0]))
    # the copies into shared memory: 16 bytes a thread where the rows allow
    COPY_K = gl.constexpr(gl.BlockedLayout([1, 4], [16, 2], [1, 1], [1, 0]))  # [128, 8] int32
    COPY_V = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [1, 1], [1, 0]))  # [64, 16] int32
    COPY_PAIRS = gl.constexpr(gl.BlockedLayout([2], [32], [1], [0]))  # [64] int32
    # K's words [64 channel pairs, 8 words, 8 values]: lane 4 g + j holds word g of
    # channel pairs j, j + 4 (+ 8 k); the asm's 8 values of a word pair in registers
    K_PAIRS = gl.constexpr(
        _one_warp(
            [[0, 0, 1], [0, 0, 2], [0, 0, 4], [4, 0, 0], [8, 0, 0], [16, 0, 0], [32, 0, 0]],
            [[1, 0, 0], [2, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
            [64, 8, 8],
        )
    )  # fmt: skip
    # V's words [64 tokens, 16 words] as read from shared memory: lane 4 g + j holds
    # tokens 16 j .. 16 j + 15 and words g and 8 + g of each
    V_WORDS = gl.constexpr(
        _one_warp(
            [[1, 0], [2, 0], [4, 0], [8, 0], [0, 8]],
            [[16, 0], [32, 0], [0, 1], [0, 2], [0, 4]],
            [64, 16],
        )
    )
    # a token pair's words and the asm's values: [4 (token bits 4, 5), 8 (token bits
    # 0-2), 2 (value group: word bit 3), 8 (word bits 0-2), 8 values]
    V_PAIRS = gl.constexpr(
        _one_warp(
            [[0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 0, 4], [0, 1, 0, 0, 0],
             [0, 2, 0, 0, 0], [0, 4, 0, 0, 0], [0, 0, 1, 0, 0]],
            [[1, 0, 0, 0, 0], [2, 0, 0, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 2, 0],
             [0, 0, 0, 4, 0]],
            [4, 8, 2, 8, 8],
        )
    )  # fmt: skip
    # V's scales (or minimums) [64 tokens] (int32: a token's 2 value groups' float16): a
    # lane's 16 tokens
    V_PARAMS = gl.constexpr(_one_warp([[1], [2], [4], [8]], [[16], [32], [0], [0], [0]], [64]))

    def _words_to_values(selector: str, paired: bool) -> str:
        """Words a, b (inputs $4, $12) and their scales and minimums to 4 float16 pairs:
        of bytes i and i + 1 of each word (selector), the pair (a's, b's) of byte i's low
        nibble, its high nibble, then byte i + 1's, each code times the scale plus the
        minimum (1024 + code from a lop3, less 1024: exact). The scales and minimums come
        as float16 pairs ($20, $28) where paired, else as a's and b's words ($20, $28 and
        $36, $44) with the selector ($52) of their pair: a prmt here each, where one
        outside, used by several calls, is copied again for each (ptxas, short of
        registers)."""
        lines = [
            "{",
            ".reg .b32 t, u, v, magic, sixteenth, high_magic, scale, minimum;",
            "mov.b32 magic, 0x64006400;",
            "mov.b32 sixteenth, 0x2C002C00;",
            "mov.b32 high_magic, 0xD400D400;",  # -64
            "mov.b32 scale, $20;" if paired else "prmt.b32 scale, $20, $28, $52;",
            "mov.b32 minimum, $28;" if paired else "prmt.b32 minimum, $36, $44, $52;",
            f"prmt.b32 t, $4, $12, {selector};",
            "shr.b32 u, t, 8;",
        ]
        for out in range(4):
            # a low nibble in place is 1024 + code, a high one 1024 + 16 code (exact:
            # float16's step at 1024 is 1), both less 1024 exactly
            word, low = "tu"[out // 2], out % 2 == 0
            lines += [
                f"lop3.b32 v, {word}, {'0x000F000F' if low else '0x00F000F0'}, magic, 0xEA;",
                "sub.f16x2 v, v, magic;" if low else "fma.rn.f16x2 v, v, sixteenth, high_magic;",
                f"fma.rn.f16x2 ${out}, v, scale, minimum;",
            ]
        return "\n".join([*lines, "}"])

    _LOW_BYTES = gl.constexpr(_words_to_values("0x5410", True))
    _HIGH_BYTES = gl.constexpr(_words_to_values("0x7632", True))
    _LOW_BYTES_V = gl.constexpr(_words_to_values("0x5410", False))
    _HIGH_BYTES_V = gl.constexpr(_words_to_values("0x7632", False))
    # 4 registers out (8 float16), 8 copies of each input in
    _VALUES_IO = gl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 32))
    _VALUES_IO_V = gl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 56))

    @gluon.jit
    def _spread(x, layout: gl.constexpr):
        """x [..] (each thread's part of layout's leading dimensions) broadcast along
        layout's last dimension: a register copy each."""
        dim: gl.constexpr = len(layout.shape) - 1
        x = gl.expand_dims(gl.convert_layout(x, gl.SliceLayout(dim, layout)), dim)
        return gl.broadcast(x, gl.full(layout.shape, 0, x.dtype, layout))[0]

    @gluon.jit
    def _values_of(args, low: gl.constexpr, high: gl.constexpr, io: gl.constexpr):
        """`_words_to_values`'s inputs args (int32, each spread over its layout's last
        dimension) to float16 [.., 8, 2]: for bytes 0-1 (last index 0, the asm low) and
        2-3 (1, high), values 4 (byte % 2) + 2 nibble + (a: 0, b: 1)."""
        return gl.join(
            gl.inline_asm_elementwise(low, io, args, dtype=gl.float16, is_pure=True, pack=8),
            gl.inline_asm_elementwise(high, io, args, dtype=gl.float16, is_pure=True, pack=8),
        )

    @gluon.jit
    def _keys(words, scale, minimum):
        """A group's keys as the scores' A operand [64, 128 channels] from its codes [128
        channels, 8 words] and the channel pairs' scales and minimums [64] (int32 pairs):
        row 8 nt + g is token 8 g + nt (lane 4 g + j holds rows g and g + 8 of each
        16: the tokens of its word g)."""
        # channel pairs: [64, 8, 2] split
        even, odd = gl.split(gl.permute(gl.reshape(words, [64, 2, 8]), [0, 2, 1]))
        scale = gl.broadcast(
            gl.expand_dims(gl.convert_layout(scale, gl.SliceLayout(1, even.type.layout)), 1), even
        )[0]
        minimum = gl.broadcast(
            gl.expand_dims(gl.convert_layout(minimum, gl.SliceLayout(1, even.type.layout)), 1), even
        )[0]
        args = (_spread(even, K_PAIRS), _spread(odd, K_PAIRS), _spread(scale, K_PAIRS),
                _spread(minimum, K_PAIRS))  # fmt: skip
        values = _values_of(args, _LOW_BYTES, _HIGH_BYTES, _VALUES_IO)
        # [pair, word, byte % 2, nibble, channel % 2, byte // 2]
        values = gl.reshape(values, [64, 8, 2, 2, 2, 2])
        values = gl.reshape(gl.permute(values, [0, 4, 5, 2, 3, 1]), [_D, 64])
        return gl.convert_layout(gl.permute(values, [1, 0]), A_OP)

    @gluon.jit
    def _values(words, scale, minimum):
        """A group's values as the A operand [128 (16 mt + 8 (channel % 2) + g: channel
        64 (mt // 4) + 8 g + 2 (mt % 4) + channel % 2), 64 (K index 16 ks + 8 h + 2 j + e:
        token 16 j + 8 e + 2 ks + h)] from its codes [64 tokens, 16 words] and the
        tokens' scales and minimums [64 tokens] (int32: both value groups' float16)."""
        # tokens t and t + 8: [j, tl, value group, g, e] split
        words = gl.permute(gl.reshape(words, [4, 2, 8, 2, 8]), [0, 2, 3, 4, 1])
        first, second = gl.split(words)
        layout: gl.constexpr = first.type.layout
        # the value group's pair selector (its float16 of each of two words)
        group = gl.arange(
            0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(3, layout)))
        )
        group = gl.expand_dims(gl.expand_dims(gl.expand_dims(group, 0), 0), 3)
        selector = gl.broadcast(gl.where(group == 0, 0x5410, 0x7632), first)[0]
        scale_t, scale_t8 = _token_words(scale, first)
        minimum_t, minimum_t8 = _token_words(minimum, first)
        args = (_spread(first, V_PAIRS), _spread(second, V_PAIRS), _spread(scale_t, V_PAIRS),
                _spread(scale_t8, V_PAIRS), _spread(minimum_t, V_PAIRS),
                _spread(minimum_t8, V_PAIRS), _spread(selector, V_PAIRS))  # fmt: skip
        values = _values_of(args, _LOW_BYTES_V, _HIGH_BYTES_V, _VALUES_IO_V)
        # [j, ks, h, value group, g, byte % 2, nibble, e, byte // 2]
        values = gl.reshape(values, [4, 4, 2, 2, 8, 2, 2, 2, 2])
        values = gl.reshape(gl.permute(values, [3, 8, 5, 6, 4, 1, 2, 0, 7]), [_D, 64])
        return gl.convert_layout(values, A_OP)

    @gluon.jit
    def _token_words(params, like):
        """A token's words params [64] as the words of tokens t and t + 8, each broadcast
        to like [4 (token bits 4, 5), 8 (token bits 0-2), ..]."""
        first, second = gl.split(gl.permute(gl.reshape(params, [4, 2, 8]), [0, 2, 1]))
        layout: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, like.type.layout))
        first = gl.expand_dims(gl.expand_dims(gl.convert_layout(first, layout), 2), 3)
        second = gl.expand_dims(gl.expand_dims(gl.convert_layout(second, layout), 2), 3)
        return gl.broadcast(first, like)[0], gl.broadcast(second, like)[0]

    @gluon.jit
    def _ring(STAGES: gl.constexpr):
        """The shared memory of STAGES groups' copies: K's codes, scale and minimum pairs,
        V's codes, scales and minimums."""
        return (
            gl.allocate_shared_memory(gl.int32, [STAGES, _D, 8], ROWS_2D),
            gl.allocate_shared_memory(gl.int32, [STAGES, 64], ROWS_1D),
            gl.allocate_shared_memory(gl.int32, [STAGES, 64], ROWS_1D),
            gl.allocate_shared_memory(gl.int32, [STAGES, 64, 16], ROWS_2D),
            gl.allocate_shared_memory(gl.int32, [STAGES, 64], ROWS_1D),
            gl.allocate_shared_memory(gl.int32, [STAGES, 64], ROWS_1D),
        )

    @gluon.jit
    def _stage(ring, i):
        """Stage i of each of the ring's buffers."""
        return (ring[0].index(i), ring[1].index(i), ring[2].index(i), ring[3].index(i),
                ring[4].index(i), ring[5].index(i))  # fmt: skip

    @gluon.jit
    def _issue(stage, kc_ptr, ks_ptr, km_ptr, vc_ptr, vs_ptr, vm_ptr, group_row, slot0, ok):
        """Asynchronous copies of a group's codes and parameters into stage (none where
        not ok)."""
        kw, ksc, kmn, vw, vsc, vmn = stage
        ch = gl.arange(0, _D, layout=gl.SliceLayout(1, COPY_K))
        word = gl.arange(0, 8, layout=gl.SliceLayout(0, COPY_K))
        at = (group_row * _D + ch)[:, None] * 8 + word[None, :]
        async_copy.async_copy_global_to_shared(
            kw, kc_ptr.to(gl.pointer_type(gl.int32)) + at, mask=ok
        )
        pair = group_row * 64 + gl.arange(0, 64, layout=COPY_PAIRS)
        async_copy.async_copy_global_to_shared(
            ksc, ks_ptr.to(gl.pointer_type(gl.int32)) + pair, mask=ok
        )
        async_copy.async_copy_global_to_shared(
            kmn, km_ptr.to(gl.pointer_type(gl.int32)) + pair, mask=ok
        )
        tok = gl.arange(0, 64, layout=gl.SliceLayout(1, COPY_V))
        word = gl.arange(0, 16, layout=gl.SliceLayout(0, COPY_V))
        at = (slot0 + tok)[:, None] * 16 + word[None, :]
        async_copy.async_copy_global_to_shared(
            vw, vc_ptr.to(gl.pointer_type(gl.int32)) + at, mask=ok
        )
        tok = slot0 + gl.arange(0, 64, layout=COPY_PAIRS)
        async_copy.async_copy_global_to_shared(
            vsc, vs_ptr.to(gl.pointer_type(gl.int32)) + tok, mask=ok
        )
        async_copy.async_copy_global_to_shared(
            vmn, vm_ptr.to(gl.pointer_type(gl.int32)) + tok, mask=ok
        )
        async_copy.commit_group()

    # Triton specializes integer arguments equal to 1 or divisible by 16 (a new compile
    # each): the context-dependent ones change every decode step
    @gluon.jit(
        do_not_specialize=[
            "bias_sb", "bias_sh", "full_groups", "tail_len", "num_groups", "max_slots",
            "splits", "split_groups",
        ]
    )  # fmt: skip
    def _mma_attention_kernel(
        q_ptr, q_sb, q_sh,
        bias_ptr, bias_sb, bias_sh, bias_ss,
        kc_ptr, ks_ptr, km_ptr, kt_ptr, vc_ptr, vs_ptr, vm_ptr, vt_ptr,
        acc_ptr, m_ptr, l_ptr, out_ptr, count_ptr,
        full_groups, tail_len, num_groups, max_slots, splits, split_groups, qk_scale,
        REP: gl.constexpr, STAGES: gl.constexpr,
    ):  # fmt: skip
        """One (sequence, KV head, split): its REP query heads over groups split x
        split_groups .. (up to full_groups), or, the last split where tail_len > 0, over
        the tail; the split's unnormalized output, maximum and sum (natural-log units) to
        the partials, and the row's last program to finish (an arrival counter) merges
        them into out, in split order. qk_scale: log2(e) / sqrt(D) (the softmax runs in
        base 2). Each group's codes and parameters come by cp.async into shared memory
        STAGES - 1 groups ahead."""
        b = gl.program_id(0)
        kvh = gl.program_id(1)
        split = gl.program_id(2)
        kv_heads = gl.num_programs(1)
        row = b * kv_heads + kvh
        # q^T [128 channels, 8 query heads]: the scores' B operand
        d = gl.arange(0, _D, layout=gl.SliceLayout(1, B_OP))
        r = gl.arange(0, 8, layout=gl.SliceLayout(0, B_OP))
        q = gl.load(
            q_ptr + b * q_sb + (kvh * REP + r)[None, :] * q_sh + d[:, None],
            mask=(r < REP)[None, :] & (d < _D)[:, None],
            other=0.0,
        )
        ring = _ring(STAGES)
        # the scores [64, 8 query heads]: row n = 8 nt + g is token 8 g + nt
        n = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
        token = 8 * (n % 8) + n // 8
        heads8 = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
        bias_row = bias_ptr + b * bias_sb + (kvh * REP + heads8)[None, :] * bias_sh
        bias_ok = (heads8 < REP)[None, :] & (n < 64)[:, None]
        m_i = gl.full([8], -float("inf"), gl.float32, gl.SliceLayout(0, MMA))
        l_i = gl.zeros([8], gl.float32, gl.SliceLayout(0, MMA))
        out = gl.zeros([_D, 8], gl.float32, MMA)
        first = split * split_groups
        steps = gl.minimum(first + split_groups, full_groups) - first
        slot0 = row * max_slots + first * 64
        for s in gl.static_range(STAGES - 1):  # the ring's first groups
            _issue(
                _stage(ring, s),
                kc_ptr, ks_ptr, km_ptr, vc_ptr, vs_ptr, vm_ptr, row * num_groups + first + s,
                slot0 + s * 64, s < steps,
            )  # fmt: skip
        bias = gl.load(bias_row + (first * 64 + token)[:, None] * bias_ss, mask=bias_ok, other=0.0)
        for i in range(steps):
            grp = first + i
            ahead = i + STAGES - 1  # into the stage that step i - 1 read
            _issue(
                _stage(ring, ahead % STAGES),
                kc_ptr, ks_ptr, km_ptr, vc_ptr, vs_ptr, vm_ptr, row * num_groups + first + ahead,
                slot0 + ahead * 64, ahead < steps,
            )  # fmt: skip
            more = i + 1 < steps
            bias_next = gl.load(
                bias_row + ((grp + 1) * 64 + token)[:, None] * bias_ss, mask=bias_ok & more,
                other=0.0,
            )  # fmt: skip
            m_i, l_i, out = _group(
                _stage(ring, i % STAGES), q, bias, qk_scale, m_i, l_i, out, STAGES - 1
            )
            bias = bias_next
        async_copy.wait_group(0)
        if split == splits - 1 and tail_len > 0:
            m_i, l_i, out = _tail(
                q, kt_ptr, vt_ptr, row, tail_len, bias_row + full_groups * 64 * bias_ss, bias_ss,
                bias_ok, qk_scale, m_i, l_i, out,
            )  # fmt: skip
        heads = b * kv_heads * REP + kvh * REP
        part = (heads + heads8) * splits + split
        ok = heads8 < REP
        gl.store(m_ptr + part, m_i / _LOG2E, mask=ok)
        gl.store(l_ptr + part, l_i, mask=ok)
        m = gl.arange(0, _D, layout=gl.SliceLayout(1, MMA))
        channel = _channel(m)
        c = gl.arange(0, 8, layout=gl.SliceLayout(0, MMA))
        at = ((heads + c) * splits + split)[None, :] * _D + channel[:, None]
        gl.store(acc_ptr + at, out, mask=(c < REP)[None, :] & (m < _D)[:, None])
        gl.thread_barrier()  # every thread's partial stored before the release below
        if gl.atomic_add(count_ptr + row, 1, sem="acq_rel") == splits - 1:
            _merge(acc_ptr, m_ptr, l_ptr, out_ptr, heads, splits, splits, REP)
            gl.atomic_xchg(count_ptr + row, 0)

    @gluon.jit
    def _group(stage, q, bias, qk_scale, m_i, l_i, out, AHEAD: gl.constexpr):
        """One group of the ring's stage attended (its copies waited for, all but the
        next AHEAD groups'): the running maximum, sum [8] and unnormalized output
        [128, 8] after it."""
        async_copy.wait_group(AHEAD)
        gl.thread_barrier()
        kw, ksc, kmn, vw, vsc, vmn = stage
        pairs: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, K_PAIRS))
        # (a [128, 8] tensor in B_OP: lane 4 g + j holds word g of channels 2 j, 2 j + 1
        # (+ 8 k), the words the asm pairs)
        keys = _keys(kw.load(B_OP), ksc.load(pairs), kmn.load(pairs))
        s = mma_v2(keys, q, gl.zeros([64, 8], gl.float32, MMA))
        s = s * qk_scale + bias.to(gl.float32) * _LOG2E
        m_i, l_i, p, alpha = _softmax_step(s, m_i, l_i)
        values = _values(vw.load(V_WORDS), vsc.load(V_PARAMS), vmn.load(V_PARAMS))
        out = mma_v2(values, p, out * alpha[None, :])
        gl.thread_barrier()  # the stage is read before the next step's copies into it
        return m_i, l_i, out

    @gluon.jit
    def _softmax_step(s, m_i, l_i):
        """The running softmax (base 2) by query head over a step's scores s [64, 8]: the
        new maximum and sum [8], the probabilities as the values' B operand (float16) and
        alpha [8], the old terms' factor (the values' accumulator columns')."""
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        m_safe = gl.where(m_new == -float("inf"), 0.0, m_new)  # nothing valid yet
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[None, :])
        l_i = l_i * alpha + gl.sum(p, axis=0)
        return m_new, l_i, _as_b_operand(p.to(gl.float16)), alpha

    @gluon.jit
    def _as_b_operand(p):
        """p [64, 8] (float16, the scores' accumulator layout) as the B operand: each 8 x 8
        block transposed by movmatrix. A lane holds row g, columns 2 j, 2 j + 1 of a block
        in both; relabelled as the blocks' transposes (free: the same registers), the
        B operand's labels hold after the move."""
        p = gl.reshape(gl.permute(gl.reshape(p, [4, 2, 8, 8]), [0, 1, 3, 2]), [64, 8])
        return gl.inline_asm_elementwise(
            "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r",
            [gl.convert_layout(p, B_OP)], dtype=gl.float16, is_pure=True, pack=2,
        )  # fmt: skip

    @gluon.jit
    def _channel(m):
        """The channel of the values' MMA row m: 16 mt + 8 (channel % 2) + g holds channel
        64 (mt // 4) + 8 g + 2 (mt % 4) + channel % 2."""
        mt = m // 16
        return 64 * (mt // 4) + 8 * (m % 8) + 2 * (mt % 4) + m // 8 % 2

    @gluon.jit
    def _tail(q, kt_ptr, vt_ptr, row, tail_len, bias_at, bias_ss, bias_ok, qk_scale, m_i, l_i, out):
        """The softmax's maximum, sum [8] and unnormalized output [128, 8] with the tail
        (tokens of the incomplete last group, in float16: read as the operands) added."""
        # [64 tokens, 128 channels], 16 bytes a load; then as the operands, by way of
        # shared memory (the layout conversion's)
        token = gl.arange(0, 64, layout=gl.SliceLayout(1, TAIL))
        ch = gl.arange(0, _D, layout=gl.SliceLayout(0, TAIL))
        at = (row * 64 + token)[:, None] * _D + ch[None, :]
        ok = (token < tail_len)[:, None] & (ch < _D)[None, :]
        keys = gl.load(kt_ptr + at, mask=ok, other=0.0)
        # row 8 nt + g is token 8 g + nt
        keys = gl.reshape(gl.permute(gl.reshape(keys, [8, 8, _D]), [1, 0, 2]), [64, _D])
        s = mma_v2(gl.convert_layout(keys, A_OP), q, gl.zeros([64, 8], gl.float32, MMA))
        n = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
        token = 8 * (n % 8) + n // 8
        bias = gl.load(bias_at + token[:, None] * bias_ss, mask=bias_ok, other=0.0)
        s = s * qk_scale + bias.to(gl.float32) * _LOG2E
        s = gl.where((token < tail_len)[:, None], s, -float("inf"))
        m_i, l_i, p, alpha = _softmax_step(s, m_i, l_i)
        values = gl.load(vt_ptr + at, mask=ok, other=0.0)
        # row 16 mt + 8 e + g is channel 64 (mt // 4) + 8 g + 2 (mt % 4) + e (`_channel`),
        # K index kk the scores' row kk
        values = gl.reshape(values, [8, 8, 2, 8, 4, 2])  # [token bits 3-5, 0-2, channel ..]
        values = gl.reshape(gl.permute(values, [2, 4, 5, 3, 1, 0]), [_D, 64])
        return m_i, l_i, mma_v2(gl.convert_layout(values, A_OP), p, out * alpha[None, :])

    @gluon.jit
    def _merge(acc_ptr, m_ptr, l_ptr, out_ptr, heads, slots, count, REP: gl.constexpr):
        """Query heads heads .. + REP - 1's first `count` partials (of `slots` a head)
        merged into their normalized output, in slot order. The partials are read past L1
        (.cg): other programs wrote them."""
        r = gl.arange(0, 8, layout=gl.SliceLayout(1, MERGE))
        d = gl.arange(0, _D, layout=gl.SliceLayout(0, MERGE))
        ok = r < REP
        first = (heads + r) * slots
        m_run = gl.full([8], -float("inf"), gl.float32, gl.SliceLayout(1, MERGE))
        l_run = gl.zeros([8], gl.float32, gl.SliceLayout(1, MERGE))
        o_run = gl.zeros([8, _D], gl.float32, MERGE)
        for s in range(count):
            m_s = gl.load(m_ptr + first + s, mask=ok, other=-float("inf"), cache_modifier=".cg")
            l_s = gl.load(l_ptr + first + s, mask=ok, other=0.0, cache_modifier=".cg")
            o_s = gl.load(
                acc_ptr + (first + s)[:, None] * _D + d[None, :], mask=ok[:, None] & (d < _D)[None, :],
                other=0.0, cache_modifier=".cg",
            )  # fmt: skip
            m_new = gl.maximum(m_run, m_s)
            m_safe = gl.where(m_new == -float("inf"), 0.0, m_new)  # nothing valid yet
            old = gl.exp(m_run - m_safe)
            new = gl.exp(m_s - m_safe)
            l_run = l_run * old + l_s * new
            o_run = o_run * old[:, None] + o_s * new[:, None]
            m_run = m_new
        gl.store(
            out_ptr + (heads + r)[:, None] * _D + d[None, :],
            (o_run / l_run[:, None]).to(gl.float16),
            mask=ok[:, None] & (d < _D)[None, :],
        )

    _launch = Launcher(_mma_attention_kernel)
