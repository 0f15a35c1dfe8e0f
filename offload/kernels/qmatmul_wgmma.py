"""The int4 decode matmul on Hopper: wgmma with W's values made in its register operand
from the codes, straight from shared memory.

`qmatmul.qlinear` sends here x of 1-64 rows (float16) times int4-g64 asymmetric W on an
sm_90 GPU; everything else stays on the Triton kernel. The differences from it:

- **Values in wgmma's A registers.** A shift and a lop3 make the float16 pair {1024 +
  code} of two nibbles of a 32-bit word of codes; 1024 is taken off exactly and one fused
  multiply-add a pair applies the group's scale and minimum (`dequant.dequant`'s
  arithmetic, rounded once): 15 instructions a word of 8 codes, no round trip through
  shared memory. Every group's wgmma adds into one float32 sum.
- **W's codes stay in `QTensor`'s format; x is permuted instead.** wgmma's A fragment
  gives lane j of a quad K columns 2 j, 2 j + 1, 2 j + 8 and 2 j + 9 of each 16. Lane j
  reads bytes 8 j to 8 j + 7 of each group (16 codes), and the nibble pairs that a shift
  and a mask take from a word (k and k + 4) become those columns. `permute_x` permutes
  x's columns within each group to match (`X_ORDER`), one small kernel a call; the MMA's
  sum over K is the same sum.
- **TMA.** A K step's tiles (W's codes, x, W's scales and minimums) come by Hopper's bulk
  tensor copies into a ring of STAGES slots on mbarriers.
- **Equal runs of (tile, K step) units.** A program takes the next run of the units,
  tile by tile, which may begin or end inside a tile; a tile one program covers is
  stored whole, and a tile shared by several is added up in K order, from float32
  partials, by the last of them to arrive. `programs` sets the runs: K split among the
  most programs a tile that keep one wave (split-K, launched tile by tile),
  or, where the tiles need more than one wave and the last would be at most half full,
  one wave of runs that cross tiles (stream-K: 1.21x on OPT-30B's qkv at 32 rows).
- **Two warpgroups a program at 33-64 rows** where W's rows divide into their 128-row
  tiles: both read one x tile, so twice the warpgroups fit an SM.

Written in Triton's Gluon dialect (explicit layouts, shared memory, mbarriers, wgmma),
which has no CPU interpreter: the CPU tests check `X_ORDER`'s algebra against
`pack_int4`'s nibbles and `permute_x` under the interpreter, and the GPU tests check
the kernel against `qmatmul.qlinear_reference` (the same math in plain torch).
docs/throughput.md has the measurements, and the design this one replaced (each group's
scale applied after its MMA).
"""

from __future__ import annotations

import functools

import torch

from offload.kernels.launch import INTERPRETED, Launcher, arrival_counters, sm_count, split_of
from offload.kernels.quant import QTensor

try:
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
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.language.extra.cuda import gdc_launch_dependents
except ImportError:  # no Triton, or one without Gluon: the Triton kernel serves
    gluon = None

GROUP = 64
K_STEP = 256  # codes a K step: 4 groups
W_ROWS = 64  # W rows a warpgroup: wgmma's M
# by wgmma's N (x's rows in a tile): the warpgroups a program (each its own 64 W rows,
# all of them reading the same x tile), the programs an SM (at most what shared memory
# and registers allow), and the ring's stages (at 64 rows a stage's x tile is 32 KB).
# Programs an SM (H100, one tile a program, K 14336 / 28672; docs/throughput.md): at 1-16
# rows 3 or 4 read 80-84 / 86-89% of HBM, 2 80-82 / 85-86%, 1 61-67 / 66-69%; 5 (at 8
# rows, where 4 fill an SM's registers at 128 a thread) 68-69 / 72%
WARPGROUPS = {8: 1, 16: 1, 32: 1, 64: 2}
PER_SM = {8: 4, 16: 4, 32: 2, 64: 2}
STAGES = {8: 3, 16: 3, 32: 3, 64: 2}


def _x_order() -> torch.Tensor:
    """For each of a group's 64 positions L in the permuted x, the column of x it holds.
    L = 32 w + 16 kh + 8 kl + 2 j + h is wgmma's K index (chunk 2 w + kh, columns 2 j +
    h and 2 j + 8 + h); lane j's word w holds the group's codes 16 j + 8 w to + 7, and
    the shift of 4 (2 kh + kl) takes nibbles 2 kh + kl (h = 0) and 4 + 2 kh + kl (h = 1)."""
    L = torch.arange(GROUP)
    w, kh, kl, j, h = L // 32, L // 16 % 2, L // 8 % 2, L // 2 % 4, L % 2
    return 16 * j + 8 * w + 4 * h + 2 * kh + kl


X_ORDER = _x_order()


def eligible(x: torch.Tensor, w: QTensor, bias: torch.Tensor | None) -> bool:
    """Whether `qlinear` (x: [M, K] rows) takes this kernel."""
    cfg = w.config
    n, k = w.shape
    return (
        gluon is not None
        and x.is_cuda
        and not INTERPRETED
        and x.dtype == torch.float16
        and 1 <= x.shape[0] <= 64
        and cfg.bits == 4
        and cfg.group_size == GROUP
        and not cfg.symmetric
        and not cfg.zero_point
        and n % W_ROWS == 0
        and k % (2 * K_STEP) == 0  # TMA: the scale rows' strides are multiples of 16 bytes
        and (bias is None or bias.dtype == torch.float16)
        and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (w.codes, w.scale, w.minimum))
        and _hopper(x.device)
    )


@functools.cache
def _hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


def programs(m: int, n: int, k: int, device: torch.device, warpgroups: int | None = None) -> int:
    """The programs a call runs, for tiles of `warpgroups` x 64 W rows (None:
    `_warpgroups`): where the tiles fit one wave (`PER_SM` programs an SM), each tile's K
    divided among the most programs that keep one wave, at least 1, a divisor of its K
    steps (split-K); where they need more than one and the last would be at most half
    full, one wave in equal runs of (tile, K step) units (stream-K); else one tile a
    program. On the H100 (docs/throughput.md): at 48-64 rows split-K read 42-64% of
    HBM where stream-K read 22-59% (its partials: 64 x 128 float32 a shared tile,
    written and read); on OPT-30B's qkv at 32 rows (336 tiles, 1.27 waves) stream-K read
    65% where one tile a program read 54%."""
    slots = PER_SM[_x_rows(m)] * sm_count(device)
    tiles = n // (W_ROWS * (warpgroups or _warpgroups(m, n, k, device)))
    if tiles <= slots:
        return tiles * split_of(slots // tiles, k // K_STEP)
    if 0 < tiles % slots <= slots // 2:
        return slots
    return tiles


def _x_rows(m: int) -> int:
    """wgmma's N: x's rows in a tile."""
    return next(rows for rows in PER_SM if m <= rows)


def registers(x_rows: int, warpgroups: int) -> int | None:
    """The register cap a thread, where one is needed for all `PER_SM` programs to fit an
    SM (none spills at 128, offline)."""
    return 128 if x_rows <= 16 or warpgroups > 1 else None


def _warpgroups(m: int, n: int, k: int, device: torch.device) -> int:
    """`WARPGROUPS` where W's rows divide into their tiles and the tiles take no split,
    else 1. A split adds float32 partials, written and read: at 64 rows 512 N bytes a
    part, 14% of the bytes of a W 7168 columns wide. On the H100 (48 and 64 rows;
    docs/throughput.md): unsplit, two warpgroups were 1.0-1.23x one (OPT-30B's qkv and mlp_in,
    Llama-2-70B's mlp_in); where they needed 4 parts to one warpgroup's 2, 0.75-1.1x
    (OPT-30B's out_proj and mlp_out)."""
    groups = WARPGROUPS[_x_rows(m)]
    if groups == 1 or n % (W_ROWS * groups):
        return 1
    return groups if programs(m, n, k, device, groups) == n // (W_ROWS * groups) else 1


def permute_x(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] (rows contiguous) with each group's columns in `X_ORDER` (float16,
    contiguous)."""
    m, k = x.shape
    permuted = torch.empty((m, k), dtype=x.dtype, device=x.device)
    _launch_permute(
        (m, triton.cdiv(k // GROUP, 16)), 4, x, permuted, x.stride(0), k, 16, not INTERPRETED
    )  # fmt: skip
    return permuted


def qlinear(
    x: torch.Tensor,
    w: QTensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    relu: bool = False,
    residual: torch.Tensor | None = None,
    stages: int | None = None,
    grid: int | None = None,
    warpgroups: int | None = None,
) -> torch.Tensor:
    """out [M, N] = x [M <= 64, K] @ dequantize(w)^T (+ bias, then ReLU, then + residual),
    for w `eligible`; stages, grid (the programs) and warpgroups override `STAGES`,
    `programs` and `WARPGROUPS`."""
    n, k = w.shape
    m = x.shape[0]
    x_rows = _x_rows(m)
    warpgroups = _warpgroups(m, n, k, x.device) if warpgroups is None else warpgroups
    rows = W_ROWS * warpgroups
    stages = STAGES[x_rows] if stages is None else stages
    grid = programs(m, n, k, x.device, warpgroups) if grid is None else grid
    descriptors = (
        _descriptor(permute_x(x), [x_rows, K_STEP], gl.float16),
        _descriptor(w.codes.view(n, k // 2).view(torch.int32), [rows, K_STEP // 8], gl.int32),
        _descriptor(w.scale.view(n, k // GROUP), [rows, 2 * K_STEP // GROUP], gl.float16),
        _descriptor(w.minimum.view(n, k // GROUP), [rows, 2 * K_STEP // GROUP], gl.float16),
    )
    tiles = n // rows
    partial = out
    if tiles % grid:  # tiles shared by programs: two partials a program at most
        partial = torch.empty((2 * grid, m, rows), dtype=torch.float32, device=x.device)
    counts = arrival_counters("qlinear_wgmma", x.device, tiles)
    _launch(
        (grid,), 4 * warpgroups, *descriptors, bias if bias is not None else out,
        residual if residual is not None else out, out, partial, counts, m, n,
        grid // tiles if grid % tiles == 0 else 1, k, stages,
        bias is not None, relu, residual is not None, *_layouts(warpgroups),
        registers=registers(x_rows, warpgroups),
    )  # fmt: skip
    return out


def _descriptor(t: torch.Tensor, box: list[int], dtype) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, box, _shared_layout(*box, dtype))


@functools.cache
def _shared_layout(rows: int, columns: int, dtype):
    return gl.NVMMASharedLayout.get_default_for([rows, columns], dtype)


@functools.cache
def _layouts(warpgroups: int) -> tuple:
    """The register layouts of a program of `warpgroups` (64 W rows each, 16 a warp):
    a K step's codes as int32 words [W rows, 8 a group] (lane 4 g + j holds rows g and
    g + 8 and words 2 j and 2 j + 1 of every group); one group's words, each spread over
    the 8 values the asm makes of it [W rows, 8, 8]; and two steps' scales (or minimums)
    [W rows, 2 x groups], each thread its accumulator rows' (splitting off a step's
    half, then the groups, leaves the rows' layout)."""
    rows = W_ROWS * warpgroups
    warps = [[16 << i, 0] for i in range(1 + warpgroups.bit_length())]  # 16 rows a warp

    def layout(reg_bases, lane_bases, shape):
        pad = [0] * (len(shape) - 2)
        return gl.DistributedLinearLayout(
            reg_bases=reg_bases,
            lane_bases=lane_bases,
            warp_bases=[[w[0], *pad, w[1]] for w in warps],
            block_bases=[],
            shape=shape,
        )

    return (
        layout([[0, 1], [8, 0], [0, 8], [0, 16]], [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
               [rows, 32]),
        layout([[0, 0, 1], [0, 0, 2], [0, 0, 4], [0, 1, 0], [8, 0, 0]],
               [[0, 2, 0], [0, 4, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]], [rows, 8, 8]),
        layout([[0, 1], [0, 2], [0, 4], [8, 0]], [[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
               [rows, 2 * K_STEP // GROUP]),
    )  # fmt: skip


if gluon is not None:
    # Names that changed between the Triton versions the project allows. TMA's load
    # into shared memory: `async_copy_global_to_shared` in 3.6 (the GPU machine's),
    # renamed `async_load` by 3.9, where the old name raises
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # a barrier of the program's threads: `thread_barrier` in 3.6, `barrier` in 3.9
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier

    # a word's 8 nibbles as 4 wgmma A registers, each the float16 pair {code x scale +
    # minimum} of nibbles k and k + 4 (bits 4 k and 16 + 4 k): a shift and a lop3 make
    # {1024 + code}, 1024 is taken off exactly, then one fma a pair (`dequant.dequant`'s
    # arithmetic, rounded once); the scale pair is $12, the minimum pair $16 (each row's,
    # broadcast over its values)
    _WORD_TO_VALUES = gl.constexpr(
        "{\n.reg .b32 t, mask, magic;\nmov.b32 mask, 0x000F000F;\nmov.b32 magic, 0x64006400;\n"
        + "".join(
            (f"shr.b32 t, $4, {4 * k};\nlop3.b32 t, t, mask, magic, 0xEA;\n" if k else
             "lop3.b32 t, $4, mask, magic, 0xEA;\n")
            + f"sub.f16x2 t, t, magic;\nfma.rn.f16x2 ${k}, t, $12, $16;\n"
            for k in range(4)
        )
        + "}"
    )  # fmt: skip

    @triton.jit
    def _permute_x_kernel(
        x_ptr, permuted_ptr, stride_xm, K: tl.constexpr, BLOCK: tl.constexpr,
        TRIGGER: tl.constexpr,
    ):  # fmt: skip
        """A row's BLOCK groups of x, permuted (`X_ORDER`). TRIGGER (compiled): first let
        the kernel launched after it as its programmatic dependent (`_wgmma_kernel`)
        start, which waits for this one's writes before it reads them."""
        if TRIGGER:
            gdc_launch_dependents()
        row = tl.program_id(0)
        groups = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = groups < K // 64
        at = tl.arange(0, 64)
        source = (
            16 * (at // 2 % 4) + 8 * (at // 32) + 4 * (at % 2) + 2 * (at // 16 % 2) + at // 8 % 2
        )  # X_ORDER
        x = tl.load(
            x_ptr + row * stride_xm + groups[:, None] * 64 + source[None, :], mask=ok[:, None]
        )
        tl.store(permuted_ptr + row * K + groups[:, None] * 64 + at[None, :], x, mask=ok[:, None])

    @gluon.jit
    def _load_step(descs, ring, bars, slot, row0, step, pred, X: gl.constexpr = True):
        """TMA copies of K step `step`'s tiles (W's codes, scales and minimums from W row
        row0; x, unless X is False: then `_load_x` brings it) into the ring's `slot`,
        completing on its mbarrier."""
        x_desc, c_desc, s_desc, m_desc = descs
        _, c_smem, s_smem, m_smem = ring
        nbytes: gl.constexpr = (
            x_desc.block_type.nbytes + c_desc.block_type.nbytes + s_desc.block_type.nbytes
            + m_desc.block_type.nbytes
        )  # fmt: skip
        GROUPS: gl.constexpr = s_desc.block_type.shape[1] // 2
        bar = bars.index(slot)
        mbarrier.expect(bar, nbytes, pred=pred)
        if X:
            _load_x(descs, ring, bars, slot, step, pred)
        _tma_load(c_desc, [row0, step * GROUPS * 8], bar, c_smem.index(slot), pred=pred)
        # scales and minimums: a step's are 8 bytes a row, under TMA's 16, so each copy
        # brings an even step's and the next step's (a box's start 16-byte aligned too)
        pair = step // 2 * 2 * GROUPS
        _tma_load(s_desc, [row0, pair], bar, s_smem.index(slot), pred=pred)
        _tma_load(m_desc, [row0, pair], bar, m_smem.index(slot), pred=pred)

    @gluon.jit
    def _load_x(descs, ring, bars, slot, step, pred):
        """The TMA copy of K step `step`'s x tile into the ring's `slot`."""
        x_desc = descs[0]
        GROUPS: gl.constexpr = x_desc.block_type.shape[1] // 64
        _tma_load(x_desc, [0, step * GROUPS * 64], bars.index(slot), ring[0].index(slot), pred=pred)

    @gluon.jit
    def _this_step(pair, odd):
        """A step's scales (or minimums) [W rows, groups] from the pair of steps' [W rows,
        2 x groups] that `_load_step` brings: the second half where the step is odd."""
        ROWS: gl.constexpr = pair.shape[0]
        GROUPS: gl.constexpr = pair.shape[1] // 2
        halves = gl.permute(gl.reshape(pair, [ROWS, 2, GROUPS]), [0, 2, 1])
        even_step, odd_step = gl.split(halves)
        return gl.where(odd, odd_step, even_step)

    @gluon.jit
    def _group_of(t, g: gl.constexpr):
        """Column g of t [rows, 4] (the 4 in each thread's registers)."""
        t0, t1 = gl.split(gl.reshape(t, [t.shape[0], 2, 2]))  # by g % 2
        t = t1 if g % 2 else t0
        t0, t1 = gl.split(t)
        return t1 if g // 2 else t0

    @gluon.jit
    def _group_values(
        words, scale, low, g: gl.constexpr, a_layout: gl.constexpr, VALUES: gl.constexpr
    ):
        """Group g's values as wgmma's A operand [W rows, 64], in wgmma's K order
        (`X_ORDER`). words: the step's codes [W rows, 32] (int32); scale, low: the group's
        scales and minimums [W rows] (float16)."""
        ROWS: gl.constexpr = words.shape[0]
        t = gl.permute(gl.reshape(words, [ROWS, 4, 8]), [0, 2, 1])
        t0, t1 = gl.split(gl.reshape(t, [ROWS, 8, 2, 2]))  # [rows, word, g // 2], by g % 2
        t = t1 if g % 2 else t0
        t0, t1 = gl.split(t)
        t = t1 if g // 2 else t0
        t = gl.convert_layout(t, gl.SliceLayout(2, VALUES))
        spread = gl.full([ROWS, 8, 8], 0, gl.int32, VALUES)
        by_row: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, VALUES))
        scale = gl.convert_layout(scale, by_row)[:, None, None]
        low = gl.convert_layout(low, by_row)[:, None, None]
        v = gl.inline_asm_elementwise(
            _WORD_TO_VALUES, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
            [gl.broadcast(gl.expand_dims(t, 2), spread)[0], gl.broadcast(scale, spread)[0],
             gl.broadcast(low, spread)[0]],
            dtype=gl.float16, is_pure=True, pack=8,
        )  # fmt: skip
        # [rows, word 2 j + w, 2 k + h] to wgmma's K order, 16 (2 w + k // 2) + 8 (k % 2)
        # + 2 j + h (`X_ORDER`)
        v = gl.reshape(v, [ROWS, 4, 2, 2, 2, 2])  # [rows, j, w, k // 2, k % 2, h]
        v = gl.reshape(gl.permute(v, [0, 2, 3, 4, 1, 5]), [ROWS, 64])
        return gl.convert_layout(v, a_layout)

    @gluon.jit
    def _store(
        out_ptr, total, bias_ptr, res_ptr, rows, cols, M, N,
        HAS_BIAS: gl.constexpr, RELU: gl.constexpr, HAS_RESIDUAL: gl.constexpr,
    ):  # fmt: skip
        """out[cols, rows] (float16) = total [W rows, x rows] + bias, ReLU, + residual."""
        offsets = cols[None, :] * N + rows[:, None]
        ok = (cols < M)[None, :]
        if HAS_BIAS:
            total += gl.load(bias_ptr + rows).to(gl.float32)[:, None]
        if RELU:
            total = gl.maximum(total, 0.0)
        if HAS_RESIDUAL:
            total += gl.load(res_ptr + offsets, mask=ok, other=0.0).to(gl.float32)
        gl.store(out_ptr + offsets, total.to(gl.float16), mask=ok)

    @gluon.jit
    def _wgmma_kernel(
        x_desc, c_desc, s_desc, m_desc, bias_ptr, res_ptr, out_ptr, partial_ptr, count_ptr,
        M, N, PER_TILE, K: gl.constexpr, STAGES: gl.constexpr,
        HAS_BIAS: gl.constexpr, RELU: gl.constexpr, HAS_RESIDUAL: gl.constexpr,
        WORDS: gl.constexpr, VALUES: gl.constexpr, BY_ROWS: gl.constexpr,
    ):  # fmt: skip
        """out [M, N] (float16) = x @ dequantize(W)^T (+ bias, ReLU, + residual). The
        units (tile of W rows, 64 a warpgroup; K step), tile by tile, in equal runs to
        the programs; each program walks its run through one ring, tile by tile, each
        tile's sum ended by `_end_tile`. WORDS, VALUES, BY_ROWS: `_layouts`."""
        ROWS: gl.constexpr = c_desc.block_type.shape[0]
        X_ROWS: gl.constexpr = x_desc.block_type.shape[0]
        STEP: gl.constexpr = x_desc.block_type.shape[1]
        GROUPS: gl.constexpr = STEP // 64
        STEPS: gl.constexpr = K // STEP
        units = N // ROWS * STEPS
        programs = gl.num_programs(0)
        # where each tile has PER_TILE programs, launched tile by tile: the tiles' first
        # parts first, then their second parts, ... (else PER_TILE is 1)
        lanes = programs // PER_TILE
        program = gl.program_id(0) % lanes * PER_TILE + gl.program_id(0) // lanes
        start = program * units // programs
        count = (program + 1) * units // programs - start
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[ROWS // 16, 1], instr_shape=[16, X_ROWS, 16]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        descs = (x_desc, c_desc, s_desc, m_desc)
        ring = (
            gl.allocate_shared_memory(gl.float16, [STAGES, X_ROWS, STEP], x_desc.layout),
            gl.allocate_shared_memory(gl.int32, [STAGES, ROWS, STEP // 8], c_desc.layout),
            gl.allocate_shared_memory(gl.float16, [STAGES, ROWS, 2 * GROUPS], s_desc.layout),
            gl.allocate_shared_memory(gl.float16, [STAGES, ROWS, 2 * GROUPS], m_desc.layout),
        )
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        # the ring's first units: W's tiles before x's, which `permute_x`, the kernel
        # launched before this one, writes. This kernel is launched as its programmatic
        # dependent (`_launch`'s pdl): it may start while `permute_x` runs, and waits
        # for it (griddepcontrol.wait) only before reading x
        for s in gl.static_range(STAGES):
            unit = start + s
            _load_step(descs, ring, bars, s, unit // STEPS * ROWS, unit % STEPS, s < count, False)
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )  # fmt: skip
        for s in gl.static_range(STAGES):
            _load_x(descs, ring, bars, s, (start + s) % STEPS, s < count)
        end = start + count
        for tile in range(start // STEPS, (end - 1) // STEPS + 1):  # the run's tiles
            total = gl.zeros((ROWS, X_ROWS), dtype=gl.float32, layout=mma)
            for unit in range(
                gl.maximum(start, tile * STEPS), gl.minimum(end, tile * STEPS + STEPS)
            ):
                i = unit - start
                slot = i % STAGES
                mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
                words = ring[1].index(slot).load(WORDS)
                odd = unit % 2 == 1  # (STEPS is even)
                scales = _this_step(ring[2].index(slot).load(BY_ROWS), odd)
                lows = _this_step(ring[3].index(slot).load(BY_ROWS), odd)
                x_slot = ring[0].index(slot)
                for g in gl.static_range(GROUPS):  # asynchronous, into one sum
                    a = _group_values(
                        words, _group_of(scales, g), _group_of(lows, g), g, a_layout, VALUES
                    )
                    b = x_slot.slice(g * 64, 64, dim=1).permute((1, 0))
                    total = warpgroup_mma(a, b, total, is_async=True)
                total = warpgroup_mma_wait(num_outstanding=0, deps=(total,))
                # every wgmma of unit i is done: its slot takes unit i + STAGES
                _barrier()
                fence_async_shared()
                ahead = unit + STAGES
                _load_step(
                    descs, ring, bars, slot, ahead // STEPS * ROWS, ahead % STEPS, ahead < end
                )  # fmt: skip
            _end_tile(
                total, tile, program, start, units, programs, bias_ptr, res_ptr, out_ptr,
                partial_ptr, count_ptr, M, N, STEPS, HAS_BIAS, RELU, HAS_RESIDUAL,
            )  # fmt: skip
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))

    @gluon.jit
    def _end_tile(
        total, tile, program, start, units, programs, bias_ptr, res_ptr, out_ptr,
        partial_ptr, count_ptr, M, N, STEPS: gl.constexpr, HAS_BIAS: gl.constexpr, RELU: gl.constexpr,
        HAS_RESIDUAL: gl.constexpr,
    ):  # fmt: skip
        """A program's sum over its units of `tile` [W rows, x rows]: stored (+ bias, ReLU,
        + residual) where the tile is the program's alone, else written as a partial, and
        the last of the tile's programs to arrive at its counter adds them in K order and
        stores the sum. Program q starts at unit q x units // programs; its partials are
        [M, W rows] float32 at 2 q (its run's first tile) and 2 q + 1 (its last)."""
        ROWS: gl.constexpr = total.shape[0]
        X_ROWS: gl.constexpr = total.shape[1]
        mma: gl.constexpr = total.type.layout
        at = gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
        cols = gl.arange(0, X_ROWS, layout=gl.SliceLayout(0, mma))
        rows = tile * ROWS + at
        first = tile * STEPS  # the tile's first unit, and the programs of its first and last
        owner = ((first + 1) * programs - 1) // units
        last = ((first + STEPS) * programs - 1) // units
        if owner == last:
            _store(out_ptr, total, bias_ptr, res_ptr, rows, cols, M, N, HAS_BIAS, RELU,
                   HAS_RESIDUAL)  # fmt: skip
        else:
            offsets = cols[None, :] * ROWS + at[:, None]
            ok = (cols < M)[None, :]
            slot = 2 * program + (start < first).to(gl.int32)
            gl.store(partial_ptr + slot * M * ROWS + offsets, total, mask=ok)
            _barrier()  # every thread's partial stored before the release below
            counter = count_ptr + tile
            if gl.atomic_add(counter, 1, sem="acq_rel") == last - owner:
                total = gl.zeros_like(total)
                for q in range(owner, last + 1):  # in K order: the same sum whoever is last
                    slot = 2 * q + (q * units // programs < first).to(gl.int32)
                    total += gl.load(
                        partial_ptr + slot * M * ROWS + offsets, mask=ok, other=0.0,
                        cache_modifier=".cg",
                    )  # fmt: skip
                gl.atomic_xchg(counter, 0)
                _store(out_ptr, total, bias_ptr, res_ptr, rows, cols, M, N, HAS_BIAS, RELU,
                       HAS_RESIDUAL)  # fmt: skip

    _launch = Launcher(_wgmma_kernel, pdl=True)
    _launch_permute = Launcher(_permute_x_kernel)
