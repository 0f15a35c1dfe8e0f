"""Megatron-style sharding of every stage's weights for one tensor-parallel rank.

Rank r of N holds:

    embed  tok.weight           rows of its vocabulary slice (vocab-parallel lookup)
    layer  qkv.weight(/.bias)   its query heads' rows and its KV heads' rows   (column)
           o.weight             its heads' columns; o.bias on rank 0 only     (row)
           mlp_in.weight(/.bias) its slice of I (of gate and of up if gated)  (column)
           mlp_out.weight       its slice of I's columns; bias on rank 0 only (row)
    head   lm_head.weight       rows of its vocabulary slice (logits gathered)

Norms, OPT's position table and projections are replicated. The canonical qkv layout is
[q heads | k heads | v heads] for every family (`checkpoint.py` reorders BLOOM's
per-head interleaving at load), so one slicing rule serves Llama, BLOOM and OPT. With
fewer KV heads than ranks each rank holds the one KV head its query heads read
(replicated across the ranks that share it). A row-parallel bias is zero on the other
ranks, so the all-reduce adds it once.

A rank's source makes only its parts (`RankShard.parts`, `WeightSource.stored_parts`:
a checkpoint reads its slices, dummy weights draw the tiles that hold them, on the
rank's GPU), in full precision, so compression (`WeightHomes`, the store) quantizes
each rank's own matrices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from offload.core.config import ModelConfig
from offload.core.errors import UserError
from offload.models.shapes import Part, Parts, Weights, stage_shapes
from offload.models.weights import WeightSource

# MLP columns move between ranks in units of this many (when I allows), so a rank's
# row-parallel matrix keeps whole quantization groups of the usual sizes.
MLP_UNIT = 64


def split_sizes(total: int, parts: int, unit: int = 1) -> list[int]:
    """Sizes of `parts` contiguous pieces of `total`, in whole units where possible;
    the first pieces take one unit more when they do not divide evenly."""
    if total % unit or total < unit * parts:
        unit = 1
    units, extra = divmod(total // unit, parts)
    return [(units + (1 if i < extra else 0)) * unit for i in range(parts)]


def _bounds(sizes: list[int], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


@dataclass(frozen=True)
class RankShard:
    """What rank `rank` of `tp` holds: slices of query heads, KV heads, MLP width and
    vocabulary of the full model `cfg`."""

    cfg: ModelConfig
    tp: int
    rank: int
    heads: slice
    kv_heads: slice
    mlp: slice
    vocab: slice
    vocab_sizes: tuple[int, ...]

    @classmethod
    def of(cls, cfg: ModelConfig, tp: int, rank: int) -> RankShard:
        check_divisible(cfg, tp)
        assert 0 <= rank < tp, (rank, tp)
        per_rank = cfg.num_heads // tp
        heads = slice(rank * per_rank, (rank + 1) * per_rank)
        group = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head
        kv_heads = slice(heads.start // group, -(-heads.stop // group))
        vocab_sizes = split_sizes(cfg.vocab_size, tp)
        return cls(
            cfg,
            tp,
            rank,
            heads,
            kv_heads,
            _bounds(split_sizes(cfg.intermediate_size, tp, MLP_UNIT), rank),
            _bounds(vocab_sizes, rank),
            tuple(vocab_sizes),
        )

    @property
    def config(self) -> ModelConfig:
        """The rank's `ModelConfig`: its head counts, MLP width and vocabulary."""
        cfg = self.cfg
        return dataclasses.replace(
            cfg,
            name=f"{cfg.name}@tp{self.tp}.{self.rank}",
            num_heads=self.heads.stop - self.heads.start,
            num_kv_heads=self.kv_heads.stop - self.kv_heads.start,
            intermediate_size=self.mlp.stop - self.mlp.start,
            vocab_size=self.vocab.stop - self.vocab.start,
            gathered_vocab_size=cfg.vocab_size,
        )

    # -- slicing one stage ----------------------------------------------------------------
    def parts(self, stage: str) -> Parts:
        """The rank's part of each canonical tensor of a stage that it does not hold whole
        (a source makes only those parts: `WeightSource.stored_parts`)."""
        cfg, dim = self.cfg, self.cfg.head_dim
        out: Parts = {}
        for name in stage_shapes(cfg, stage):
            if name in ("tok.weight", "lm_head.weight"):
                out[name] = _rows(self.vocab)
            elif stage != "layer":
                continue
            elif name.startswith("qkv."):
                q_rows, k_rows = cfg.num_heads * dim, cfg.num_kv_heads * dim
                kv = (self.kv_heads.start * dim, self.kv_heads.stop * dim)
                out[name] = Part(0, (
                    (self.heads.start * dim, self.heads.stop * dim),
                    (q_rows + kv[0], q_rows + kv[1]),
                    (q_rows + k_rows + kv[0], q_rows + k_rows + kv[1]),
                ))  # fmt: skip
            elif name == "o.weight":
                out[name] = Part(1, ((self.heads.start * dim, self.heads.stop * dim),))
            elif name in ("mlp_in.weight", "mlp_in.bias"):
                inter, mlp = cfg.intermediate_size, (self.mlp.start, self.mlp.stop)
                gated = ((inter + mlp[0], inter + mlp[1]),) if cfg.gated_mlp else ()  # [gate | up]
                out[name] = Part(0, (mlp, *gated))
            elif name == "mlp_out.weight":
                out[name] = Part(1, ((self.mlp.start, self.mlp.stop),))
            elif name in ("o.bias", "mlp_out.bias") and self.rank != 0:
                out[name] = Part(zeros=True)
        return out

    def stage(self, stage: str, weights: Weights) -> Weights:
        """The rank's part of a full stage's canonical tensors (fresh memory for every
        part; norms and the other replicated tensors as they are)."""
        parts = self.parts(stage)
        return {name: parts[name].take(t) if name in parts else t for name, t in weights.items()}


def _rows(span: slice) -> Part:
    return Part(0, ((span.start, span.stop),))


def check_divisible(cfg: ModelConfig, tp: int) -> None:
    """Refuse, in one line, head counts that `tp` ranks cannot share."""
    if tp < 1:
        raise UserError(f"--tp must be >= 1, got {tp}")
    if tp > 1 and cfg.num_experts:
        raise UserError(
            f"tensor parallelism does not split {cfg.name}'s experts; run it with --tp 1"
        )
    if cfg.num_heads % tp:
        raise UserError(
            f"--tp {tp} does not divide {cfg.name}'s {cfg.num_heads} attention heads; "
            f"use a --tp that divides {cfg.num_heads}"
        )
    kv = cfg.num_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        raise UserError(
            f"--tp {tp} and {cfg.name}'s {kv} KV heads do not share evenly (one must divide "
            f"the other); use a --tp that divides {kv} or is a multiple of it"
        )


def rank_config(cfg: ModelConfig, tp: int, rank: int) -> ModelConfig:
    """The `ModelConfig` rank `rank` of `tp` computes with: num_heads / tp query heads,
    its KV heads (at least one), its share of the MLP width and of the vocabulary. The
    planner's per-rank bytes (weights, KV, activations) follow from it as for one GPU."""
    return RankShard.of(cfg, tp, rank).config


class ShardSource(WeightSource):
    """A `WeightSource` handing out one rank's shard of every stage of `inner`."""

    def __init__(self, inner: WeightSource, shard: RankShard) -> None:
        assert inner.config == shard.cfg, "the shard is of another model"
        self.inner, self.shard = inner, shard
        self.config = shard.config

    @property
    def draws_on_device(self) -> bool:
        return self.inner.draws_on_device

    def stored_stage(
        self, stage: str, index: int, dtype: torch.dtype, device: torch.device
    ) -> Weights:
        """Only the rank's parts are made (read, drawn) by the inner source."""
        return self.inner.stored_parts(stage, index, dtype, device, self.shard.parts(stage))

    def close(self) -> None:
        self.inner.close()
