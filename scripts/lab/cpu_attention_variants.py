"""Time the CPU decode attention over an int4 cache for variants of its C source.

    git show REV:offload/kernels/cpu_attention.c > /tmp/old.c
    python scripts/lab/cpu_attention_variants.py /tmp/old.c --threads 1,8,16 --out FILE

Variants: `old` (the file given: another commit's `cpu_attention.c`, or a module that
holds its text as `SOURCE`), `new` (this
tree's), and this tree's with the values pass, the key scores pass or the
full-precision tail left out (`-no-values`, `-no-scores`, `-no-tail`: what each part
costs), and this tree's built for AVX2 (`new-avx2`, -march=haswell: 256-bit vectors,
which an AVX-512 core may run at a higher clock), on OPT-30B's shape at 12 and 48 sequences (544 slots) and a grouped-query one
(64 query heads over 8 KV heads, 4096 slots). Each call reads another copy of the
cache (at least 8 copies where they are small); the best of 3 rounds of 20 calls is
kept. Prints ms a call; JSON to --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

import torch

from offload.kernels import cpu_attention, native
from offload.kernels.formats import Compression
from offload.kernels.kv_cache import QuantKV

# name: (sequences, query heads, KV heads, slots), head_dim 128; cache copies cycled
SHAPES = {
    "opt-30b-b12": ((12, 56, 56, 544), 16),
    "opt-30b-b48": ((48, 56, 56, 544), 4),
    "gqa8-b8": ((8, 64, 8, 4096), 4),
}
PARTS = {
    "no-values": "    quant_values(it, first, tile, g, vkind);\n",
    "no-scores": "    quant_scores(it, first, tile, g, kkind);\n",
    "no-tail": "if (split == a->splits - 1) dense_range(&it, a->dense_from, a->end);",
}


# the -march every variant but `new-avx2` is built for: the caller's, if set
ARCH = os.environ.get("OFFLOAD_NATIVE_ARCH")


def _build(source: str, arch: str | None = None) -> None:
    arch = arch or ARCH
    if arch is None:
        os.environ.pop("OFFLOAD_NATIVE_ARCH", None)
    else:
        os.environ["OFFLOAD_NATIVE_ARCH"] = arch
    cpu_attention.SOURCE = source
    native.load_library.cache_clear()
    cpu_attention._library.cache_clear()
    assert cpu_attention._library() is not None, "the variant did not build"


def _case(shape, copies: int):
    batch, heads, kv_heads, slots = shape
    caches = []
    for _ in range(copies):
        cache = QuantKV(batch, kv_heads, 128, slots, Compression(4, 64), torch.float16, "cpu")
        keys = torch.randn(batch, kv_heads, slots, 128, dtype=torch.float16)
        cache.write(keys, torch.randn_like(keys), 0)
        caches.append(cache)
    q = torch.randn(batch, heads, 1, 128, dtype=torch.float16)
    return caches, q, torch.zeros(batch, 1, 1, slots), slots


def _seconds(caches, q, bias, end, calls: int = 20) -> float:
    for cache in caches[:2]:
        cpu_attention.decode_attention_quant(q, cache, bias, end)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for i in range(calls):
            cpu_attention.decode_attention_quant(q, caches[i % len(caches)], bias, end)
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _source(path: Path) -> str:
    if path.suffix != ".py":
        return path.read_text()
    spec = importlib.util.spec_from_file_location("baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SOURCE


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("baseline", type=Path, help="another commit's cpu_attention.c")
    p.add_argument("--threads", default=str(torch.get_num_threads()))
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    new = cpu_attention.SOURCE
    variants = {"old": (_source(args.baseline), None), "new": (new, None)}
    for name, text in PARTS.items():
        assert text in new, f"{name}: the source changed"
        variants[f"new-{name}"] = (new.replace(text, ""), None)
    variants["new-avx2"] = (new, "haswell")
    results = []
    for shape_name in args.shapes.split(","):
        data = _case(*SHAPES[shape_name])
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for name, (source, arch) in variants.items():
                _build(source, arch)
                ms = _seconds(*data) * 1e3
                results.append({"shape": shape_name, "threads": threads, "variant": name, "ms": ms})
                print(f"{shape_name:12s} {threads:3d} {name:14s} {ms:8.3f} ms", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
