"""The int4 decode attention's kernels side by side: `kv_attention_mma` (its own split,
and each of 1-16 groups a program) against the Triton kernel, over `bench_kernels`'s
attention shapes (int4-g64 asymmetric, float16), on one GPU.

    PYTHONPATH=. python scripts/lab/attention_mma_probe.py   # about a minute, H100
    PYTHONPATH=. ncu --clock-control none ... python scripts/lab/attention_mma_probe.py --profile

Prints a row a variant (us, share of the HBM copy rate measured first, largest
difference from `decode_attention_reference`) and writes the JSON under $OUT (else
benchmarks/results). With --caps, also each of `REGISTER_CAPS`. With --profile: each
shape's default call twice, nothing timed, for a profiler.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
from pathlib import Path

import torch

from offload.kernels import kv_attention_mma
from offload.kernels.kv_attention import decode_attention


def main() -> None:
    import _path  # noqa: F401  (scripts/ on the path)
    from bench_kernels import hbm_rate, int4_attention_cases, timed

    dev = torch.device("cuda")
    profile = "--profile" in sys.argv[1:]
    hbm = 1.0 if profile else hbm_rate(dev) * 1e9
    rows = []
    for shape, q, cache, bias, read, reference in int4_attention_cases(dev):
        model, batch, _, kv_heads, _, ctx, _ = shape
        if profile:
            for _ in range(2):
                decode_attention(q, cache, bias, ctx, mma=True)
            torch.cuda.synchronize()
            print(model, batch, ctx, "bytes", read, flush=True)
            continue
        full = ctx // 64
        auto = kv_attention_mma.split_groups(batch * kv_heads, full, dev)
        # the split each fixed cost a program (in groups) would pick
        picks = {kv_attention_mma.split_groups(batch * kv_heads, full, dev, f) for f in FIXED}
        variants = [("triton", {"mma": False}, None), ("mma", {"mma": True}, None)]
        variants += [
            (f"mma, {g} groups", {"mma": True, "split_groups": g}, None)
            for g in sorted({1, 2, 4, 8, 16} | picks)
            if g <= full and g != auto
        ]
        # register caps and the programs an SM they allow (shared memory: 228 KiB an SM,
        # 18 KiB a program and the driver's 1 KiB, so 12 at most)
        variants += [
            (
                f"mma, {r} registers",
                {"mma": True},
                {"REGISTERS": r, "PER_SM": min(65536 // (32 * r), 12)},
            )
            for r in (REGISTER_CAPS if "--caps" in sys.argv[1:] else ())
        ]
        # deeper rings (more of a program's copies in flight), at the programs an SM
        # their shared memory allows and the split `split_groups` picks for those
        for stages, per_sm in RINGS.items():
            with _patched({"STAGES": stages, "PER_SM": per_sm}):
                own = kv_attention_mma.split_groups(batch * kv_heads, full, dev)
            variants += [
                (f"mma, {stages} stages, {g} groups", {"mma": True, "split_groups": g},
                 {"STAGES": stages, "PER_SM": per_sm})
                for g in sorted({own, full})
            ]  # fmt: skip
        for name, kwargs, cap in variants:
            call = functools.partial(_capped, cap, q, cache, bias, ctx, **kwargs)
            seconds = timed(call)
            err = (call() - reference).abs().max().item()
            rows.append(
                {"model": model, "batch": batch, "context": ctx, "variant": name,
                 "auto_groups": auto, "us": seconds * 1e6, "hbm_share": read / seconds / hbm,
                 "max_diff_vs_reference": err}
            )  # fmt: skip
            print(
                f"{model:12s} B{batch:3d} S{ctx:5d} {name:16s} {seconds * 1e6:7.1f} us "
                f"{100 * read / seconds / hbm:5.1f}% (own split: {auto} groups) diff {err:.2g}",
                flush=True,
            )
    if profile:
        return
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    path = out / f"attn_mma_probe_{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"hbm_copy_gbps": hbm / 1e9, "rows": rows}, indent=1))
    print(f"wrote {path}")


# fixed costs a program (in groups' time) whose splits (`split_groups`) are measured too
FIXED = (0.0, 1.0, 1.5, 2.0)

# ring stages: the programs an SM their shared memory allows (9 KiB a stage and the
# driver's 1 KiB a program, of 228 KiB an SM: offline sm_90 compiles, triton 3.6), at
# most the 8 that 255 registers a thread allow
RINGS = {3: 8, 4: 6}

# the K q^T kernel's loop spills nothing at 184 registers (REP 1; 2 spills at REP 8) nor
# at 168 (REP 1; 14 at REP 8): offline SASS, triton 3.6
REGISTER_CAPS = (224, 200, 184, 168)


def _capped(settings: dict | None, *args, **kwargs) -> torch.Tensor:
    """decode_attention(*args, **kwargs) with `kv_attention_mma`'s settings (REGISTERS,
    PER_SM, STAGES) replaced by those given, or as they stand (None)."""
    with _patched(settings or {}):
        return decode_attention(*args, **kwargs)


@contextlib.contextmanager
def _patched(settings: dict):
    """`kv_attention_mma`'s module settings replaced by these for a while."""
    saved = {name: getattr(kv_attention_mma, name) for name in settings}
    for name, value in settings.items():
        setattr(kv_attention_mma, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(kv_attention_mma, name, value)


if __name__ == "__main__":
    main()
