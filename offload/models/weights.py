"""Weight sources: where the canonical tensors of each stage come from.

A source hands out one stage at a time (the embedding, layer i, the head) in the
canonical names of `offload.models.decoder`, converted to the run's dtype and device.
Nothing is read before it is asked for, so peak host memory stays near one layer plus
what the caller keeps. Three kinds: Hugging Face safetensors checkpoints
(`checkpoint.py`), GGUF files (`gguf_file.py`) and seeded dummy weights (here).
"""

from __future__ import annotations

import hashlib
import math
from abc import ABC, abstractmethod

import torch

from offload.core.config import ModelConfig
from offload.models.shapes import Weights, stage_shapes


class WeightSource(ABC):
    """Hands out canonical stage weights on demand. Use as a context manager."""

    config: ModelConfig

    @abstractmethod
    def stored_stage(
        self, stage: str, index: int, dtype: torch.dtype, device: torch.device
    ) -> Weights:
        """The stage's tensors as the source holds them (a tied head has no lm_head)."""

    def stored_shapes(self, stage: str, index: int = 0) -> dict[str, tuple[int, ...]]:
        """Canonical shapes of what the source itself holds for a stage (a tied head
        holds no lm_head of its own)."""
        shapes = stage_shapes(self.config, stage, index)
        if stage == "head" and self.config.tie_word_embeddings:
            del shapes["lm_head.weight"]
        return shapes

    def stage(self, stage: str, index: int, dtype: torch.dtype, device: torch.device) -> Weights:
        """Weights of "embed", ("layer", index) or "head", in dtype on device.

        The head always carries lm_head.weight; for tied embeddings it is the token
        embedding (callers holding both stages may share one tensor)."""
        weights = self.stored_stage(stage, index, dtype, device)
        if stage == "head" and "lm_head.weight" not in weights:
            weights["lm_head.weight"] = self.stored_stage("embed", 0, dtype, device)["tok.weight"]
        return weights

    def embed(self, dtype: torch.dtype, device: torch.device) -> Weights:
        return self.stage("embed", 0, dtype, device)

    def layer(self, index: int, dtype: torch.dtype, device: torch.device) -> Weights:
        if not 0 <= index < self.config.num_layers:
            raise IndexError(f"layer {index} out of range 0..{self.config.num_layers - 1}")
        return self.stage("layer", index, dtype, device)

    def head(self, dtype: torch.dtype, device: torch.device) -> Weights:
        return self.stage("head", 0, dtype, device)

    def close(self) -> None:  # noqa: B027 - sources without open files need nothing
        pass

    def __enter__(self) -> WeightSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


DRAW_ELEMENTS = 1 << 26  # 256 MiB of fp32 a draw


# the widest dummy router row's scale over the narrowest's (`DummySource`)
ROUTER_SKEW = 2.0


def _router_skew(experts: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Each expert's router-row scale: ROUTER_SKEW ** 0.5 down to its inverse,
    geometrically, in the generator's order."""
    steps = torch.linspace(0.5, -0.5, experts, device=device, dtype=torch.float32)
    order = torch.randperm(experts, generator=gen, device=device)
    return (ROUTER_SKEW**steps)[order]


class DummySource(WeightSource):
    """Deterministic random weights of realistic scale, generated per stage on demand.

    Linear weights ~ N(0, 1/fan_in) (unit-variance outputs, as trained models keep),
    embeddings ~ N(0, 1), norm weights 1 + N(0, 0.02^2), biases N(0, 0.02^2). Each
    tensor has its own seed derived from (seed, stage, layer, name), so any layer can be
    made alone and the same layer is the same on every call on the same device type.

    A mixture of experts' router rows are scaled by factors from sqrt(2) down to its
    inverse, spread over the experts in a seeded order: the wider an expert's logits, the more tokens
    choose it, so dummy routing is skewed as trained routers' are and placement by
    usage has something to find (`ROUTER_SKEW`).
    """

    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        self.config = config
        self.seed = seed

    def stored_stage(
        self, stage: str, index: int, dtype: torch.dtype, device: torch.device
    ) -> Weights:
        device = torch.device(device)
        out: Weights = {}
        for name, shape in self.stored_shapes(stage, index).items():
            gen = torch.Generator(device=device)
            gen.manual_seed(self._tensor_seed(stage, index, name))
            # drawn a slice at a time, so a giant (BLOOM's 250880 x 14336 table) never
            # holds an fp32 copy beside its own bytes: the draw's transient is one slice
            tensor = torch.empty(shape, dtype=dtype, device=device)
            flat = tensor.view(-1)
            for start in range(0, flat.numel(), DRAW_ELEMENTS):
                count = min(DRAW_ELEMENTS, flat.numel() - start)
                values = torch.randn(count, generator=gen, device=device, dtype=torch.float32)
                flat[start : start + count] = self._scale(name, shape, values)
            if name == "router.weight":
                tensor *= _router_skew(shape[0], gen, device).to(dtype)[:, None]
            out[name] = tensor
        return out

    def _tensor_seed(self, stage: str, index: int, name: str) -> int:
        digest = hashlib.sha256(f"{self.seed}/{stage}/{index}/{name}".encode()).digest()
        return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)

    @staticmethod
    def _scale(name: str, shape: tuple[int, ...], values: torch.Tensor) -> torch.Tensor:
        if name.endswith(".bias"):
            return values.mul_(0.02)
        if "norm" in name:
            return values.mul_(0.02).add_(1.0)
        if name in ("tok.weight", "pos.weight"):
            return values
        return values.mul_(1.0 / math.sqrt(shape[-1]))
