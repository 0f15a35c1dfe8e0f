"""Where one decode step's time goes: torch.profiler over the executor for a policy.

    python scripts/profile_step.py --model opt-30b --policy policy.json [--batch-rows N]

Loads the model (dummy weights), runs the prefill and two warm-up decode steps, then
profiles three decode steps and prints the top operators by CUDA and by CPU time.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from offload.core.sampling import SamplingParams, sample
from offload.executor.executor import Executor
from offload.models.batch import PaddedBatch
from offload.models.resolve import resolve_model
from offload.policies.policy import Policy


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="opt-30b")
    p.add_argument("--policy", type=Path, required=True)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--python", type=int, default=0, help="also print N top host functions")
    args = p.parse_args()
    spec = resolve_model(args.model, dummy=True)
    policy = Policy.from_file(args.policy)
    ex = Executor(spec.open_weights(), policy, torch.float16, torch.device("cuda"))
    prompts = [[5 + i] * args.prompt_len for i in range(policy.block_size)]
    batch = PaddedBatch(spec.config, prompts, 8, pad_id=1)
    ex.start(batch)
    greedy = SamplingParams(max_new_tokens=8)
    logits = ex.forward(batch.prompt_ids, ex.step_inputs(batch, 0, args.prompt_len))
    pos = args.prompt_len
    for _ in range(2):
        ids = sample(logits, greedy)
        logits = ex.forward(ids[:, None], ex.step_inputs(batch, pos, 1))
        pos += 1
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        for _ in range(3):
            ids = sample(logits, greedy)
            logits = ex.forward(ids[:, None], ex.step_inputs(batch, pos, 1))
            pos += 1
        torch.cuda.synchronize()
        step = (time.perf_counter() - started) / 3
    print(f"decode step {step * 1e3:.1f} ms")
    if args.python:  # host-side Python: where the launching thread spends a step
        import cProfile
        import pstats

        host = cProfile.Profile()
        host.enable()
        for _ in range(3):
            ids = sample(logits, greedy)
            logits = ex.forward(ids[:, None], ex.step_inputs(batch, pos, 1))
            pos += 1
        host.disable()
        pstats.Stats(host).sort_stats("tottime").print_stats(args.python)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    ex.close()


if __name__ == "__main__":
    main()
