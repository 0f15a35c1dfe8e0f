"""Write N synthetic JSONL requests of mixed lengths (for job demos on dummy-weight models).

python scripts/make_prompts.py N OUT.jsonl [--min-chars 200] [--max-chars 500]
"""

from __future__ import annotations

import argparse
import json
import random

WORDS = [
    "the",
    "engine",
    "streams",
    "each",
    "layer",
    "of",
    "weights",
    "from",
    "memory",
    "while",
    "the",
    "previous",
    "layer",
    "computes",
    "and",
    "the",
    "batch",
    "moves",
    "through",
    "the",
    "model",
    "block",
    "by",
    "block",
    "until",
    "done",
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("n", type=int)
    p.add_argument("out")
    p.add_argument("--min-chars", type=int, default=200)
    p.add_argument("--max-chars", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    with open(args.out, "w") as f:
        for i in range(args.n):
            target = rng.randint(args.min_chars, args.max_chars)
            words: list[str] = []
            while sum(len(w) + 1 for w in words) < target:
                words.append(rng.choice(WORDS))
            f.write(json.dumps({"id": f"req-{i}", "prompt": " ".join(words)}) + "\n")


if __name__ == "__main__":
    main()
