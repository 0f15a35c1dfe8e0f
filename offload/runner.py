"""The plain single-device runner: every weight and the KV cache on one device.

It is the reference every offloading policy is checked against, and the runner the
engine uses when the model fits. A runner exposes `start(batch)` (a fresh KV cache for
a `PaddedBatch`) and `forward(token_ids, step, last_only)` (one step of the stack);
the offloading executor offers the same two calls.
"""

from __future__ import annotations

import logging
import time

import torch

from offload.batch import PaddedBatch
from offload.config import ModelConfig
from offload.kernels.formats import Compression
from offload.kernels.quant import fake_quantize, is_quantized
from offload.models import decoder, ops
from offload.models.decoder import LayerKV, StepInputs, Weights
from offload.models.weights import WeightSource


def _compressed(weights: Weights, config: Compression | None) -> Weights:
    """The values a compressed run computes with (quantize, dequantize)."""
    if config is None:
        return weights
    return {
        k: fake_quantize(v, config) if is_quantized(k, tuple(v.shape), config) else v
        for k, v in weights.items()
    }


log = logging.getLogger(__name__)


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
            from tqdm import tqdm

            layers = tqdm(layers, desc="loading layers", unit="layer", leave=False)
        self.layer_w: list[Weights] = [
            _compressed(source.layer(i, dtype, device), weight_compression) for i in layers
        ]
        self.kv_compression = kv_compression
        # a tied head shares the embedding already loaded instead of loading it again
        head_w = source.stored_stage("head", 0, dtype, device)
        head_w.setdefault("lm_head.weight", self.embed_w["tok.weight"])
        self.head_w: Weights = _compressed(head_w, weight_compression)
        self.load_seconds = time.perf_counter() - started
        self.inv_freq = ops.rope_inv_freq(self.cfg, device) if self.cfg.family == "llama" else None
        self._cache: list[LayerKV] = []

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
        return batch.step_inputs(cache_start, num_new, self.dtype, self.device, self.inv_freq)

    @torch.inference_mode()
    def forward(
        self, token_ids: torch.Tensor, step: StepInputs, last_only: bool = True
    ) -> torch.Tensor:
        """Run new tokens [B, T] through the stack; fp32 logits [B, V] (or [B, T, V])."""
        x = decoder.embed(self.cfg, self.embed_w, token_ids.to(self.device), step.positions)
        for weights, kv in zip(self.layer_w, self._cache, strict=True):
            x = decoder.layer_forward(self.cfg, weights, x, step, kv)
        if last_only:
            x = x[:, -1:]
        logits = decoder.head(self.cfg, self.head_w, x)
        return logits[:, -1] if last_only else logits
