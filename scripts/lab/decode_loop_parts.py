"""A decode step's parts in the loop `scripts/validate_cost_model.py` times: the greedy
sample, the next step's inputs (`Executor.step_inputs`), and the executor's forward
with its sync. Medians over 31 steps from context 512, printed for two repetitions
(the second is the steady one).

    python scripts/lab/decode_loop_parts.py llama-3.1-8b policy.json

For an A/B of two trees, run it on each in turn (PYTHONPATH to each tree's `offload`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from offload.core.sampling import SamplingParams, sample
from offload.executor.executor import Executor
from offload.models.batch import PaddedBatch
from offload.models.resolve import resolve_model
from offload.policies.policy import Policy

PROMPT, STEPS = 512, 31


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a preset (dummy weights)")
    p.add_argument("policy", type=Path, help="policy JSON (offload-plan's)")
    args = p.parse_args()
    spec = resolve_model(args.model, dummy=True)
    policy = Policy.from_file(args.policy)
    ex = Executor(spec.open_weights(), policy, torch.float16, torch.device("cuda"))
    try:
        gen = torch.Generator().manual_seed(0)
        vocab = spec.config.vocab_size
        prompts = torch.randint(10, vocab - 10, (policy.block_size, PROMPT), generator=gen)
        batch = PaddedBatch(spec.config, prompts.tolist(), STEPS + 9, pad_id=1)
        greedy = SamplingParams(max_new_tokens=STEPS + 9)
        for rep in range(2):
            ex.start(batch)
            logits = ex.forward(batch.prompt_ids, ex.step_inputs(batch, 0, PROMPT))
            parts: dict[str, list[float]] = {"sample": [], "step_inputs": [], "forward": []}
            parts["step"] = []
            for t in range(STEPS):
                a = time.perf_counter()
                ids = sample(logits, greedy)
                b = time.perf_counter()
                step = ex.step_inputs(batch, PROMPT + t, 1)
                c = time.perf_counter()
                logits = ex.forward(ids[:, None], step)
                d = time.perf_counter()
                for name, seconds in zip(parts, (b - a, c - b, d - c, d - a), strict=True):
                    parts[name].append(seconds * 1e3)
            medians = {name: round(statistics.median(ms), 3) for name, ms in parts.items()}
            print(args.model, "rep", rep, medians, flush=True)
    finally:
        ex.close()


if __name__ == "__main__":
    main()
