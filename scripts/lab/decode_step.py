"""Where a decode step's time goes: host issue, GPU busy by kernel, the step's wall time.

    python scripts/lab/decode_step.py --policy policy.json [--model opt-30b] [--rows 12]
        [--compress int4-g64 --kv-compress int4-g64]

Loads the model (dummy weights) through the engine with the policy (its warm-up
included), prefills `--rows` prompts of `--prompt-len` tokens, then times decode steps
four ways: each with its sync and an argmax as the decode loop does; the host's issue
time (until the step's own sync); the GPU timeline between CUDA events around a step;
and the GPU's busy time by kernel (torch profiler). A host issue time near the GPU's
busy time means the host sets the step; a timeline well above the busy time means gaps
between kernels. JSON in --out.
"""

from __future__ import annotations

import argparse
import json
import time

import _path  # noqa: F401  (scripts/ on the path)
import torch
from benchlib import add_probe_args, probe_llm
from torch.profiler import ProfilerActivity, profile

from offload.models.batch import PaddedBatch

STEPS = 10


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_probe_args(p)
    p.add_argument("--rows", type=int, help="sequences (default: the policy's block)")
    args = p.parse_args()
    llm = probe_llm(args, gen_len=64)
    ex = llm.runner
    rows = args.rows or ex.policy.block_size
    prompts = [[5 + j] * args.prompt_len for j in range(rows)]
    batch = PaddedBatch(llm.config, prompts, 4 * STEPS + 8, pad_id=1)
    ex.start(batch)
    ex.forward(batch.prompt_ids, ex.step_inputs(batch, 0, args.prompt_len))
    ids = torch.ones((rows, 1), dtype=torch.long)
    position = [args.prompt_len]

    def step() -> torch.Tensor:
        logits = ex.forward(ids, ex.step_inputs(batch, position[0], 1))
        position[0] += 1
        return logits

    for _ in range(3):  # the eager step that compiles, the capture, one more
        step()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(STEPS):
        step().argmax(-1).cpu()
    wall = (time.perf_counter() - began) / STEPS
    issue, timeline = [], []
    sync, marks = ex._sync, []
    ex._sync = lambda: (marks.append(time.perf_counter()), sync())  # the step's end
    for _ in range(STEPS):
        marks.clear()
        torch.cuda.synchronize()
        began = time.perf_counter()
        step()
        issue.append(marks[0] - began)
    ex._sync = sync
    for _ in range(STEPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        timeline.append(start.elapsed_time(end) / 1e3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            name = event.name[:60]
            kernels[name] = kernels.get(name, 0.0) + event.device_time / STEPS / 1e6
    result = {
        "model": args.model,
        "policy": ex.policy.to_dict(),
        "rows": rows,
        "context": args.prompt_len,
        "step_with_sync_s": wall,
        "host_issue_s": _median(issue),
        "gpu_timeline_s": _median(timeline),
        "gpu_busy_s": sum(kernels.values()),
        "gpu_by_kernel_s": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:12]),
    }
    ex.close()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"decode_step_{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(
        f"step {wall * 1e3:.1f} ms: host issue {result['host_issue_s'] * 1e3:.1f}, "
        f"GPU timeline {result['gpu_timeline_s'] * 1e3:.1f}, busy {result['gpu_busy_s'] * 1e3:.1f}"
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
