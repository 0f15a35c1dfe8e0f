"""The host's time and launches a mixture-of-experts layer takes a step, against a dense
layer of the same shape, in the executor on this machine's CPU.

    python scripts/lab/moe_host_time.py [--micro 12] [--rows 40] [--prompt 16]

A toy Mixtral (hidden 64, 8 experts of 128, top 2; 4 layers) and a toy Llama of the
same attention whose MLP is as wide as two experts, under the searched Mixtral-8x7B
plan's shape (12 micro-batches of 40 sequences, every weight in pinned memory, 69% of
the KV there): each decode step's wall time (the compute is a few microseconds of
toy matmuls, so it is the executor's own time: Python, the dispatcher and, on CUDA,
the launches), and under torch's profiler the ATen ops a layer runs in a step and the
host reads of device values (`aten::_local_scalar_dense`, `.item()`; `tolist`'s copy
shows as `aten::to` to the CPU). On a GPU each op is at least one launch and every
host read a sync. Prints one table; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import _path  # noqa: F401  (scripts/ on the path)
import torch
from benchlib import fmt
from torch.utils._python_dispatch import TorchDispatchMode

from offload.api.llm import LLM
from offload.core.presets import PRESETS
from offload.core.sampling import SamplingParams
from offload.executor.executor import Executor
from offload.executor.experts import ExpertFetcher
from offload.models import moe
from offload.policies.policy import Placement, Policy

TOY = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 16}
TOY |= {"num_key_value_heads": 2, "vocab_size": 512, "intermediate_size": 128}


def _model(directory: Path, preset: str, **extra) -> str:
    hf = {**PRESETS[preset], **TOY, **extra}
    path = directory / preset
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    return str(path)


PHASES = {
    "attention": (Executor, "_one_behind"),
    "route": (moe, "route"),
    "expert_rows": (moe, "expert_rows"),
    "experts": (ExpertFetcher, "run"),
    "out": (moe, "post"),
}


class _Ops(TorchDispatchMode):
    """Counts the ATen ops dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def _wrap(seconds: dict, ops: dict, counting: list) -> list:
    """Each phase's function timed (and its ops counted while counting[0]); the
    originals, to put back."""
    saved = []
    for name, (owner, attr) in PHASES.items():
        original = getattr(owner, attr)
        saved.append((owner, attr, original))

        def wrapped(*a, _f=original, _n=name, **k):
            if counting[0]:
                with _Ops() as mode:
                    out = _f(*a, **k)
                ops[_n] = ops.get(_n, 0) + mode.count
                return out
            started = time.perf_counter()
            out = _f(*a, **k)
            seconds[_n] = seconds.get(_n, 0.0) + time.perf_counter() - started
            return out

        setattr(owner, attr, wrapped)
    return saved


def measure(model: str, policy: Policy, prompt: int, steps: int) -> dict:
    """Per decode step: its wall time and each phase's host time (median over the
    steps), and one step's ATen ops by phase."""
    llm = LLM(model, dummy=True, device="cpu", dtype="float32", policy=policy, gen_len=steps)
    runner = llm.runner
    forward = runner.forward
    seconds: dict = {}
    ops: dict = {}
    counting = [False]
    per_step: list[dict] = []

    def timed(token_ids, step, *a, **k):
        decode = token_ids.shape[1] == 1
        seconds.clear()
        counting[0] = decode and len(per_step) == steps // 2 and not ops
        started = time.perf_counter()
        out = forward(token_ids, step, *a, **k)
        if decode and not counting[0]:
            per_step.append({"step": time.perf_counter() - started, **seconds})
        counting[0] = False
        return out

    runner.forward = timed
    saved = _wrap(seconds, ops, counting)
    try:
        prompts = [[5 + (i * 7 + j) % 400 for j in range(prompt)] for i in range(policy.block_size)]
        llm.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True))
    finally:
        for owner, attr, original in saved:
            setattr(owner, attr, original)
        llm.close()
    keys = per_step[0].keys()
    return {
        "seconds": {k: statistics.median(s.get(k, 0.0) for s in per_step) for k in keys},
        "ops": ops,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--micro", type=int, default=12, help="micro-batches")
    p.add_argument("--rows", type=int, default=40, help="sequences a micro-batch")
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(1)
    policy = Policy(
        gpu_batch_size=args.rows,
        num_gpu_batches=args.micro,
        weights=Placement(0.0, 1.0, 0.0),
        kv_cache=Placement(0.3125, 0.6875, 0.0),
    )
    with tempfile.TemporaryDirectory() as tmp:
        r = measure(_model(Path(tmp), "mixtral-8x7b"), policy, args.prompt, args.steps)
    layers = TOY["num_hidden_layers"]
    print(f"{args.micro} x {args.rows} sequences, {layers} layers, {torch.get_num_threads()} "
          f"thread(s), this machine's CPU; a decode step (median of {args.steps - 1})")  # fmt: skip
    print(f"{'phase':12s} {'ms/layer':>9s} {'ATen ops/layer':>15s}")
    for name in ("step", *PHASES):
        ms = 1e3 * r["seconds"].get(name, 0.0) / layers
        n = r["ops"].get(name) if name != "step" else sum(r["ops"].values())
        print(f"{name:12s} {ms:9.2f} {fmt(n and n / layers, '.0f'):>15s}")


if __name__ == "__main__":
    main()
