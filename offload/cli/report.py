"""What offload-run tells the user: the progress bar, the summary line, `--stats` JSON
and the runner's memory and trace reports (through the `Runner` protocol only)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from offload.api.llm import LLM
from offload.core import progress
from offload.io.atomic import atomic_write
from offload.jobs.job import JobStats

# the caching allocator's counters a run reports: how often it met the hold's limit (each
# time it frees its cache and retries, a synchronization), how often it asked the driver
# for memory and gave it back, and its peak of blocks split and left free inside segments
ALLOCATOR_STATS = (
    "num_alloc_retries",
    "num_device_alloc",
    "num_device_free",
    "inactive_split_bytes.all.peak",
    "segment.all.peak",
)


def peak_rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_memory(llm: LLM) -> dict[str, int]:
    out = {"cpu_rss_bytes": peak_rss(), "gpu_bytes": 0, "disk_bytes": llm.runner.peak_disk_bytes()}
    if llm.device.type == "cuda":
        from offload.policies.caps import cuda_context_bytes

        context = cuda_context_bytes(llm.device)
        out["gpu_bytes"] = torch.cuda.max_memory_allocated(llm.device) + context
        # what the allocator held at most, with the context: what nvidia-smi shows
        out["gpu_reserved_bytes"] = torch.cuda.max_memory_reserved(llm.device) + context
        # whether it was held to the cap, and its counters (ALLOCATOR_STATS)
        out["gpu_held"] = llm.holds_gpu_allocator
        stats = torch.cuda.memory_stats(llm.device)
        out["gpu_allocator"] = {name: stats.get(name, 0) for name in ALLOCATOR_STATS}
    return out


def summary(llm: LLM, stats: JobStats, load_seconds: float) -> dict[str, Any]:
    s = llm.stats
    return {
        "requests": stats.total,
        "done_now": stats.done,
        "done_before": stats.skipped,
        "finish_reasons": dict(stats.reasons),
        "generated_tokens": s.generated_tokens,
        "tokens_per_second": s.tokens_per_second,
        "seconds": {
            "loading": load_seconds,
            "prefill": s.prefill_seconds,
            "decode": s.decode_seconds,
            "wall": time.perf_counter() - stats.started,
        },
        "blocks": _timeline(s.timeline, stats.started),
        "policy": llm.policy.to_dict() if llm.policy else None,
        "planned_for": _planned_for(llm),
        "predicted": _predicted(llm),
        # the chosen plan and its ranked neighbours (`policies.explain`)
        "candidates": [c.to_dict() for c in llm.plan.candidates],
        "peak_memory": peak_memory(llm),
        "memory": llm.runner.memory_report(),
        "experts": llm.runner.expert_report(),
    }


def _timeline(blocks: list[dict], job_started: float) -> dict[str, Any]:
    """Each block as it ran (rows, longest prompt, steps; its KV homes' start, prefill and
    decode seconds) and the job's time outside its blocks: reading, encoding, sorting,
    sampling's end of a block, result rows and their writes."""
    rows = [{k: v for k, v in b.items() if k != "began_s"} for b in blocks]
    inside = sum(b["start_s"] + b["prefill_s"] + b["decode_s"] for b in blocks)
    ends = [b["began_s"] + b["start_s"] + b["prefill_s"] + b["decode_s"] for b in blocks]
    gaps = [b["began_s"] - end for b, end in zip(blocks[1:], ends, strict=False)]
    return {
        "each": rows,
        "in_blocks_s": inside,
        "before_first_s": blocks[0]["began_s"] - job_started if blocks else 0.0,
        "between_s": sum(gaps),
        "after_last_s": time.perf_counter() - ends[-1] if ends else 0.0,
    }


def _predicted(llm: LLM) -> dict[str, Any] | None:
    """The job's predicted time (`policies.job`), where the plan has one."""
    prediction = llm.plan.prediction
    return None if prediction is None else prediction.to_dict()


def _job_line(info: dict[str, Any]) -> str | None:
    """The job's measured wall time (load included) beside its prediction."""
    predicted = info["predicted"]
    if predicted is None:
        return None
    took = info["seconds"]["loading"] + info["seconds"]["wall"]
    tokens = info["generated_tokens"]
    resumed = (
        f"; the prediction is the whole job's, {info['done_before']} requests were done before"
        if info["done_before"]
        else ""
    )
    return (
        f"job: {took:.1f} s, {tokens / took if took else 0.0:.1f} tok/s with the load "
        f"(predicted {predicted['seconds']:.1f} s, {predicted['tok_s']:.1f} tok/s; load "
        f"{info['seconds']['loading']:.1f} s, predicted {predicted['load']['seconds']:.1f} s"
        f"{resumed})"
    )


def _planned_for(llm: LLM) -> dict[str, int] | None:
    """The lengths the policy was sized and checked for (None: no policy, nothing sized)."""
    if llm.policy is None:
        return None
    prompt_tokens, new_tokens = llm.planned_for
    return {"prompt_tokens": prompt_tokens, "new_tokens": new_tokens}


def report(llm: LLM, stats: JobStats, load_seconds: float, stats_path: Path | None) -> None:
    """The summary line on stderr (and the runner's reports); `--stats` JSON, atomically."""
    info = summary(llm, stats, load_seconds)
    if stats_path is not None:
        try:
            atomic_write(stats_path, json.dumps(info, indent=1, default=str))
        except OSError as exc:  # (checked before the load; the drive changed since)
            print(f"offload-run: could not write --stats {stats_path} ({exc}); the results "
                  "are kept", file=sys.stderr)  # fmt: skip
    s = llm.stats
    print(
        f"offload-run: {_count(stats.total, 'request')}, {s.generated_tokens} tokens generated in "
        f"{s.seconds:.2f} s ({s.tokens_per_second:.1f} tok/s; prefill {s.prefill_seconds:.2f} s, "
        f"decode {s.decode_seconds:.2f} s); load {load_seconds:.1f} s; peak RSS "
        f"{info['peak_memory']['cpu_rss_bytes'] / 1e9:.2f} GB; "
        + ", ".join(f"{k} {v}" for k, v in sorted(stats.reasons.items())),
        file=sys.stderr,
    )
    line = _job_line(info)
    if line is not None:
        print(f"offload-run: {line}", file=sys.stderr)
    if llm.policy is None:
        return
    trace = llm.runner.trace_report()
    if trace:
        print(trace, file=sys.stderr)
    gpu, reserved = info["peak_memory"]["gpu_bytes"], info["peak_memory"].get("gpu_reserved_bytes")
    held = " held to --gpu-mem" if info["peak_memory"].get("gpu_held") else ""
    print(
        f"peak GPU {gpu / 1e9:.2f} GB (allocated + CUDA context"
        + (f"; {reserved / 1e9:.2f} GB reserved{held}" if reserved else "")
        + f"); peak host RSS "
        f"{info['peak_memory']['cpu_rss_bytes'] / 1e9:.2f} GB",
        file=sys.stderr,
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


class Progress:
    """The job's progress: requests, tokens, tok/s now and on average, phase, peak memory
    (a bar on a terminal, plain lines in a log: `api.progress`)."""

    def __init__(self, stats: JobStats, llm: LLM) -> None:
        self.stats, self.llm = stats, llm
        self.bar = progress.Progress(stats.total, "Requests", "req", initial=stats.skipped)
        self.last_t, self.last_tokens, self.rate = time.perf_counter(), 0, 0.0
        llm.on_phase = self.set_phase

    def _postfix(self) -> str:
        s, mem = self.llm.stats, peak_memory(self.llm)
        gpu = f" GPU {mem['gpu_bytes'] / 1e9:.1f}GB" if mem["gpu_bytes"] else ""
        return (
            f"{s.generated_tokens} tok, {self.rate:.1f} tok/s now, {s.tokens_per_second:.1f} avg, "
            f"{self.stats.phase}, RSS {mem['cpu_rss_bytes'] / 1e9:.1f}GB{gpu}"
        )

    def set_phase(self, name: str) -> None:
        self.stats.phase = name
        self.bar.update(status=self._postfix())

    def update(self) -> None:
        now, gen = time.perf_counter(), self.llm.stats.generated_tokens
        self.rate = (gen - self.last_tokens) / max(now - self.last_t, 1e-9)  # the last block
        self.last_t, self.last_tokens = now, gen
        self.bar.update(self.stats.done + self.stats.skipped, self._postfix())

    def close(self) -> None:
        self.bar.close()
