"""The int4 decode matmul outside Triton: what a hand-written CUDA kernel reaches, and
what bounds it, beside ours on the same weights.

    python scripts/int4_cuda_probe.py [--rows 1,16,32] [--out benchmarks/results]

`int4_cuda_probe.cu` (compiled at run time by NVRTC through `torch.cuda._compile_kernel`;
no new dependency, and not part of the package): int4-g64 asymmetric W in the store
format `QTensor` as it is, fp16 x, `mma.sync.m16n8k16` with x's and W's columns
permuted alike in registers, 16-byte loads of W straight into registers (no shared
memory, `qmm4`) with DEPTH K steps in flight, or through a cp.async ring of DEPTH
stages in shared memory (`qmm4s`, each thread its own slots, so no barriers);
split-K partials in float32 summed by torch.

Two parts, each timed from a CUDA graph (`bench_kernels.timed`) as a share of the HBM
copy rate measured in the same run; also a device copy of each matrix's own size, so
the size is not the reason a kernel reads below the 1 GiB copy's rate:
- sweep: the W path, warps' W rows (NB blocks of 8), DEPTH and splits at each row
  count, with `qmatmul.qlinear` (Triton) beside them and each output's largest
  difference from `qlinear_reference`;
- parts: the kernel with parts taken out (MODE in the .cu file: the W loads alone;
  W and x loads; W loads and dequantization; loads and mma on the raw codes).
Writes JSON and prints both tables. docs/throughput.md has what it measured.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
from bench_kernels import hbm_rate, timed
from benchlib import Results

from offload.kernels.formats import Compression
from offload.kernels.qmatmul import qlinear, qlinear_reference
from offload.kernels.quant import quantize

GB = 1e9
SHAPES = [  # (model, matrix, N, K)
    ("opt-30b", "qkv", 3 * 7168, 7168),
    ("opt-30b", "mlp_out", 7168, 28672),
    ("llama-2-70b", "mlp_in", 2 * 28672, 8192),
]
SOURCE = (Path(__file__).parent / "int4_cuda_probe.cu").read_text()
MODES = ("all", "W loads", "W + x loads", "W loads + dequant", "loads + mma on raw codes")
_compiled: dict[str, object] = {}


def _kernel(tiles: int, nb: int, depth: int, mode: int, ring: bool):
    name = f"{'qmm4s' if ring else 'qmm4'}<{tiles}, {nb}, {depth}, {mode}>"
    if name not in _compiled:
        _compiled[name] = torch.cuda._compile_kernel(SOURCE, name)
    return _compiled[name]


def _splits(k: int, splits: int) -> tuple[int, int]:
    """K steps a split and the splits that gives."""
    steps = k // 128
    per = -(-steps // splits)
    return per, -(-steps // per)


def cuda_qlinear(x, q, nb, depth, splits, mode=0, partial=None, reduce=True, ring=False):
    """x [M, K] fp16 @ dequantize(q)^T through the CUDA kernel; partial: the split-K
    buffer (made here if None); reduce=False leaves the partials unsummed (timing);
    ring: W through the cp.async ring of `depth` stages (`qmm4s`), else registers."""
    m, k = x.shape
    n = q.shape[0]
    per, splits = _splits(k, splits)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if partial is None:
        partial = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    _kernel(-(-m // 16), nb, depth, mode, ring)(
        grid=(-(-n // (32 * nb)), splits, 1),
        block=(128, 1, 1),
        args=[x, q.codes, q.scale, q.minimum, partial, out, m, n, k, per],
    )
    if splits > 1 and reduce:
        out.copy_(partial.sum(0))
    return out


def _copy_rate(nbytes: int, dev: torch.device) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(functools.partial(dst.copy_, src), repeat=10) / GB


def _record(results, case, part, variant, fn, out=None, **extra) -> None:
    """Times fn into results' part, with the case's shape, and its output's largest
    difference from the reference where given."""
    seconds = timed(fn, repeat=20)
    row = {k: v for k, v in case.items() if k not in ("read", "hbm", "reference")}
    row.update(variant=variant, seconds=seconds, **extra)
    row["hbm_share"] = case["read"] / seconds / GB / case["hbm"]
    if out is not None:
        row["max_diff_vs_reference"] = (out.float() - case["reference"]).abs().max().item()
    results.data[part].append(row)
    print(
        f"{part:5s} {row['shape']:20s} m{row['rows']:<3d} {variant:26s} "
        f"{seconds * 1e6:7.1f} us {row['hbm_share']:4.0%}",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,16,32")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    dev = torch.device("cuda")
    hbm = hbm_rate(dev)
    results = Results(
        "int4_cuda_probe",
        {"device": torch.cuda.get_device_name(), "hbm_copy_gbps": hbm, "sweep": [], "parts": []},
        args.out,
    )
    for model, matrix, n, k in SHAPES:
        shape = {"shape": f"{model} {matrix}", "n": n, "k": k}
        w = torch.randn(n, k, device=dev, dtype=torch.float16)
        q = quantize(w, Compression(4, 64, False))
        del w
        shape["copy_gbps_at_size"] = _copy_rate(q.nbytes, dev)
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=torch.float16)
            read = q.nbytes + x.numel() * 2 + m * n * 2
            case = {**shape, "rows": m, "read": read, "hbm": hbm}
            case["reference"] = qlinear_reference(x, q, None).float()
            record = functools.partial(_record, results, case)

            record("sweep", "triton", functools.partial(qlinear, x, q), qlinear(x, q))
            combos = [(False, 4, 1), (False, 2, 2), (False, 4, 2), (True, 4, 3), (True, 2, 4)]
            combos += [(True, 2, 6)] if m <= 16 else [(False, 8, 1)]
            for ring, nb, depth in combos:
                for splits in (1, 2, 4, 8):
                    partial = torch.empty((_splits(k, splits)[1], m, n), device=dev)
                    out = cuda_qlinear(x, q, nb, depth, splits, ring=ring)
                    call = (x, q, nb, depth, splits, 0, partial)
                    fn = functools.partial(cuda_qlinear, *call, False, ring)
                    summed = functools.partial(cuda_qlinear, *call, True, ring)
                    label = f"{'ring' if ring else 'registers'} nb{nb} depth{depth} split{splits}"
                    record("sweep", label, fn, out, seconds_with_sum=timed(summed, repeat=20))
            if m > 16:
                continue
            for ring, depth in ((False, 1), (True, 3)):
                for splits in (2, 8):
                    partial = torch.empty((_splits(k, splits)[1], m, n), device=dev)
                    for mode, what in enumerate(MODES):
                        call = (x, q, 4, depth, splits, mode, partial, False, ring)
                        fn = functools.partial(cuda_qlinear, *call)
                        label = f"{'ring' if ring else 'registers'}/{splits} {what}"
                        record("parts", label, fn)
        results.save()
        del q
    results.save()
    print(f"HBM copy {hbm:.0f} GB/s; {torch.cuda.get_device_name()}")
    print(f"{'matrix':20s} {'rows':>4s} {'triton':>7s} {'best CUDA':>34s} {'':>6s} {'diff':>6s}")
    sweep = results.data["sweep"]
    for key in dict.fromkeys((r["shape"], r["rows"]) for r in sweep):
        rows = [r for r in sweep if (r["shape"], r["rows"]) == key]
        best = min(rows[1:], key=lambda r: r["seconds"])
        print(f"{key[0]:20s} {key[1]:4d} {rows[0]['hbm_share']:7.0%} {best['variant']:>34s} "
              f"{best['hbm_share']:6.0%} {best['max_diff_vs_reference']:6.2g}")  # fmt: skip
    print(
        f"{'matrix':20s} {'rows':>4s} {'W path/split':12s}"
        + " ".join(f"{w[:14]:>14s}" for w in MODES)
    )
    parts = results.data["parts"]
    for key in dict.fromkeys((r["shape"], r["rows"], r["variant"].split()[0]) for r in parts):
        shares = [
            r["hbm_share"] for r in parts if (r["shape"], r["rows"], r["variant"].split()[0]) == key
        ]
        print(f"{key[0]:20s} {key[1]:4d} {key[2]:12s}" + " ".join(f"{s:14.0%}" for s in shares))


if __name__ == "__main__":
    main()
