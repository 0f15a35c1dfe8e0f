"""What offload-run tells the user: the progress bar, the summary line, `--stats` JSON
and the runner's memory and trace reports (through the `Runner` protocol only)."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from offload.api.llm import LLM
from offload.core import progress
from offload.io.atomic import atomic_write
from offload.jobs.job_loop import JobStats

STATS_EVERY_S = 5.0  # between --stats rewrites while a job runs

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
        info["run"] = run_info(llm, stats, load_seconds, "finished")
        write_stats(stats_path, info)
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


def write_stats(path: Path, info: dict[str, Any]) -> None:
    """`--stats` JSON, atomically (a reader sees the last whole file, never a torn one)."""
    try:
        atomic_write(path, json.dumps(info, indent=1, default=str))
    except OSError as exc:  # (checked before the load; the drive changed since)
        print(f"offload-run: could not write --stats {path} ({exc}); the results are kept",
              file=sys.stderr)  # fmt: skip


def machine() -> dict[str, Any]:
    """The machine a run ran on: host, GPU, CPUs, RAM."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"hostname": socket.gethostname(), "gpu": gpu, "gpus": torch.cuda.device_count(),
            "cpu_count": os.cpu_count(), "ram_bytes": ram}  # fmt: skip


def run_info(llm: LLM, stats: JobStats, load_seconds: float, state: str) -> dict[str, Any]:
    """What produced a `--stats` file and where it stands: the model as named, offload's
    version, the command line, the start (the load's) and the machine; state: running,
    finished or interrupted."""
    import offload

    now = time.time()
    started = now - (time.perf_counter() - stats.started) - load_seconds
    return {
        "state": state,
        "model": llm.model_name,
        "model_path": str(llm.spec.path) if llm.spec.path else None,
        "revision": llm.args.revision,
        "offload_version": offload.__version__,
        "argv": sys.argv,
        "started": _iso(started),
        "updated": _iso(now),
        "machine": machine(),
    }


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="seconds")


class LiveStats:
    """`--stats` rewritten while the job runs, every `every_s` (checked at each decode
    step and block: a clock read), so another process can watch a long job."""

    def __init__(self, path: Path, llm: LLM, stats: JobStats, every_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.path, self.llm, self.stats = path, llm, stats
        self.every_s = STATS_EVERY_S if every_s is None else every_s
        self.clock = clock
        self.last = clock()
        self.write("running")

    def tick(self) -> None:
        if self.clock() - self.last >= self.every_s:
            self.write("running")

    def write(self, state: str) -> None:
        self.last = self.clock()
        load_seconds = self.llm.load_seconds
        info = summary(self.llm, self.stats, load_seconds)
        info["run"] = run_info(self.llm, self.stats, load_seconds, state)
        write_stats(self.path, info)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


class Progress:
    """The job's progress: requests, tokens, tok/s now and on average, the decode step
    rate and the job's ETA (the plan's steps at the rate measured), phase, peak memory (a
    bar on a terminal, plain lines in a log: `core.progress`). It moves within a block:
    `on_step` is called at each decode step (counted on the host)."""

    def __init__(self, stats: JobStats, llm: LLM, clock: Callable[[], float] | None = None):
        self.stats, self.llm = stats, llm
        self.bar = progress.Progress(
            stats.total, "Requests", "req", initial=stats.skipped, clock=clock
        )
        self.last_t, self.last_tokens, self.rate = time.perf_counter(), 0, 0.0
        self.steps, self.total_steps = 0, planned_steps(llm, stats)
        self.first_step: float | None = None
        llm.on_phase = self.set_phase

    def _postfix(self) -> str:
        s, mem = self.llm.stats, peak_memory(self.llm)
        gpu = f" GPU {mem['gpu_bytes'] / 1e9:.1f}GB" if mem["gpu_bytes"] else ""
        return (
            f"{s.generated_tokens} tok, {self.rate:.1f} tok/s now, {s.tokens_per_second:.1f} avg, "
            f"{self._steps()}{self.stats.phase}, RSS {mem['cpu_rss_bytes'] / 1e9:.1f}GB{gpu}"
        )

    def _steps(self) -> str:
        """The step rate since the first step and, with a plan's prediction, the ETA."""
        if self.first_step is None or self.steps < 2:
            return ""
        per_s = (self.steps - 1) / max(self.bar.clock() - self.first_step, 1e-9)
        eta = ""
        if self.total_steps:
            left = max(self.total_steps - self.steps, 0)
            eta = f", ETA {_duration(left / per_s)}" if per_s else ""
        return f"{per_s:.2f} steps/s{eta}, "

    def on_step(self) -> None:
        self.steps += 1
        if self.first_step is None:
            self.first_step = self.bar.clock()
        self.rate = self._block_rate(self.llm.stats.generated_tokens)
        self.bar.tick(self._postfix)

    def _block_rate(self, tokens: int) -> float:
        """tok/s since the last block ended (within a block: so far in it)."""
        return (tokens - self.last_tokens) / max(time.perf_counter() - self.last_t, 1e-9)

    def set_phase(self, name: str) -> None:
        self.stats.phase = name
        self.bar.update(status=self._postfix())

    def update(self) -> None:
        now, gen = time.perf_counter(), self.llm.stats.generated_tokens
        self.rate = self._block_rate(gen)  # the last block
        self.last_t, self.last_tokens = now, gen
        self.bar.update(self.stats.done + self.stats.skipped, self._postfix())

    def close(self) -> None:
        self.bar.close()


def planned_steps(llm: LLM, stats: JobStats) -> int | None:
    """The decode steps the plan's prediction counts for what is left of the job (each
    block at its budget: an early EOS makes the ETA an upper bound); None: no prediction."""
    prediction = llm.plan.prediction
    if prediction is None or not stats.total:
        return None
    steps = sum(n * block.gen_len for block, n, _ in prediction.blocks)
    return round(steps * (1 - stats.skipped / stats.total))


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"
