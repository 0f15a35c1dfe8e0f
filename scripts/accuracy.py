"""Accuracy of compression on the demo model: perplexity and greedy-token agreement.

    python scripts/accuracy.py [--window 512] [--only "int4-g64 kv" ...]

Perplexity of SmolLM2-135M-Instruct over tests/data/public_domain.txt (2,008 tokens of
public-domain text) in non-overlapping windows, teacher-forced one token a step,
uncompressed and with group-wise quantization of the weights (the four matrices of
every layer; quantize-dequantize), the KV cache (the compressed cache of
`kernels.kv_cache`), and both. Greedy agreement: the share of 32 generated tokens equal
to the uncompressed run, over 12 chat prompts.
Writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from offload.api.llm import LLM
from offload.core.sampling import SamplingParams
from offload.executor.runner import PlainRunner
from offload.kernels.formats import Compression
from offload.models.batch import PaddedBatch

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "public_domain.txt"
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "Give me a synonym for quick.",
    "What is the boiling point of water?",
    "Name a planet in our solar system.",
    "What language is spoken in Brazil?",
    "How many days are in a week?",
    "What is photosynthesis?",
    "Suggest a name for a dog.",
    "What is the largest ocean?",
]


def perplexity(llm: LLM, ids: list[int], window: int) -> float:
    """Teacher-forced, one token a step (decode), in windows with a fresh cache: every
    prediction but a window's first reads the (possibly compressed) KV cache, as
    generation does (a prefill attends over its fresh K/V at full precision)."""
    nll, count = 0.0, 0
    runner = llm.runner
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        if len(chunk) < 2:
            break
        batch = PaddedBatch(llm.config, [chunk[:1]], len(chunk) - 1, 0)
        runner.start(batch)
        logits = runner.forward(batch.prompt_ids, runner.step_inputs(batch, 0, 1))
        for i in range(1, len(chunk)):
            logp = torch.log_softmax(logits[0].float(), dim=-1)
            nll -= logp[chunk[i]].item()
            count += 1
            if i + 1 < len(chunk):
                token = torch.tensor([[chunk[i]]])
                logits = runner.forward(token, runner.step_inputs(batch, i, 1))
    return math.exp(nll / count)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--only", nargs="*", help="variant names to run (with the uncompressed)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    llm = LLM("demo", device="cpu", dtype="float32", batch_size=12)
    ids = llm.tokenizer.encode(TEXT.read_text())
    params = SamplingParams(max_new_tokens=32)
    int4 = Compression(bits=4, group_size=64, symmetric=False)
    int8 = Compression(bits=8, group_size=64, symmetric=False)
    variants = {
        "none": (None, None),
        "int4-g64 weights": (int4, None),
        "int4-g64 kv": (None, int4),
        "int4-g64 weights + kv": (int4, int4),
        "int8-g64 weights + kv": (int8, int8),
        "int4-g32 weights": (Compression(bits=4, group_size=32), None),
        "int4-g32 kv": (None, Compression(bits=4, group_size=32)),
        "int4-g128 kv": (None, Compression(bits=4, group_size=128)),
        "int4-g32 weights + int4-g64 kv": (Compression(bits=4, group_size=32), int4),
    }
    if args.only:
        variants = {k: v for k, v in variants.items() if k == "none" or k in args.only}
    results, base_ppl, base_tokens = {}, None, None
    for name, (wc, kc) in variants.items():
        with llm.spec.open_weights() as source:
            llm.runner = PlainRunner(
                source, llm.dtype, llm.device, weight_compression=wc, kv_compression=kc
            )
        llm.loop.runner = llm.runner  # the decode loop holds the runner it was built with
        started = time.perf_counter()
        ppl = perplexity(llm, ids, args.window)
        outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)
        tokens = [o.token_ids for o in outs]
        if base_ppl is None:
            base_ppl, base_tokens = ppl, tokens
        same = sum(
            sum(a == b for a, b in zip(x, y, strict=False))
            for x, y in zip(tokens, base_tokens, strict=True)
        )
        total = sum(max(len(x), len(y)) for x, y in zip(tokens, base_tokens, strict=True))
        results[name] = {
            "perplexity": ppl,
            "vs_uncompressed": ppl / base_ppl - 1,
            "greedy_agreement": same / total,
            "seconds": time.perf_counter() - started,
        }
        print(
            f"{name:24s} ppl {ppl:8.3f} ({100 * (ppl / base_ppl - 1):+6.2f}%)  greedy agreement {100 * same / total:5.1f}%",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"accuracy_{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(
        json.dumps({"text_tokens": len(ids), "window": args.window, "results": results}, indent=1)
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
