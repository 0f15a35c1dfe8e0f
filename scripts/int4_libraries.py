"""The int4 decode matmul: ours against the libraries made for the job, in one process.

    python scripts/int4_libraries.py [--rows 1,8,16,32,64] [--out benchmarks/results]

For OPT-30B and Llama-2-70B layer matrices, the same int4-g64 asymmetric weights
(`quant.quantize`) multiplied at decode row counts by
- ours: `qmatmul.qlinear` (Triton, the store format `QTensor`);
- torch's tinygemm: `torch._weight_int4pack_mm` (in torch itself, CUDA, bf16
  activations), after `_convert_weight_to_int4pack` of the same codes, with the
  minimum folded into tinygemm's zero point (`(q - 8) * scale + zero`);
- GemLite (`pip install gemlite`: Triton kernels, `W ~ q * scale + zero`, its shipped
  H100 tile configs), if it imports;
- cuBLAS fp16 (`F.linear`) on the uncompressed matrix, for scale.
Each is timed as `bench_kernels.py` times kernels (calls captured in a CUDA graph and
replayed), its compressed bytes read per second as a share of the HBM copy rate
measured in the same run, and its largest difference from the plain-torch definition
(`qlinear_reference`). Writes JSON and prints one table.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_kernels import hbm_rate, timed
from benchlib import Results

from offload.kernels.formats import Compression
from offload.kernels.qmatmul import qlinear, qlinear_reference
from offload.kernels.quant import QTensor, quantize, unpack_int4

GB = 1e9
GROUP = 64
SHAPES = [  # (model, matrix, N, K)
    ("opt-30b", "qkv", 3 * 7168, 7168),
    ("opt-30b", "mlp_in", 28672, 7168),
    ("opt-30b", "mlp_out", 7168, 28672),
    ("llama-2-70b", "mlp_in", 2 * 28672, 8192),
    ("llama-2-70b", "mlp_out", 8192, 28672),
]


def codes_of(q: QTensor) -> torch.Tensor:
    """The int4 codes, one a byte, [N, K]."""
    n, k = q.shape
    return unpack_int4(q.codes).reshape(n, k)


def tinygemm(q: QTensor, inner_k_tiles: int = 8):
    """torch's tinygemm operands for `q`, and the call y = x @ W^T (x cast to bf16)."""
    n, k = q.shape
    codes = codes_of(q)
    packed = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)  # even code high
    weight = torch.ops.aten._convert_weight_to_int4pack(packed.contiguous(), inner_k_tiles)
    scale = q.scale.float().reshape(n, k // GROUP)
    zero = q.minimum.float().reshape(n, k // GROUP) + 8 * scale
    params = torch.stack((scale, zero), dim=2).transpose(0, 1).contiguous().to(torch.bfloat16)

    def call(x: torch.Tensor) -> torch.Tensor:
        out = torch._weight_int4pack_mm(x.to(torch.bfloat16), weight, GROUP, params)
        return out.to(x.dtype)

    return call


def gemlite_linear(q: QTensor):
    """GemLite's layer over the same codes, scales and minimums (its fma mode), or None
    where gemlite does not import."""
    try:
        import gemlite
    except ImportError:
        return None
    n, k = q.shape
    layer = gemlite.GemLiteLinear(
        4,
        group_size=GROUP,
        in_features=k,
        out_features=n,
        input_dtype=gemlite.DType.FP16,
        output_dtype=gemlite.DType.FP16,
    )
    scale = q.scale.reshape(n, k // GROUP)
    minimum = q.minimum.reshape(n, k // GROUP)
    # pack() takes HQQ's (q - zero) * scale and stores -zero * scale: the minimum
    layer.pack(codes_of(q), scale, -(minimum.float() / scale.float()).half(), None)
    return layer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,16,32,64")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    rows = [int(m) for m in args.rows.split(",")]
    dev = torch.device("cuda")
    hbm = hbm_rate(dev)
    runs = []
    for model, name, n, k in SHAPES:
        torch.manual_seed(0)
        w = torch.randn(n, k, device=dev, dtype=torch.float16)
        q = quantize(w, Compression(4, GROUP, False))
        variants = {"ours": functools.partial(qlinear, w=q), "fp16": lambda x, w=w: F.linear(x, w)}
        for label, make in (("tinygemm", tinygemm), ("gemlite", gemlite_linear)):
            try:
                fn = make(q)
            except Exception as exc:  # a library that does not run here: say why
                runs.append({"shape": f"{model} {name}", "variant": label, "error": str(exc)})
                print(f"{model} {name} {label}: {str(exc)[:160]}", flush=True)
                continue
            if fn is not None:
                variants[label] = fn
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.float16)
            reference = qlinear_reference(x, q, None).float()
            read = q.nbytes + x.numel() * 2 + m * n * 2
            for label, fn in variants.items():
                row = {"shape": f"{model} {name}", "n": n, "k": k, "rows": m, "variant": label}
                try:
                    diff = (fn(x).float() - reference).abs().max().item()
                    seconds = timed(functools.partial(fn, x), repeat=10)
                except Exception as exc:
                    runs.append({**row, "error": str(exc)[:300]})
                    print(f"{row['shape']} m{m} {label}: {str(exc)[:160]}", flush=True)
                    continue
                gbps = (read if label != "fp16" else 2 * n * k) / seconds / GB
                runs.append(
                    {
                        **row,
                        "seconds": seconds,
                        "gbps": gbps,
                        "hbm_share": gbps / hbm,
                        "max_diff": diff,
                        "ref_scale": reference.abs().max().item(),
                    }
                )
        del w, q, variants
        torch.cuda.empty_cache()
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "hbm_copy_gbps": hbm,
        "group_size": GROUP,
        "runs": runs,
    }
    Results("int4_libraries", result, args.out).save()
    print(f"HBM copy {hbm:.0f} GB/s; us a call (share of HBM; largest difference)")
    labels = ["ours", "tinygemm", "gemlite", "fp16"]
    print(f"{'shape':24s} {'rows':>4s} " + " ".join(f"{v:>22s}" for v in labels))
    table: dict[tuple[str, int], dict[str, str]] = {}
    for r in runs:
        if "rows" in r:
            cell = (
                f"{r['seconds'] * 1e6:.1f} ({100 * r['hbm_share']:.0f}%; {r['max_diff']:.2g})"
                if "error" not in r
                else "error"
            )
            table.setdefault((r["shape"], r["rows"]), {})[r["variant"]] = cell
    for (shape, m), cells in table.items():
        print(f"{shape:24s} {m:4d} " + " ".join(f"{cells.get(v, '-'):>22s}" for v in labels))


if __name__ == "__main__":
    main()
