"""The int4 decode matmul on Hopper: ours (Triton), `qmatmul_wgmma` (what `qlinear` runs
there) and this probe's first Gluon kernel, on the same weights.

    python scripts/int4_gluon_probe.py [--rows 1,8,14,16,32] [--grids 132,264] [--out DIR]
    python scripts/int4_gluon_probe.py --compile-only [--dump DIR]  # no GPU: sm_90 SASS
    python scripts/int4_gluon_probe.py --profile --rows 16   # each kernel 3 times, for ncu
    git show REV:offload/kernels/qmatmul_wgmma.py > /tmp/old.py
    python scripts/int4_gluon_probe.py --baseline /tmp/old.py   # another commit's, beside

`qmatmul_wgmma` also runs with the grid of the split-K rule it replaced, stream-K on
every shape, other stages and other warpgroups (the columns' names say which).

The probe's kernel (`_qmm_gluon_kernel`) computes out^T = W x^T with the dequantized codes
as wgmma's register operand: 64 W rows a program are wgmma's M side, x's rows its N side
(16 or 32), and x^T is read from shared memory as the B operand.
- In wgmma's A fragment (per warp, that of `mma.m16n8k16`), lane l holds columns 2j,
  2j + 1, 2j + 8 and 2j + 9 of each 16, with j = l mod 4: the low and high nibbles of
  bytes j and 4 + j of the chunk's 8 bytes in `QTensor`'s order (`CODES`), or of 8
  contiguous bytes where each group's 32 are permuted (`permute_codes`,
  `CODES_PERMUTED`). `dequant.py`'s inline PTX dequantizes them, and joined and
  reshaped they are the A operand with no data movement.
- A ring of STAGES shared-memory slots, each filled by two TMA copies (the codes tile
  and x's tile) on the slot's mbarrier; the wgmma runs asynchronously, one step behind
  its wait. Scales and minimums are plain loads, one step ahead. Split-K partials in
  float32, summed by torch where timed with the output compared.

In run 150703 (H100) it read 54-74% of HBM at 1-32 rows, where the Triton kernel read
35-76% and `qmatmul_wgmma` (then with each group's scale applied after the MMA) 47-80%.
`qmatmul_wgmma` now makes the values in its A registers from 32-bit words by shift, lop3,
sub and fma (15 instructions a word of 8 codes, against this kernel's 24) and is what
`qlinear` runs; docs/throughput.md has the designs and the runs. int4-g64 asymmetric W,
fp16 x. Writes JSON and prints a table.
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
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from offload.kernels.dequant import _NIBBLES_ASYMMETRIC
from offload.kernels.launch import sm_count, split_of
from offload.kernels.qmatmul_wgmma import _barrier, _tma_load  # (named per Triton version)

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


def _descriptors(x, codes, x_rows):
    """TMA descriptors of x's tiles [x_rows, K_STEP] and W's codes tiles (a K step of
    W_ROWS rows)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    c_layout = gl.NVMMASharedLayout.get_default_for([W_ROWS, K_STEP // 2], gl.uint8)
    x_layout = gl.NVMMASharedLayout.get_default_for([x_rows, K_STEP], gl.float16)
    return (
        TensorDescriptor.from_tensor(x, [x_rows, K_STEP], x_layout),
        TensorDescriptor.from_tensor(codes, [W_ROWS, K_STEP // 2], c_layout),
    )


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
    assert m <= 64 and n % W_ROWS == 0 and k % K_STEP == 0 and w.config.group_size == GROUP
    steps = k // K_STEP
    split = split_of(split, steps)
    codes = w.codes.view(n, k // 2) if permuted is None else permuted
    x_desc, c_desc = _descriptors(x, codes, 16 if m <= 16 else 32 if m <= 32 else 64)
    out = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    _qmm_gluon_kernel[(n // W_ROWS, split)](
        x_desc, c_desc, w.scale, w.minimum, out, m, n, k, stages, steps // split,
        CODES if permuted is None else CODES_PERMUTED, CODES_BY_GROUP,
        _NIBBLES_ASYMMETRIC.value, permuted is not None, num_warps=4,
    )  # fmt: skip
    return out.sum(0).to(x.dtype) if reduce else out


def compile_only(k: int = 7168, stages: int = 3, dump: Path | None = None) -> None:
    """The kernels for sm_90 without a GPU: shared memory, registers and the SASS of
    the K loop (written to dump, a folder, where given): this probe's, in both byte
    orders, and `qmatmul_wgmma`'s at each wgmma N."""

    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from offload.kernels import qmatmul_wgmma as wgmma

    def desc(dtype, box):
        layout = gl.NVMMASharedLayout.get_default_for(box, dtype)
        kind = {gl.float16: "fp16", gl.uint8: "u8", gl.int32: "i32", gl.float32: "fp32"}[dtype]
        return f"tensordesc<{kind}[{box[0]}, {box[1]}],{layout!r}>"

    variants = []
    for x_rows, permuted in ((16, False), (32, False), (64, False), (16, True)):
        signature = {
            "x_desc": desc(gl.float16, [x_rows, K_STEP]),
            "c_desc": desc(gl.uint8, [W_ROWS, K_STEP // 2]),
            "scale_ptr": "*fp16", "min_ptr": "*fp16", "partial_ptr": "*fp32",
        }  # fmt: skip
        constexprs = {
            "K": k, "STAGES": stages, "PER_SPLIT": k // K_STEP // 2,
            "CODES_": CODES_PERMUTED if permuted else CODES, "BY_GROUP": CODES_BY_GROUP,
            "PTX": _NIBBLES_ASYMMETRIC.value, "PERMUTED": permuted,
        }  # fmt: skip
        name = f"probe, x rows {x_rows}{', permuted codes' if permuted else ''}"
        options = {"num_warps": 4, "maxnreg": 128 if x_rows <= 16 else None}
        variants.append((name, _qmm_gluon_kernel, options, signature, constexprs))
    for x_rows in wgmma.PER_SM:
        warpgroups = wgmma.WARPGROUPS[x_rows]
        rows = W_ROWS * warpgroups
        signature = {
            "x_desc": desc(gl.float16, [x_rows, K_STEP]),
            "c_desc": desc(gl.int32, [rows, K_STEP // 8]),
            "s_desc": desc(gl.float16, [rows, 8]), "m_desc": desc(gl.float16, [rows, 8]),
            "bias_ptr": "*fp16", "res_ptr": "*fp16",
            "out_ptr": "*fp16", "partial_ptr": "*fp32", "count_ptr": "*i32",
        }  # fmt: skip
        words, values, by_rows = wgmma._layouts(warpgroups)
        constexprs = {
            "K": k, "STAGES": wgmma.STAGES[x_rows], "HAS_BIAS": True, "RELU": False, "HAS_RESIDUAL": False,
            "WORDS": words, "VALUES": values, "BY_ROWS": by_rows,
        }  # fmt: skip
        # as `qmatmul_wgmma.qlinear` launches it
        options = {"num_warps": 4 * warpgroups, "maxnreg": wgmma.registers(x_rows, warpgroups)}
        name = f"qmatmul_wgmma, x rows {x_rows}, {warpgroups} warpgroup(s)"
        variants.append((name, wgmma._wgmma_kernel, options, signature, constexprs))
    for name, kernel, options, signature, constexprs in variants:
        names = kernel.arg_names
        signature = {"M": "i32", "N": "i32", "PER_TILE": "i32", **signature}
        constexprs = {c: v for c, v in {**constexprs, **options}.items() if c in names}
        signature.update({c: "constexpr" for c in constexprs})
        aligned = [a for a in names if a.endswith("_ptr") or a == "N"]
        source = GluonASTSource(
            fn=kernel,
            signature={a: signature[a] for a in names},
            constexprs=constexprs,
            attrs={(names.index(a),): [["tt.divisibility", 16]] for a in aligned},
        )
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        sass, resources = sass_of(compiled)
        if dump is not None:
            dump.mkdir(parents=True, exist_ok=True)
            (dump / (re.sub(r"\W+", "_", name) + ".sass")).write_text(sass)
        loop = _k_loop(sass)
        mix = dict(collections.Counter(op.split(".")[0] for op in loop).most_common(10))
        print(
            f"{name}: shared {compiled.metadata.shared} B, {resources}; the K loop: "
            f"{len(loop)} instructions, {len(loop) / 64:.2f} a code byte a thread, {mix}"
        )


def sass_of(compiled) -> tuple[str, str]:
    """A compiled kernel's SASS (nvdisasm) and its registers and stack (cuobjdump's
    "REG:n STACK:n"), by the tools Triton ships."""
    import subprocess

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass, usage = (
            subprocess.run(
                [bin_dir / tool, *flags, f.name], capture_output=True, text=True, check=True
            ).stdout
            for tool, flags in (("nvdisasm", ["-c"]), ("cuobjdump", ["--dump-resource-usage"]))
        )
    return sass, " ".join(re.findall(r"REG:\d+|STACK:\d+", usage))


def _k_loop(sass: str, mma: str = "HGMMA") -> list[str]:
    """The opcodes of the innermost loop that issues `mma` (wgmma's HGMMA, mma.sync's
    HMMA): a label to a branch back."""
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
    with_mma = [loop for loop in loops if any(op.startswith(mma) for op in loop)]
    return min(with_mma, key=len) if with_mma else []


def _split_k_grid(m: int, n: int, k: int, dev: torch.device) -> dict[str, int]:
    """The programs and warpgroups of `qmatmul_wgmma`'s rule before stream-K (at
    e089202): tiles x split, each program one tile's equal share of K, K divided among
    the most programs a tile that fill `PER_SM` (then 5, 4, 2, 2) an SM; two warpgroups
    at 33-64 rows only where their tiles needed no split."""
    from offload.kernels import qmatmul_wgmma

    x_rows = qmatmul_wgmma._x_rows(m)
    slots = {8: 5, 16: 4, 32: 2, 64: 2}[x_rows] * sm_count(dev)

    def grid(groups: int) -> int:
        tiles = n // (W_ROWS * groups)
        return tiles * split_of(max(1, slots // tiles), k // K_STEP)

    two = x_rows == 64 and n % (2 * W_ROWS) == 0 and grid(2) == n // (2 * W_ROWS)
    return {"grid": grid(2 if two else 1), "warpgroups": 2 if two else 1}


def _eager_us(call, calls: int = 200) -> float:
    """Wall time a call, eager (no CUDA graph): host overhead included (us)."""
    import time

    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,16,32")
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--grids", default="", help="qmatmul_wgmma at these programs as well")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument(
        "--baseline", type=Path,
        help="a file of qmatmul_wgmma from another commit (git show REV:PATH > FILE), timed beside",
    )  # fmt: skip
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
    from benchlib import Results

    from offload.kernels import qmatmul, qmatmul_tiles, qmatmul_wgmma

    dev = torch.device("cuda")
    baseline = None
    if args.baseline is not None:
        import importlib.util

        spec = importlib.util.spec_from_file_location("baseline_wgmma", args.baseline)
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)
    hbm = hbm_rate(dev)
    results = Results(
        "int4_gluon_probe",
        {"device": torch.cuda.get_device_name(), "triton": triton.__version__,
         "hbm_copy_gbps": hbm, "stages": args.stages, "rows": []},
        args.out,
    )  # fmt: skip
    columns: dict[str, None] = {}
    for record, x, q, reference, read in int4_probe_cases(dev, map(int, args.rows.split(","))):
        (m, k), n = x.shape, q.shape[0]
        tiles = qmatmul_tiles.tiles_for(m, n, k, GROUP, dev)
        order = permute_codes(q.codes.view(n, -1))
        split_k = functools.partial(gluon_qlinear, x, q, tiles.split, args.stages, False, order)
        out = torch.empty((m, n), dtype=x.dtype, device=dev)
        wgmma = functools.partial(qmatmul_wgmma.qlinear, x, q, None, out)
        calls = {
            "ours (Triton)": functools.partial(qmatmul.qlinear, x, q, None, tiles),
            "probe kernel": split_k,
            "qlinear (wgmma)": functools.partial(qmatmul.qlinear, x, q),
            # the grid and warpgroups of the split-K rule the stream-K grid replaced
            "wgmma, split-K grid": functools.partial(wgmma, **_split_k_grid(m, n, k, dev)),
            # 4 stages up to 32 rows; above (where the probe's kernel stops), 3, which
            # fit one program an SM
            "wgmma, other stages": functools.partial(wgmma, stages=4),
        }
        if m > 32:
            calls["wgmma, other stages"] = functools.partial(
                wgmma, stages=3, grid=sm_count(dev), warpgroups=1
            )  # fmt: skip
        if m > 16:  # the other side of `WARPGROUPS`
            groups = 3 - qmatmul_wgmma.WARPGROUPS[qmatmul_wgmma._x_rows(m)]
            calls["wgmma, other warpgroups"] = functools.partial(wgmma, warpgroups=groups)
        # stream-K wherever: one wave (`PER_SM` programs an SM) in equal runs of units
        slots = qmatmul_wgmma.PER_SM[qmatmul_wgmma._x_rows(m)] * sm_count(dev)
        calls["wgmma, stream-K"] = functools.partial(
            wgmma, grid=min(n // W_ROWS * (k // K_STEP), slots), warpgroups=1
        )  # fmt: skip
        if baseline is not None:
            calls[f"baseline ({args.baseline.stem})"] = functools.partial(
                baseline.qlinear, x, q, None, out
            )  # fmt: skip
        for other in map(int, filter(None, args.grids.split(","))):
            calls[f"wgmma, {other} programs"] = functools.partial(wgmma, grid=other)
        record["split"] = split_of(tiles.split, k // K_STEP)
        record["wgmma_programs"] = qmatmul_wgmma.programs(m, n, k, dev)
        outputs = {"probe kernel": lambda f=split_k: f().sum(0)}
        if args.profile:
            for call in calls.values():
                for _ in range(3):
                    call()
            torch.cuda.synchronize()
            return
        columns.update(dict.fromkeys(calls))  # every row's, in order
        record.update(time_beside(calls, reference, read, hbm, outputs))
        record["eager_us"] = {
            name: _eager_us(calls[name]) for name in ("ours (Triton)", "qlinear (wgmma)")
        }
        results.data["rows"].append(record)
        results.save()
    print_beside(results.data["rows"], tuple(columns), hbm)


if __name__ == "__main__":
    main()
