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
from offload.kernels.formats import MXFP4_BLOCKS, MXFP4_SCALES
from offload.models import mxfp4
from offload.models.shapes import Part, Parts, Weights, stage_shapes


class WeightSource(ABC):
    """Hands out canonical stage weights on demand. Use as a context manager."""

    config: ModelConfig
    # whether the source makes its tensors on the compute device it is asked for, faster
    # there than on the CPU (dummy weights: a GPU draws them far faster)
    draws_on_device: bool = False
    # whether `stored_named` makes the named tensors alone (dummy draws, a checkpoint's
    # reads), so a stage can be made in pieces; else it makes the stage and picks
    makes_tensors_alone: bool = False

    @abstractmethod
    def stored_stage(
        self, stage: str, index: int, dtype: torch.dtype, device: torch.device
    ) -> Weights:
        """The stage's tensors as the source holds them (a tied head has no lm_head)."""

    def stored_parts(
        self, stage: str, index: int, dtype: torch.dtype, device: torch.device, parts: Parts
    ) -> Weights:
        """The stage's tensors as the source holds them, each cut to its part in `parts`
        (a name not in it: whole). Here the whole stage is made and cut; a source that
        can make a part alone (a checkpoint's slices, dummy tiles) makes only the part."""
        weights = self.stored_stage(stage, index, dtype, device)
        return {name: parts[name].take(t) if name in parts else t for name, t in weights.items()}

    def stored_named(
        self, stage: str, index: int, names: list[str], dtype: torch.dtype, device: torch.device
    ) -> Weights:
        """The stage's tensors of these names as the source holds them."""
        weights = self.stored_stage(stage, index, dtype, device)
        return {name: weights[name] for name in names}

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


# a dummy tensor is drawn in tiles of at most this many rows and columns, each from a
# generator of its own: a rank draws only the tiles that hold its part, and the draw's
# transient is one tile (not an fp32 copy of BLOOM's 250880 x 14336 table)
TILE = 1024


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
    TILE x TILE tile of a tensor has its own seed derived from (seed, stage, layer,
    name, tile), so any layer, and any rank's part of it, can be made alone, and the
    same tensor is the same on every call on the same device type (a part is the same
    as the whole tensor cut).

    A mixture of experts' router rows are scaled by factors from sqrt(2) down to its
    inverse, spread over the experts in a seeded order: the wider an expert's logits,
    the more tokens choose it, so dummy routing is skewed as trained routers' are and
    placement by usage has something to find (`ROUTER_SKEW`).
    """

    draws_on_device = True
    makes_tensors_alone = True

    def __init__(self, config: ModelConfig, seed: int = 0) -> None:
        self.config = config
        self.seed = seed

    def stored_stage(
        self, stage: str, index: int, dtype: torch.dtype, device: torch.device
    ) -> Weights:
        return self.stored_parts(stage, index, dtype, device, {})

    def stored_named(
        self, stage: str, index: int, names: list[str], dtype: torch.dtype, device: torch.device
    ) -> Weights:
        return self.stored_parts(stage, index, dtype, device, {}, names)

    def stored_parts(
        self,
        stage: str,
        index: int,
        dtype: torch.dtype,
        device: torch.device,
        parts: Parts,
        names: list[str] | None = None,
    ) -> Weights:
        """names: only these tensors (each drawn as in the whole stage)."""
        device = torch.device(device)
        out: Weights = {}
        shapes = self.stored_shapes(stage, index)
        if names is not None:
            shapes = {name: shapes[name] for name in names}
        for name, shape in shapes.items():
            if name.endswith((MXFP4_BLOCKS, MXFP4_SCALES)):  # (whole: experts are not split)
                out[name] = mxfp4.dummy(name, shape, f"{self.seed}/{stage}/{index}/{name}", device)
                continue
            part = parts.get(name, Part(0, ((0, shape[0]),)))
            tensor = torch.empty(part.shape(shape), dtype=dtype, device=device)
            if part.zeros:
                tensor.zero_()
            else:
                self._draw(tensor, name, shape, part, f"{self.seed}/{stage}/{index}/{name}")
            if name == "router.weight":  # (whole: tensor parallelism splits no experts)
                gen = torch.Generator(device=device)
                gen.manual_seed(_seed(f"{self.seed}/{stage}/{index}/{name}/skew"))
                tensor *= _router_skew(shape[0], gen, device).to(dtype)[:, None]
            out[name] = tensor
        return out

    def _draw(
        self, out: torch.Tensor, name: str, shape: tuple[int, ...], part: Part, key: str
    ) -> None:
        """Fill `out` with `part` of the tensor `shape`: each tile it touches drawn once
        a range (a 1-D tensor is one column)."""
        rows, cols = shape[0], shape[1] if len(shape) > 1 else 1
        flat = out.view(out.shape[0], -1)
        gen = torch.Generator(device=out.device)
        at = 0  # where the range lands in out, along the part's dim
        for start, stop in part.ranges:
            row_span = (start, stop) if part.dim == 0 else (0, rows)
            col_span = (start, stop) if part.dim == 1 else (0, cols)
            for r0 in range(row_span[0] // TILE * TILE, row_span[1], TILE):
                for c0 in range(col_span[0] // TILE * TILE, col_span[1], TILE):
                    gen.manual_seed(_seed(f"{key}/{r0 // TILE}/{c0 // TILE}"))
                    tile = torch.randn(
                        min(TILE, rows - r0), min(TILE, cols - c0),
                        generator=gen, device=out.device, dtype=torch.float32,
                    )  # fmt: skip
                    tile = self._scale(name, shape, tile)
                    r_lo, r_hi = max(r0, row_span[0]), min(r0 + TILE, row_span[1])
                    c_lo, c_hi = max(c0, col_span[0]), min(c0 + TILE, col_span[1])
                    dst_r = r_lo - row_span[0] + (at if part.dim == 0 else 0)
                    dst_c = c_lo - col_span[0] + (at if part.dim == 1 else 0)
                    flat[dst_r : dst_r + r_hi - r_lo, dst_c : dst_c + c_hi - c_lo] = tile[
                        r_lo - r0 : r_hi - r0, c_lo - c0 : c_hi - c0
                    ]
            at += stop - start

    @staticmethod
    def _scale(name: str, shape: tuple[int, ...], values: torch.Tensor) -> torch.Tensor:
        if name.endswith(".bias"):
            return values.mul_(0.02)
        if "norm" in name:
            return values.mul_(0.02).add_(1.0)
        if name in ("tok.weight", "pos.weight"):
            return values
        return values.mul_(1.0 / math.sqrt(shape[-1]))


def _seed(key: str) -> int:
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
