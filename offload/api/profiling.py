"""vLLM's profiling and clean-up habits: `LLM.start_profile()` / `stop_profile()` record
a `torch.profiler` trace (CPU, and CUDA where the engine runs on a GPU) and write it as
Chrome/Perfetto JSON into a directory given as vLLM gives it: `LLM(profiler_config=
{"profiler": "torch", "torch_profiler_dir": DIR})`, else OFFLOAD_TORCH_PROFILER_DIR, else
VLLM_TORCH_PROFILER_DIR (which vLLM's examples set); `LLM.get_metrics` (`core.metrics`)
beside them. `cleanup_dist_env_and_memory` is vLLM's call between two engines in one
process.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import torch

from offload.core.errors import UserError
from offload.core.metrics import EngineMetrics, Metric

PROFILER_DIR_ENVS = ("OFFLOAD_TORCH_PROFILER_DIR", "VLLM_TORCH_PROFILER_DIR")

log = logging.getLogger(__name__)


def profiler_dir(config: Any) -> Path | None:
    """The trace directory: vLLM's `profiler_config` (a dict or an object with
    `profiler` and `torch_profiler_dir`), else the environment's; None: none given."""
    if config is not None:
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        kind = get("profiler", "torch")
        if kind not in (None, "torch"):
            raise UserError(
                f"profiler_config profiler={kind!r}: offload records torch.profiler traces "
                "only; give profiler='torch'"
            )
        where = get("torch_profiler_dir", None)
        if where:
            return Path(where).expanduser()
    for name in PROFILER_DIR_ENVS:
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    return None


class TorchProfile:
    """One engine's profiler: started and stopped by the caller, its trace a file in
    `directory` named by the prefix, host, process and time."""

    def __init__(self, directory: Path | None, device: torch.device) -> None:
        self.directory, self.device = directory, device
        self.running: Any = None
        self.prefix = "offload"

    def start(self, prefix: str | None = None, profiler_kwargs: dict | None = None) -> None:
        if self.directory is None:
            raise UserError(
                "start_profile() needs a trace directory: LLM(profiler_config={'profiler': "
                f"'torch', 'torch_profiler_dir': DIR}}) or {PROFILER_DIR_ENVS[0]}=DIR"
            )
        if self.running is not None:
            raise UserError("the profiler is running already; call stop_profile() first")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prefix = prefix or "offload"
        self.running = torch.profiler.profile(activities=activities, **(profiler_kwargs or {}))
        self.running.start()

    def stop(self) -> Path:
        if self.running is None:
            raise UserError("the profiler is not running; call start_profile() first")
        running, self.running = self.running, None
        running.stop()
        assert self.directory is not None
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"{self.prefix}_{socket.gethostname()}_{os.getpid()}.{time.time_ns()}"
        path = self.directory / f"{name}.pt.trace.json"
        running.export_chrome_trace(str(path))
        log.info("profile written to %s (open it in Perfetto or chrome://tracing)", path)
        return path


class MetricsAndProfiler:
    """`LLM`'s vLLM metrics and profiler calls, over its `metrics` (`core.metrics`) and
    `profile` (a `TorchProfile`)."""

    metrics: EngineMetrics
    profile: TorchProfile

    def get_metrics(self) -> list[Metric]:
        """vLLM's: counters, gauges and histograms of the engine's requests so far
        (`offload.v1.metrics.reader` holds the classes)."""
        return self.metrics.snapshot()

    def start_profile(
        self, profile_prefix: str | None = None, *, profiler_kwargs: dict | None = None
    ) -> None:
        """vLLM's: a torch.profiler trace from now to `stop_profile`."""
        self.profile.start(profile_prefix, profiler_kwargs)

    def stop_profile(self) -> Path:
        """Stop the profiler and write its trace; returns the file."""
        return self.profile.stop()


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """vLLM's call between two engines in one process: what a closed engine left is
    collected and the GPU's cache handed back (no distributed state is kept here; an
    `LLM` frees its own pinned memory and files on `close`)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
