"""Same-process A/B of the decode loop issuing greedy steps ahead (`DecodeLoop._ahead`)
against waiting for every step: one block, alternated, decode seconds a step.

    python scripts/decode_ahead_ab.py --policy policy.json [--model opt-30b]
        [--compress int4-g64 --kv-compress int4-g64] [--reps 3]

Loads the model once (dummy weights), then generates the policy's block of prompts of
`--prompt-len` tokens, `--gen-len` tokens each (EOS ignored), with and without the
ahead issue in turn. Prints each run's decode step and prefill; JSON in --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchlib import add_probe_args, probe_llm

from offload.api.decode_loop import DecodeLoop
from offload.core.sampling import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_probe_args(p)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    llm = probe_llm(args, gen_len=args.gen_len)
    rows = llm.runner.policy.block_size
    prompts = [{"prompt_token_ids": [5 + j] * args.prompt_len} for j in range(rows)]
    params = SamplingParams(max_new_tokens=args.gen_len, ignore_eos=True)
    llm.generate(prompts, params)  # anything left to compile or capture
    ahead = DecodeLoop._ahead
    runs = []
    for rep in range(args.reps):
        for mode in ("ahead", "wait"):
            DecodeLoop._ahead = ahead if mode == "ahead" else (lambda self, seqs: False)
            before = (llm.stats.prefill_seconds, llm.stats.decode_seconds)
            llm.generate(prompts, params)
            prefill = llm.stats.prefill_seconds - before[0]
            decode = llm.stats.decode_seconds - before[1]
            runs.append(
                {
                    "rep": rep,
                    "mode": mode,
                    "prefill_s": prefill,
                    "decode_step_s": decode / (args.gen_len - 1),
                }
            )
            print(
                f"rep {rep} {mode:5s} prefill {prefill:.4f} s, decode {runs[-1]['decode_step_s'] * 1e3:.2f} ms a step",
                flush=True,
            )
    DecodeLoop._ahead = ahead
    summary = {
        mode: statistics.median(r["decode_step_s"] for r in runs if r["mode"] == mode)
        for mode in ("ahead", "wait")
    }
    print({k: round(v * 1e3, 3) for k, v in summary.items()})
    result = {"model": args.model, "rows": rows, "runs": runs, "median_decode_step_s": summary}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"decode_ahead_ab_{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
