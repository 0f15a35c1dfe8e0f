"""The runner contract (`Runner`), and the plain single-device runner.

`engine.LLM` drives a `Runner`: `PlainRunner` here (every weight and the KV cache on
one device: the reference every offloading policy is checked against, and the runner
when the model fits) or the offloading `executor.Executor`. Callers (the engine, the
CLI's reports) use only what `Runner` names.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from offload.core.config import ModelConfig
from offload.core.progress import tracked
from offload.io.tiers import Tier
from offload.kernels import cpu_attention
from offload.kernels.formats import Compression
from offload.kernels.quant import QTensor, dequantize, fake_quantize, is_quantized
from offload.models import decoder, ops
from offload.models.attention import LayerKV
from offload.models.batch import PaddedBatch
from offload.models.decoder import StepInputs
from offload.models.shapes import Weights
from offload.models.weights import WeightSource


def _compressed(weights: Weights, config: Compression | None) -> Weights:
    """The values a compressed run computes with (quantize, dequantize); a pre-quantized
    checkpoint's matrices (`QTensor`s) are those values already, an fp8 checkpoint's in
    another format are converted from their dequantized values."""
    if config is None:
        return weights
    out = {}
    for k, v in weights.items():
        if isinstance(v, QTensor) and v.config.fp8 and v.config != config:
            v = dequantize(v)
        quantize = is_quantized(k, tuple(v.shape), config) and not isinstance(v, QTensor)
        out[k] = fake_quantize(v, config) if quantize else v
    return out


log = logging.getLogger(__name__)


@runtime_checkable
class Runner(Protocol):
    """What the engine and the CLI ask of a runner."""

    load_seconds: float

    def start(self, batch: PaddedBatch) -> None:
        """A fresh KV cache for this batch (replacing the last one)."""

    def step_inputs(self, batch: PaddedBatch, cache_start: int, num_new: int) -> StepInputs:
        """Positions, mask and rotary tables of a step, on the runner's device."""

    def forward(
        self,
        token_ids: torch.Tensor,
        step: StepInputs,
        last_only: bool = True,
        wait: bool = True,
    ) -> torch.Tensor:
        """New tokens [B, T] through the stack: fp32 logits [B, V] (or [B, T, V]).
        wait=False: the call may return once the step is issued, its logits ready in
        stream order (a runner may wait anyway)."""

    @property
    def kv_pool_bytes(self) -> int:
        """Host bytes held for the KV cache's pool (part of the process RSS)."""

    def memory_report(self) -> dict[str, Any]:
        """Bytes per tier the runner holds now and at peak."""

    def peak_disk_bytes(self) -> int:
        """The most disk bytes (KV spill) held at once."""

    def trace_report(self) -> str | None:
        """Per-lane busy time of the last traced step (None when not tracing)."""

    def expert_report(self) -> dict | None:
        """A mixture of experts' placement and traffic over the job, layer by layer
        (`executor.experts.ExpertFetcher.report`; None: no experts streamed)."""

    def write_trace(self, path: Path) -> bool:
        """A Chrome/Perfetto trace of the last step; False when there is none."""

    def close(self) -> None:
        """Release pinned memory, spill files and threads."""


def prefill_trace_path(path: Path) -> Path:
    """Where `write_trace` puts the last prefill's trace beside the last step's."""
    return path.with_name(f"{path.stem}_prefill{path.suffix}")


class LaneReports:
    """The memory and trace reports of a runner with a `ledger`, `tracer`, `traces`,
    `last_spans` and `prefill_spans` (the last traced decode step's and prefill's
    resolved spans)."""

    def peak_disk_bytes(self) -> int:
        return self.ledger.peak(Tier.DISK)

    def write_trace(self, path: Path) -> bool:
        """The last traced decode step's trace at path (the last traced prefill's where
        no decode step was traced), and the last traced prefill's beside it
        (<stem>_prefill<suffix>)."""
        if not (self.tracer.enabled or self.tracer.asked):
            return False
        if self.last_spans is None:
            self.tracer.write_chrome(path, self.prefill_spans)
            return True
        self.tracer.write_chrome(path, self.last_spans)
        if self.prefill_spans is not None:
            self.tracer.write_chrome(prefill_trace_path(path), self.prefill_spans)
        return True

    def trace_report(self) -> str | None:
        if not self.traces:
            return None
        last = self.traces[-1]
        lane, busy = last.busiest
        lines = [
            f"last step {last.seconds * 1e3:.1f} ms; busiest lane {lane} {busy * 1e3:.1f} ms; "
            f"overlap efficiency {busy / last.seconds:.2f}"
        ]
        for name, stats in last.lanes.items():
            rate = stats["bytes"] / stats["busy_s"] / 1e9 if stats["busy_s"] else 0.0
            lines.append(f"  {name:9s} busy {stats['busy_s'] * 1e3:8.1f} ms  {rate:7.2f} GB/s")
        return "\n".join(lines)


class PlainRunner:
    """Holds the whole model on `device` in `dtype`, loaded stage by stage."""

    def __init__(
        self,
        source: WeightSource,
        dtype: torch.dtype,
        device: torch.device,
        progress: bool = False,
        weight_compression: Compression | None = None,
        kv_compression: Compression | None = None,
    ) -> None:
        """With weight compression given, the layer matrices take the values a compressed
        run computes with (quantize-dequantize): the reference for compressed runs. With
        KV compression the cache is compressed (`kernels.kv_cache`)."""
        self.cfg: ModelConfig = source.config
        self.dtype, self.device = dtype, device
        started = time.perf_counter()
        self.embed_w: Weights = source.embed(dtype, device)
        layers = range(self.cfg.num_layers)
        if progress:
            layers = tracked(layers, self.cfg.num_layers, "loading layers", "layer")
        self.layer_w: list[Weights] = [
            _compressed(source.layer(i, dtype, device), weight_compression) for i in layers
        ]
        self.kv_compression = kv_compression
        # a tied head shares the embedding already loaded instead of loading it again;
        # the embedding then reads the head's table as compressed (`io.layout`)
        head_w = source.stored_stage("head", 0, dtype, device)
        head_w.setdefault("lm_head.weight", self.embed_w["tok.weight"])
        self.head_w: Weights = _compressed(head_w, weight_compression)
        if self.cfg.tie_word_embeddings:
            self.embed_w["tok.weight"] = self.head_w["lm_head.weight"]
        if device.type == "cpu":
            # the CPU attention's C kernel, built here once a machine (cached), not
            # inside the first decode step: the demo's first run on a fresh machine
            # reported 1.0 tok/s, 6.8 s of its 7.5 s decode the build (2-core CI machine)
            cpu_attention.available(compressed=kv_compression is not None)
        self.load_seconds = time.perf_counter() - started
        self.rotary = ops.Rotary.of(self.cfg, device)
        self._cache: list[LayerKV] = []

    kv_pool_bytes = 0

    def memory_report(self) -> dict[str, Any]:
        if self.device.type != "cuda":
            return {}
        return {"gpu": {"now": torch.cuda.memory_allocated(self.device),
                        "peak": torch.cuda.max_memory_allocated(self.device)}}  # fmt: skip

    def peak_disk_bytes(self) -> int:
        return 0

    def trace_report(self) -> str | None:
        return None

    def expert_report(self) -> dict | None:
        return None

    def write_trace(self, path: Path) -> bool:
        return False

    def close(self) -> None:
        self._cache, self.layer_w = [], []

    def start(self, batch: PaddedBatch) -> None:
        """Allocate a fresh KV cache for this batch (replacing the last one)."""
        self._cache = []
        self._cache = [
            LayerKV(
                batch.size, self.cfg, batch.max_slots, self.dtype, self.device, self.kv_compression
            )
            for _ in range(self.cfg.num_layers)
        ]

    def step_inputs(self, batch: PaddedBatch, cache_start: int, num_new: int) -> StepInputs:
        return batch.step_inputs(cache_start, num_new, self.dtype, self.device, self.rotary)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        step: StepInputs,
        last_only: bool = True,
        wait: bool = True,
    ) -> torch.Tensor:
        """Run new tokens [B, T] through the stack; fp32 logits [B, V] (or [B, T, V]).
        (Stream-ordered where wait is False: no synchronize either way.)"""
        x = decoder.embed(self.cfg, self.embed_w, token_ids.to(self.device), step.positions)
        for layer, (weights, kv) in enumerate(zip(self.layer_w, self._cache, strict=True)):
            layer_step = decoder.layer_step(self.cfg, step, layer)
            x = decoder.layer_forward(self.cfg, weights, x, layer_step, kv)
        if last_only:
            x = x[:, -1:]
        logits = decoder.head(self.cfg, self.head_w, x)
        return logits[:, -1] if last_only else logits
