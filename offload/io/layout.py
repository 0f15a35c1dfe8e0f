"""The byte layout of weights and KV cache: the one truth that the planner counts and the
executor allocates.

Weights. Each stage (the embedding, every layer, the head) is one byte image of its
stored tensors (`kernels.quant.stored_layout`: quantized matrices as codes, scales and
minima), each tensor 4 KiB aligned, in stage order; the weight store writes the same
extents. A placement cuts an image at two 4 KiB boundaries (`stage_cut`): bytes
[0, gpu_end) live on the GPU, [gpu_end, cpu_end) in pinned CPU memory, [cpu_end, size)
on disk. The weight store holds each image's disk part (`store_tails`), or the whole
image when it is written without a placement.

A mixture of experts' layer image ends with its routed experts, one after another
(`ExpertSpan`): a cut that falls among them is moved to the nearest expert's edge, so
each expert lives whole on one tier, the first experts of the image on the GPU, the
next in pinned memory, the last on disk. The bytes before them (the attention, norms,
router and shared expert: the layer's dense part) are cut as any stage's.

A tied model's one table lives in the head's image (`lm_head.weight`, compressed with
the head under weight compression); the embedding's image has none and reads the
block's rows from the head's home (`shares_table`). BLOOM-176B's table is 7.2 GB in
fp16: stored twice it took the RAM of 12 sequences' int4 KV.

KV cache. A home of `rows` sequences for one layer holds K and V for `max_slots`
tokens: fp16 K then V (each 4 KiB aligned), or one compressed `QuantKV` buffer. A
latent-attention model's cache (`models.mla`) is one latent row a token instead,
`ModelConfig.kv_entry_width` values (576 for DeepSeek-V3), on the GPU only
(`policies.latent`). CPU and
disk homes have the same bytes; `DISK_BUFFERS` staging blocks hold disk homes while they
are read, attended and written back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from offload.core.config import ModelConfig
from offload.io.pinned import align_up
from offload.kernels.kv_cache import kv_buffer_bytes
from offload.kernels.quant import stored_layout
from offload.models.shapes import stage_shapes

if TYPE_CHECKING:
    from offload.kernels.formats import Compression

# disk staging blocks: a block's disk home is read into one, attended from it, updated
# and written back; reads run that many blocks ahead of attention. With two, a plan with
# a disk row in each of 2 micro-batches reads a layer's home into the block its
# previous layer's write-back still holds, so the read waits for that chain (its
# unpack and write-back) every layer; with four it reads a layer ahead. H100, full
# models, 8 x 2, int4 weights, a decode step in same-process pairs, two against four
# (docs/cost_model.md): OPT-30B int4 KV 513 / 425 ms, fp16 KV 1069 / 933;
# Llama-3.1-8B int4 KV 219 / 207, 228 / 182, 178 / 199; fp16 KV 204 / 183, 187 / 157.
# (Two suffice only where a read waits on the host and goes in 1 MiB requests.)
DISK_BUFFERS = 4


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    count = dtype.itemsize
    for dim in shape:
        count *= dim
    return count


# -- weights --------------------------------------------------------------------------
EMBED_TABLE, HEAD_TABLE = "tok.weight", "lm_head.weight"


def stage_keys(cfg: ModelConfig) -> list[str]:
    return ["embed", *(f"layer.{i}" for i in range(cfg.num_layers)), "head"]


@dataclass(frozen=True)
class TensorSlot:
    """One stored tensor's place in its stage image."""

    name: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@functools.lru_cache(maxsize=256)
def stage_layout(
    cfg: ModelConfig, key: str, dtype: torch.dtype, compression: Compression | None
) -> tuple[TensorSlot, ...]:
    """The stored tensors of stage `key` ("embed", "layer.<i>", "head") in image order."""
    slots, offset = [], 0
    stage, _, index = key.partition(".")
    shapes = stage_shapes(cfg, stage, int(index or 0))
    if key == "embed" and shares_table(cfg):
        del shapes[EMBED_TABLE]
    stored = stored_layout(shapes, dtype, compression)
    for name, (shape, t_dtype) in stored.items():
        nbytes = nbytes_of(shape, t_dtype)
        slots.append(TensorSlot(name, offset, nbytes, shape, t_dtype))
        offset += align_up(nbytes)
    return tuple(slots)


def image_bytes(layout: tuple[TensorSlot, ...] | list[TensorSlot]) -> int:
    if not layout:  # a tied Llama's embedding: its one tensor is the head's table
        return 0
    last = layout[-1]
    return align_up(last.offset + last.nbytes)


@functools.lru_cache(maxsize=64)
def stage_image_bytes(
    cfg: ModelConfig, dtype: torch.dtype, compression: Compression | None = None
) -> tuple[int, ...]:
    """Image size of every stage (embedding, layers, head), in stage order."""
    return tuple(image_bytes(stage_layout(cfg, k, dtype, compression)) for k in stage_keys(cfg))


@dataclass(frozen=True)
class ExpertSpan:
    """Where a mixture-of-experts layer's routed experts lie in its image: from
    dense_end on, `count` experts of `expert_bytes` each (4 KiB aligned), in order."""

    dense_end: int
    expert_bytes: int
    count: int

    def offset(self, slot: int) -> int:
        """Where the image's slot-th expert begins."""
        return self.dense_end + slot * self.expert_bytes

    def snap(self, cut: int) -> int:
        """A cut among the experts moved to the nearest expert's edge."""
        if cut <= self.dense_end:
            return cut
        return self.offset(min(self.count, round((cut - self.dense_end) / self.expert_bytes)))

    def slots_below(self, cut: int) -> int:
        """Experts wholly before a (snapped) cut."""
        return max(0, (cut - self.dense_end) // self.expert_bytes)


@functools.lru_cache(maxsize=1024)
def expert_span(
    cfg: ModelConfig, key: str, dtype: torch.dtype, compression: Compression | None
) -> ExpertSpan | None:
    """The experts of stage `key`'s image, or None where it has none."""
    stage, _, index = key.partition(".")
    if stage != "layer" or not cfg.is_moe_layer(int(index)):
        return None
    layout = stage_layout(cfg, key, dtype, compression)
    first = next(t.offset for t in layout if t.name.startswith("experts."))
    return ExpertSpan(first, (image_bytes(layout) - first) // cfg.num_experts, cfg.num_experts)


# a mixture of experts' layer is made at the load this many experts at a time, after its
# dense part (`stage_pieces`): DeepSeek-V3's layer is 23 GB in bf16, Kimi-K2's 34 GB
EXPERTS_A_PIECE = 16


def stage_pieces(cfg: ModelConfig, key: str) -> list[list[str]] | None:
    """The canonical names of stage `key` in the groups the load and the weight store's
    build make them in, where the source makes tensors alone (`executor.weights`,
    `io.store`): a mixture of experts' layer its dense part, then EXPERTS_A_PIECE experts
    at a time. None: any other stage, made whole."""
    stage, _, index = key.partition(".")
    if stage != "layer" or not cfg.is_moe_layer(int(index)):
        return None
    names = list(stage_shapes(cfg, stage, int(index)))
    pieces = [[name for name in names if not name.startswith("experts.")]]
    for first in range(0, cfg.num_experts, EXPERTS_A_PIECE):
        last = min(cfg.num_experts, first + EXPERTS_A_PIECE)
        # every tensor of these experts: their matrices, and biases or MXFP4 blocks and
        # scales where the family has them
        prefixes = tuple(f"experts.{e}." for e in range(first, last))
        pieces.append([name for name in names if name.startswith(prefixes)])
    return pieces


def largest_piece_bytes(cfg: ModelConfig, key: str, dtype: torch.dtype) -> int | None:
    """The bytes of stage `key`'s largest piece (`stage_pieces`) as a source makes it
    (None: the stage is made whole)."""
    pieces = stage_pieces(cfg, key)
    if pieces is None:
        return None
    stage, _, index = key.partition(".")
    shapes = stage_shapes(cfg, stage, int(index or 0))
    return max(sum(nbytes_of(shapes[name], dtype) for name in piece) for piece in pieces)


# GPU buffers that a mixture of experts' experts not on the GPU are copied into, a
# layer's copies running up to this many experts ahead of its compute
# (`executor.experts.ExpertFetcher`)
EXPERT_BUFFERS = 4


@functools.lru_cache(maxsize=4096)
def expert_buffers(
    cfg: ModelConfig, dtype: torch.dtype, compression: Compression | None, placement
) -> tuple[int, int, int]:
    """(GPU buffers, an expert's bytes, a layer's most experts on disk) of a mixture of
    experts under a placement: the expert fetcher's buffers and its disk staging, two
    layers' worth, take buffers x bytes and 2 x disk experts x bytes."""
    buffers = expert_bytes = disk = 0
    cuts = stage_cuts(cfg, dtype, compression, placement)
    for key, (gpu_end, cpu_end) in zip(stage_keys(cfg), cuts, strict=True):
        span = expert_span(cfg, key, dtype, compression)
        if span is None:
            continue
        expert_bytes = max(expert_bytes, span.expert_bytes)
        buffers = max(buffers, min(EXPERT_BUFFERS, span.count - span.slots_below(gpu_end)))
        disk = max(disk, span.count - span.slots_below(cpu_end))
    return buffers, expert_bytes, disk


def stage_cut(size: int, placement, span: ExpertSpan | None = None) -> tuple[int, int]:
    """(gpu_end, cpu_end): the 4 KiB-aligned byte offsets where a stage image is cut by
    a placement (fractions `gpu`, `cpu`, `disk`: a `policies.Placement`); a cut among a
    layer's experts (span) at the nearest expert's edge."""

    def at(fraction: float) -> int:
        cut = min(size, align_up(int(fraction * size)))
        return cut if span is None else span.snap(cut)

    gpu_end = at(placement.gpu)
    if placement.disk == 0:
        return gpu_end, size
    return gpu_end, max(gpu_end, at(placement.gpu + placement.cpu))


def shares_table(cfg: ModelConfig) -> bool:
    """The embedding reads its rows from the head's `lm_head.weight` (tied embeddings)."""
    return cfg.tie_word_embeddings


def whole_in_cpu(cfg: ModelConfig, key: str, placement) -> bool:
    """Stages that live whole in pinned CPU memory unless every weight is on the GPU:
    the gathered embedding, and the head of a tied model (the embedding gathers from its
    table, which must therefore sit in one home)."""
    if placement.gpu >= 1:
        return False
    return key == "embed" or (key == "head" and shares_table(cfg))


def gathered(key: str, placement) -> bool:
    """The embedding is read a few rows a step: unless every weight is on the GPU, its
    stage lives whole in pinned CPU memory, the block's rows are gathered from the table
    there and cross alone, and its small tensors (positions, norms) are copied to the GPU
    once. It never passes through a ring slot (BLOOM's table alone is 7.2 GB)."""
    return key == "embed" and placement.gpu < 1


@functools.lru_cache(maxsize=4096)  # (the search asks for each candidate's, twice)
def stage_cuts(
    cfg: ModelConfig, dtype: torch.dtype, compression: Compression | None, placement
) -> tuple[tuple[int, int], ...]:
    """(gpu_end, cpu_end) of every stage under a placement: the one rule for planner and
    executor."""
    sizes = stage_image_bytes(cfg, dtype, compression)
    return tuple(
        (0, size)
        if whole_in_cpu(cfg, key, placement)
        else stage_cut(size, placement, expert_span(cfg, key, dtype, compression))
        for key, size in zip(stage_keys(cfg), sizes, strict=True)
    )


def gathered_gpu_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """The GPU copies of a gathered embedding stage's tensors besides its table."""
    layout = stage_layout(cfg, "embed", dtype, None)
    return sum(align_up(t.nbytes) for t in layout if t.name != EMBED_TABLE)


def store_tails(
    cfg: ModelConfig, dtype: torch.dtype, compression: Compression | None, placement=None
) -> list[int]:
    """Where each stage's part in the weight store begins: the stage's cpu_end under a
    placement (the store holds the bytes [cpu_end, size) that the executor reads from
    disk), 0 for every stage without one (the whole model)."""
    if placement is None:
        return [0] * len(stage_keys(cfg))
    return [cpu_end for _, cpu_end in stage_cuts(cfg, dtype, compression, placement)]


def store_bytes(
    cfg: ModelConfig, dtype: torch.dtype, compression: Compression | None, placement=None
) -> int:
    """Bytes a weight store takes on disk: the stage tails a placement reads from disk
    (its `weights_disk`), or the whole model without one."""
    sizes = stage_image_bytes(cfg, dtype, compression)
    tails = store_tails(cfg, dtype, compression, placement)
    return sum(size - tail for size, tail in zip(sizes, tails, strict=True))


# -- KV cache -------------------------------------------------------------------------
@dataclass(frozen=True)
class KVLayout:
    """Bytes of KV homes for one layer at `max_slots` tokens a sequence."""

    cfg: ModelConfig
    dtype: torch.dtype
    max_slots: int
    compression: Compression | None = None

    def scratch_depth(self, micro_batches: int, attention_on_cpu: bool) -> int:
        """How many GPU scratches of the off-GPU rows there are (a ring the blocks take
        in attention order). A compressed cache attended on the GPU has one a micro-
        batch: a layer's loads are all issued before the next layer's weight copy, on
        the same stream (`KVManager.load_layer`). Otherwise two: one in use, one loading
        (an uncompressed scratch is 4x the bytes)."""
        if self.compression is not None and not attention_on_cpu:
            return max(2, micro_batches)
        return 2

    @property
    def seq_bytes(self) -> int:
        """One sequence's uncompressed cache for one layer: K and V, or its latent rows."""
        return self.max_slots * self.cfg.kv_entry_width * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        """One sequence's fp16 K (or V) for one layer."""
        cfg = self.cfg
        elt = self.dtype.itemsize
        return cfg.num_kv_heads * self.max_slots * cfg.head_dim * elt

    def quant_bytes(self, rows: int) -> int:
        """One compressed `QuantKV` buffer of `rows` sequences (K and V)."""
        cfg = self.cfg
        assert self.compression is not None
        return kv_buffer_bytes(
            rows, cfg.num_kv_heads, cfg.head_dim, self.max_slots, self.dtype, self.compression
        )

    def home_bytes(self, rows: int) -> int:
        """The CPU (pinned) or disk home of `rows` sequences: K then V, or one QuantKV."""
        if not rows:
            return 0
        if self.cfg.kv_lora_rank:  # one latent home
            return align_up(rows * self.seq_bytes)
        if self.compression is None:
            return 2 * align_up(rows * self.row_bytes)
        return align_up(self.quant_bytes(rows))

    def gpu_bytes(self, rows: int) -> int:
        """A GPU-resident cache of `rows` sequences."""
        if not rows:
            return 0
        if self.compression is None:
            return rows * self.seq_bytes
        return self.quant_bytes(rows)

    def store_staging_bytes(self, rows: int) -> int:
        """One store of `rows` off-GPU sequences' new entries: a prefill's new K and V,
        or (compressed) at most the whole compressed cache."""
        if self.compression is None:
            return rows * self.seq_bytes
        return self.quant_bytes(rows)

    def scratch_gpu_bytes(self, rows: int, attention_on_cpu: bool, micro_batches: int) -> int:
        """The GPU scratches where off-GPU rows are attended (fp16: loaded; compressed:
        also quantized into), `scratch_depth` of them."""
        if not rows:
            return 0
        depth = self.scratch_depth(micro_batches, attention_on_cpu)
        if self.compression is not None:
            return depth * self.quant_bytes(rows)
        return 0 if attention_on_cpu else depth * rows * self.seq_bytes
