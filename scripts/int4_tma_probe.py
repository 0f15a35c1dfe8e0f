"""The int4 decode matmul with its tiles brought in by Hopper's bulk tensor copy engine
(TMA, through Triton's tensor descriptors), beside ours on the same weights.

    python scripts/int4_tma_probe.py [--rows 1,14,16,32] [--out benchmarks/results]

`_qmm_tma_kernel` is `qmatmul._qmatmul_kernel`'s int4 asymmetric path (nibble planes,
split-K summed in order by the tile's last program) with one change: W's codes tile,
and with --x-tma x's tile too, comes from a host-built `TensorDescriptor`, which
Triton 3.6 pipelines as TMA copies completing on an mbarrier, where the committed
kernel issues cp.async from every thread. The scales and minimums stay pointer loads
(a K step's 4 groups are 8 bytes a row, under TMA's 16-byte box). Tiles, split and
register cap are the launcher's (`qmatmul_tiles.tiles_for`, `fit_tiles`).

Each kernel is timed from a CUDA graph (`bench_kernels.timed`), twice, interleaved
with the others; the best of the two is the share of the HBM copy rate measured in the
same run, counting every byte the call reads and writes. Every output's largest
difference from `qlinear_reference` is recorded. Writes JSON and prints a table;
docs/throughput.md has what it measured. Not part of the package.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
import triton
import triton.language as tl
from bench_kernels import hbm_rate, int4_probe_cases, print_beside, time_beside
from benchlib import Results
from triton.tools.tensor_descriptor import TensorDescriptor

from offload.kernels import qmatmul, qmatmul_tiles
from offload.kernels.dequant import dequant_nibbles
from offload.kernels.launch import arrival_counters, shared_memory_limit, split_of
from offload.kernels.quant import QTensor

VARIANTS = ("ours", "TMA W", "TMA W + x")


@triton.jit(do_not_specialize=["M"])
def _qmm_tma_kernel(
    x_desc, codes_desc, x_ptr, stride_xm, scale_ptr, min_ptr, out_ptr, partial_ptr, count_ptr,
    M, N, K: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    SPLIT: tl.constexpr, PER_SPLIT: tl.constexpr, X_TMA: tl.constexpr,
):  # fmt: skip
    """`_qmatmul_kernel` for int4 asymmetric W, no bias, ReLU or residual; W's codes
    (and x's tile where X_TMA) through tensor descriptors."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    PER_STEP: tl.constexpr = BLOCK_K // GROUP
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    gg = tl.arange(0, PER_STEP)
    kk = tl.arange(0, BLOCK_K)
    first = tl.program_id(2) * PER_SPLIT
    for i in tl.range(0, PER_SPLIT, num_stages=STAGES):
        step = first + i
        if X_TMA:  # rows past M come back as zeros
            xt = x_desc.load([pid_m * BLOCK_M, step * BLOCK_K])
        else:
            xt = tl.load(
                x_ptr + rm[:, None] * stride_xm + (step * BLOCK_K + kk)[None, :],
                mask=m_ok[:, None],
                other=0.0,
            )
        packed = codes_desc.load([pid_n * BLOCK_N, step * (BLOCK_K // 2)])
        params = rn[:, None] * (K // GROUP) + step * PER_STEP + gg[None, :]
        scale = tl.load(scale_ptr + params, mask=n_ok[:, None], other=0.0)
        low = tl.load(min_ptr + params, mask=n_ok[:, None], other=0.0)
        x_even, x_odd = tl.split(tl.reshape(xt, (BLOCK_M, BLOCK_K // 2, 2)))
        even, odd = dequant_nibbles(
            tl.reshape(packed, (BLOCK_N, PER_STEP, GROUP // 2)),
            scale[:, :, None],
            low[:, :, None],
            False,
            xt.dtype,
        )
        acc = tl.dot(x_even, tl.trans(tl.reshape(even, (BLOCK_N, BLOCK_K // 2))), acc)
        acc = tl.dot(x_odd, tl.trans(tl.reshape(odd, (BLOCK_N, BLOCK_K // 2))), acc)
    mask = m_ok[:, None] & n_ok[None, :]
    offsets = rm[:, None] * N + rn[None, :]
    if SPLIT:
        splits = tl.num_programs(2)
        tl.store(partial_ptr + tl.program_id(2) * M * N + offsets, acc, mask=mask)
        tl.debug_barrier()
        tile = pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == splits - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            s = 0
            while s < splits:
                total += tl.load(
                    partial_ptr + s * M * N + offsets, mask=mask, other=0.0, cache_modifier=".cg"
                )
                s += 1
            tl.atomic_xchg(count_ptr + tile, 0)
            tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


def tma_qlinear(x: torch.Tensor, w: QTensor, x_tma: bool) -> torch.Tensor:
    """x [M, K] fp16 @ dequantize(w)^T with the launcher's tiles, through the TMA kernel."""
    n, k = w.shape
    m = x.shape[0]
    cfg = w.config
    t = qmatmul_tiles.tiles_for(m, n, k, cfg.group_size, x.device)
    block_k = qmatmul_tiles.block_k_of(k, cfg.group_size, t.max_k)
    t = qmatmul_tiles.fit_tiles(t, block_k, x.element_size(), cfg, shared_memory_limit(x.device))
    steps = k // block_k
    split = split_of(t.split, steps)
    grid = (-(-m // t.block_m), -(-n // t.block_n), split)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    partial = counts = out
    if split > 1:
        partial = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counts = arrival_counters("qlinear_tma", x.device, grid[0] * grid[1])
    options = {"num_warps": t.warps}
    if t.registers:
        options["maxnreg"] = t.registers
    _qmm_tma_kernel[grid](
        TensorDescriptor.from_tensor(x, [t.block_m, block_k]),
        TensorDescriptor.from_tensor(w.codes.view(n, k // 2), [t.block_n, block_k // 2]),
        x, x.stride(0), w.scale, w.minimum, out, partial, counts, m, n, k, cfg.group_size,
        t.block_m, t.block_n, block_k, t.stages, split > 1, steps // split, x_tma,
        **options,
    )  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,14,16,32")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    dev = torch.device("cuda")
    hbm = hbm_rate(dev)
    results = Results(
        "int4_tma_probe",
        {"device": torch.cuda.get_device_name(), "triton": triton.__version__,
         "hbm_copy_gbps": hbm, "rows": []},
        args.out,
    )  # fmt: skip
    for record, x, q, reference, read in int4_probe_cases(dev, map(int, args.rows.split(","))):
        calls = {
            "ours": functools.partial(qmatmul.qlinear, x, q),
            "TMA W": functools.partial(tma_qlinear, x, q, False),
            "TMA W + x": functools.partial(tma_qlinear, x, q, True),
        }
        record.update(time_beside(calls, reference, read, hbm))
        results.data["rows"].append(record)
        results.save()
    print_beside(results.data["rows"], VARIANTS, hbm)


if __name__ == "__main__":
    main()
