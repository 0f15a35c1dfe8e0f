"""The GPU checks of the model families and pre-quantized checkpoints, and the cost of
the zero-point form (`Compression.zero_point`) in the int4 decode matmul.

    python scripts/check_families_quant.py            # one H200 (or H100)
    python scripts/check_families_quant.py --smoke    # CPU: the harness, tiny shapes

Parts, each a subprocess with its own time limit (one failing leaves the others):
- gpu-tests: the `gpu` tests of tests/test_families.py and tests/test_prequant.py
  (fp32 logits against transformers, decode CUDA graphs with Gemma 3's local RoPE
  tables, pre-quantized checkpoints through the compiled Triton kernel, streamed);
- kernel-tests: tests/test_gpu.py's compiled norm kernel (Gemma's (1 + w) RMS norm
  among its kinds) and int4 asymmetric qlinear kernel (zero points beside it);
- qlinear: decode matmuls of Qwen3-32B's shapes in int4 with a minimum (fma; g64 takes
  wgmma on Hopper) and with zero points (float32 dequantization), g64 and g128: time
  and the share of HBM's copy rate.
Writes benchmarks/results/check_families_quant_<stamp>.json (and $OUT when set) and
prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.benchlib import child_env, run_part  # noqa: E402

# (rows, N, K): Qwen3-32B's qkv, mlp_in (gate | up) and mlp_out at decode
SHAPES = [(1, 10240, 5120), (16, 10240, 5120), (16, 51200, 5120), (16, 5120, 25600)]
SMOKE_SHAPES = [(2, 128, 256)]
FORMATS = ["asym-g64", "zp-g64", "asym-g128", "zp-g128"]


def qlinear_part(smoke: bool) -> dict:
    """Median time of each format and shape, its bytes read, and the error against the
    plain-torch reference (the output's largest relative difference)."""
    import torch

    from offload.kernels.formats import Compression
    from offload.kernels.qmatmul import qlinear, qlinear_reference
    from offload.kernels.quant import quantize

    device = "cpu" if smoke else "cuda"
    dtype = torch.float32 if smoke else torch.float16
    out = {}
    for rows, n, k in SMOKE_SHAPES if smoke else SHAPES:
        w = torch.randn(n, k, device=device)
        x = torch.randn(rows, k, device=device, dtype=dtype)
        for name in FORMATS:
            kind, group = name.split("-g")
            q = quantize(w, Compression(4, int(group), zero_point=kind == "zp"))
            ref = qlinear_reference(x, q, None).float()
            got = qlinear(x, q).float()
            error = ((got - ref).abs().max() / ref.abs().max()).item()
            times = []
            for _ in range(3 if smoke else 60):
                if device == "cuda":
                    torch.cuda.synchronize()
                started = time.perf_counter()
                qlinear(x, q)
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - started)
            seconds = sorted(times[len(times) // 3 :])[len(times[len(times) // 3 :]) // 2]
            nbytes = q.nbytes + x.numel() * x.element_size() + rows * n * x.element_size()
            out[f"{name} {rows}x{n}x{k}"] = {
                "us": round(seconds * 1e6, 1),
                "gbps": round(nbytes / seconds / 1e9, 1),
                "rel_error": error,
            }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU: the harness on tiny shapes")
    p.add_argument("--part", help=argparse.SUPPRESS)  # a part's own subprocess
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args()
    if args.part == "qlinear":
        print(json.dumps(qlinear_part(args.smoke)))
        return
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logs = args.out / f"check_families_quant_{stamp}_logs"
    py = sys.executable
    parts = {
        "gpu-tests": ([py, "-m", "pytest", "-q", "-m", "gpu", "tests/test_families.py",
                       "tests/test_prequant.py"], 220),
        "kernel-tests": ([py, "-m", "pytest", "-q",
                          "tests/test_gpu.py::test_norm_kernel_compiled_matches_layer_and_rms_norm",
                          "tests/test_gpu.py::test_qlinear_kernel_compiled_matches_reference[False-4]"],
                         170),
        "qlinear": ([py, __file__, "--part", "qlinear", *(["--smoke"] if args.smoke else [])],
                    90),
    }  # fmt: skip
    results: dict = {"smoke": args.smoke, "parts": {}}
    for name, (cmd, limit) in parts.items():
        record = run_part(name, cmd, limit, logs, child_env())
        if name == "qlinear" and record["ok"]:
            record["table"] = json.loads(Path(record["stdout"]).read_text().splitlines()[-1])
        results["parts"][name] = record
        print(f"{name}: {'ok' if record['ok'] else 'FAILED'} in {record['seconds']} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"check_families_quant_{stamp}{'_smoke' if args.smoke else ''}.json"
    text = json.dumps(results, indent=1)
    path.write_text(text)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / path.name).write_text(text)
    for name, record in results["parts"].items():
        tail = record["stdout_tail"].strip().splitlines()[-1:] if "table" not in record else []
        print(f"{name:13s} {'ok' if record['ok'] else 'FAILED':6s} {record['seconds']:7.1f} s",
              *tail)  # fmt: skip
    for case, row in results["parts"]["qlinear"].get("table", {}).items():
        print(
            f"  {case:28s} {row['us']:9.1f} us {row['gbps']:8.1f} GB/s  err {row['rel_error']:.1e}"
        )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
