"""The disk-KV staging depth, one depth against another in one process (a diagnostic).

    python scripts/disk_depth_ab.py --model llama-3.1-8b \
        --policies w4gpu-kv4-cpu-disk-gpuattn-8x2,w4gpu-kv-cpu-disk-gpuattn-8x2 --reps 2
    python scripts/disk_depth_ab.py --model opt-30b --policies w4gpu-kv4-cpu-disk-gpuattn-8x2

Each repetition generates one block of each hand policy (`validate_cost_model.py`'s,
with KV rows on disk) at each depth in turn, through the engine's own loop
(`validate_cost_model.measure_policy`), so a drift of the machine falls on every depth
alike. Dummy weights, prompt 512, gen 32; KV spills to --nvme. Prints each run's decode
step and writes every run to JSON in --out (and $OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from validate_cost_model import hand_policies, measure_policy

from offload.models.resolve import resolve_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b", help="a preset (dummy weights)")
    p.add_argument("--policies", default="w4gpu-kv4-cpu-disk-gpuattn-8x2")
    p.add_argument("--depths", default="2,4", help="disk staging blocks, in turn")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--nvme", type=Path, default=Path("."), help="where KV spills to disk")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    plans = hand_policies()
    names = args.policies.split(",")
    for name in names:
        if name not in plans or not plans[name].kv_cache.disk:
            p.error(f"--policies: {name!r} is not a hand policy with KV on disk")
    depths = [int(d) for d in args.depths.split(",")]
    spec = resolve_model(args.model, dummy=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    runs: dict[str, list[dict]] = {}
    for _ in range(args.reps):
        for depth in depths:
            for name in names:
                got = measure_policy(
                    spec, plans[name], dtype, device, args.prompt_len, args.gen_len,
                    disk_buffers=depth, nvme_dir=args.nvme,
                )  # fmt: skip
                runs.setdefault(f"{name} depth {depth}", []).append(got)
                print(
                    f"{name} depth {depth}: step {got['decode_step_s'] * 1e3:.1f} ms, "
                    f"{got['total_tok_s']:.1f} tok/s",
                    flush=True,
                )
    result = {
        "model": args.model,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "runs": runs,
    }
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for folder in {args.out, Path(os.environ.get("OUT", args.out))}:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"disk_depth_ab_{args.model}_{stamp}.json").write_text(
            json.dumps(result, indent=1)
        )


if __name__ == "__main__":
    main()
