"""Bytes each tier needs for a policy: the executor's own allocations, counted ahead.

The numbers come from the same layout and cut functions the executor allocates with,
so a run's ledger matches the plan; `transient` estimates the per-micro-batch working
tensors (attention bias, MLP intermediate, logits) that the CUDA allocator holds at peak.

A run has two phases. While the weights load (the executor's constructor) only their
homes and pinned pool exist, beside one stage's load transients (`load_` parts); then
the KV homes, activations and the rest join and the transients are gone. A tier's peak
is the larger of the two phases.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from offload.core.config import ModelConfig
from offload.io.layout import (
    DISK_BUFFERS,
    KVLayout,
    expert_buffers,
    expert_span,
    gathered,
    gathered_gpu_bytes,
    largest_piece_bytes,
    stage_cuts,
    stage_image_bytes,
    stage_keys,
)
from offload.io.pinned import align_up
from offload.kernels import qmatmul, quant
from offload.models import attention, decoder, mla, moe
from offload.policies.policy import Policy

# the parts that exist while the weights load: their homes and the pinned pool
LOAD_PARTS = ("weights", "weight_staging")


@dataclass(frozen=True)
class MemoryPlan:
    gpu_bytes: int
    cpu_bytes: int  # pinned pools: weights, staging, KV, activations
    disk_bytes: int
    detail: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_detail(cls, detail: dict[str, int]) -> MemoryPlan:
        """Tier totals of named parts, each named `<what>_<tier>`: the peak of the load
        phase (the weights' parts and the `load_` transients) or of the run (every part
        but the transients), whichever is larger."""
        phases = _phase_totals(detail)

        def total(tier: str) -> int:
            return max(phases.get((tier, True), 0), phases.get((tier, False), 0))

        plan = cls(total("gpu"), total("cpu"), total("disk"), detail)
        plan.__dict__["_phases"] = phases  # `_phases`, already counted (the search's hot path)
        return plan

    @functools.cached_property
    def _phases(self) -> dict[tuple[str, bool], int]:
        return _phase_totals(self.detail)

    def run_bytes(self, tier: str) -> int:
        """A tier's peak once the weights are placed (the load's transients gone)."""
        return self._phases.get((tier, False), 0)

    def load_bytes(self, tier: str) -> int:
        """A tier's peak while the weights load (their homes and the load's transients)."""
        return self._phases.get((tier, True), 0)


def _phase_totals(detail: dict[str, int]) -> dict[tuple[str, bool], int]:
    """Bytes of each (tier, load phase?) over the named parts, in one pass (the search
    totals every candidate's plan)."""
    totals: dict[tuple[str, bool], int] = {}
    for key, nbytes in detail.items():
        for phase in _phases_of(key):
            totals[phase] = totals.get(phase, 0) + nbytes
    return totals


@functools.cache
def _phases_of(key: str) -> tuple[tuple[str, bool], ...]:
    """The (tier, load phase?) totals a part named `<what>_<tier>` counts in: the load
    phase for the weights' parts and the `load_` transients, the run for every part but
    the transients."""
    part, _, tier = key.rpartition("_")
    transient = part.startswith("load_")
    load = ((tier, True),) if transient or part in LOAD_PARTS else ()
    return load + (() if transient else ((tier, False),))


def row_splits(placement, sizes: list[int]) -> list[tuple[int, int, int]]:
    """Per micro-batch (gpu, cpu, disk) rows whose totals match the placement exactly."""
    total = sum(sizes)
    total_gpu, total_cpu, _ = placement.split(total)
    out, done_rows, done_gpu, done_cpu = [], 0, 0, 0
    for size in sizes:
        done_rows += size
        gpu = min(size, round(total_gpu * done_rows / total) - done_gpu)
        cpu = min(size - gpu, round(total_cpu * done_rows / total) - done_cpu)
        out.append((gpu, cpu, size - gpu - cpu))
        done_gpu += gpu
        done_cpu += cpu
    return out


def micro_batch_sizes(policy: Policy, batch: int) -> list[int]:
    size = policy.gpu_batch_size
    return [min(size, batch - s) for s in range(0, batch, size)]


def weight_plan(cfg: ModelConfig, policy: Policy, dtype: torch.dtype) -> dict[str, int]:
    return dict(_weight_plan(cfg, policy.weights, dtype, policy.weight_compression))


@functools.lru_cache(maxsize=4096)
def _weight_plan(
    cfg: ModelConfig, placement, dtype: torch.dtype, compression
) -> tuple[tuple[str, int], ...]:
    gpu = cpu = disk = slot = staging = 0
    sizes = stage_image_bytes(cfg, dtype, compression)
    cuts = stage_cuts(cfg, dtype, compression, placement)
    # a mixture of experts' layer streams its dense part through the ring slots and its
    # experts one by one (`executor.experts`)
    fetched = [
        size if span is None else span.dense_end
        for size, span in zip(sizes, _spans(cfg, dtype, compression), strict=True)
    ]
    buffers, expert_bytes, disk_experts = expert_buffers(cfg, dtype, compression, placement)
    full_sizes = stage_image_bytes(cfg, dtype)
    pieces = tuple(
        largest_piece_bytes(cfg, key, dtype) or full
        for key, full in zip(stage_keys(cfg), full_sizes, strict=True)
    )
    load_cpu, load_gpu = _load_transients(sizes, full_sizes, pieces)
    if gathered("embed", placement):  # the table stays in CPU memory, its rows cross
        gpu += gathered_gpu_bytes(cfg, dtype)
        cpu += sizes[0]
        sizes, cuts, fetched = sizes[1:], cuts[1:], fetched[1:]
    for size, (gpu_end, cpu_end), end in zip(sizes, cuts, fetched, strict=True):
        gpu += gpu_end
        if cpu_end > gpu_end:
            cpu += cpu_end - gpu_end
        disk += size - cpu_end
        if gpu_end < end:
            slot = max(slot, end)
        staging = max(staging, end - cpu_end)
    return (
        ("weights_gpu", gpu),
        ("weights_cpu", cpu),
        ("weights_disk", disk),
        ("weight_slots_gpu", 2 * slot),
        ("weight_staging_cpu", 2 * staging + 2 * disk_experts * expert_bytes),
        ("expert_buffers_gpu", buffers * expert_bytes),
        ("load_stage_cpu", load_cpu),
        ("load_stage_gpu", load_gpu),
        # the fetcher's two ring slots are allocated as the load ends, after the stage
        # being placed is freed: the load phase holds the larger of the two (Llama-3.1-8B
        # streamed, H200: 6.70 GB at the load's end against 5.73 planned without)
        ("load_slots_gpu", max(0, 2 * slot + buffers * expert_bytes - load_gpu)),
    )


def _spans(cfg: ModelConfig, dtype: torch.dtype, compression) -> list:
    return [expert_span(cfg, key, dtype, compression) for key in stage_keys(cfg)]


def _load_transients(
    sizes: tuple[int, ...], full_sizes: tuple[int, ...], pieces: tuple[int, ...]
) -> tuple[int, int]:
    """(CPU, GPU) bytes one stage holds at once while it is placed
    (`executor.weights.WeightHomes`), the largest stage's: its pageable host image, and
    the stage as the source gives it with its compressed copy and the quantizer's working
    set, on the CPU (a checkpoint) or on the GPU (dummy weights are drawn there). Both
    are counted whichever the source is: the plan does not know it, and neither phase's
    peak is usually set by this. A mixture of experts' layer is made in pieces
    (`layout.stage_pieces`: DeepSeek-V3's whole layer is 23 GB), the largest of `pieces`
    bytes at once, by the sources that make tensors alone (dummy weights, checkpoints;
    the weight store's build too); a whole weight store read back as the model
    (`io.store_source`) makes its stages whole."""
    # a stage stored as its source gives it (the embedding table: `size == full`) is
    # not quantized, so it holds no compressed copy and no quantizer beside it (Llama-3.1-8B
    # int4, H100: the load phase planned 9.17 GB, counting the 1.05 GB table twice
    # and the quantizer, against 7.94-8.05 GB measured)
    held = [
        (size, piece + (piece * size // full + quant.QUANT_WORK_BYTES if size < full else 0))
        for size, full, piece in zip(sizes, full_sizes, pieces, strict=True)
    ]
    cpu = max((size + source for size, source in held), default=0)
    gpu = max((source for _, source in held), default=0)
    return cpu, gpu


def kv_plan(
    cfg: ModelConfig, policy: Policy, dtype: torch.dtype, batch: int, max_slots: int
) -> dict[str, int]:
    """The KV homes, scratches and staging the executor's `KVHomes.start` allocates."""
    kv = KVLayout(cfg, dtype, max_slots, policy.kv_compression)
    splits = row_splits(policy.kv_cache, micro_batch_sizes(policy, batch))
    layers = cfg.num_layers
    off_rows = max((c + d for _, c, d in splits), default=0)
    disk_homes = [kv.home_bytes(d) for _, _, d in splits]
    return {
        "kv_gpu": sum(kv.gpu_bytes(g) for g, _, _ in splits) * layers,
        "kv_cpu": sum(kv.home_bytes(c) for _, c, _ in splits) * layers,
        "kv_disk": sum(disk_homes) * layers,
        "kv_scratch_gpu": kv.scratch_gpu_bytes(off_rows, policy.attention_on_cpu, len(splits)),
        # disk homes being read, updated and written back, and new entries on their way
        # to off-GPU homes (two deep)
        "kv_staging_cpu": DISK_BUFFERS * max(disk_homes, default=0)
        + (2 * align_up(kv.store_staging_bytes(off_rows)) if off_rows else 0),
    }


def activation_plan(
    cfg: ModelConfig,
    policy: Policy,
    dtype: torch.dtype,
    batch: int,
    prompt_len: int,
    max_slots: int,
) -> dict[str, int]:
    elt = dtype.itemsize
    row_bytes = prompt_len * cfg.hidden_size * elt
    sizes = micro_batch_sizes(policy, batch)
    gpu_rows = cpu_bytes = widest = 0
    for size in sizes:
        g, c, _ = policy.activations.split(size)
        gpu_rows, widest = gpu_rows + g, max(widest, g)
        cpu_bytes += align_up(c * row_bytes) if c else 0
    mb = max(sizes)
    # a step holds its transients in one stage at a time: a prefill layer's working set
    # (the larger phase: decode's is one token a sequence), or at the head every micro-
    # batch's last-position logits (fp32), their cat, and the logits of the micro-batch
    # at hand in the compute dtype before their conversion. Summed, the two counted 2.1
    # GB never held at once on Llama-3.1-70B at 2048 sequences (validate_cost_model:
    # peak 18.5 GB against 24.0 planned; docs/cost_model.md). The caller drops a step's logits once
    # sampled (`decode_loop`), so none are held through the next step's layers. A
    # tensor-parallel rank then gathers its slice to the whole vocabulary: every rank's
    # slice and their cat, beside its own.
    compressed = policy.weight_compression is not None
    layer = _layer_transient(cfg, mb * prompt_len, compressed=compressed, seq_len=prompt_len)
    layer *= elt
    if cfg.num_experts:  # a mixture of experts' layer holds the whole block's rows
        moe_layer = _moe_transient(cfg, batch * prompt_len, mb * prompt_len, prompt_len)
        layer = max(layer, moe_layer * elt)
    if compressed and mb * prompt_len >= qmatmul.DENSE_ROWS:
        layer += decoder.dense_scratch_bytes(cfg, elt)  # prefill's dequantized W
    head = batch * cfg.vocab_size * 4 * 2 + mb * cfg.vocab_size * elt
    if cfg.gathered_vocab_size:
        head = max(head, batch * (2 * cfg.gathered_vocab_size + cfg.vocab_size) * 4)
    # the step's attention bias [B, 1|heads, T, S] and RoPE's cos and sin [B, T, D],
    # built once for the whole block (`batch.PaddedBatch.step_inputs`); twice where the
    # windowed layers have their own (`StepInputs.local`)
    heads = cfg.num_heads if cfg.record.positions == "alibi" else 1  # a bias a head
    step = batch * heads * prompt_len * max_slots * elt
    if cfg.rotary:
        step += 2 * batch * prompt_len * cfg.rotary_dim * elt
    transient = max(layer, head) + step * (2 if cfg.window_layers else 1)
    return {
        # every micro-batch's hidden states, and the output of the one in its layer
        # (the executor replaces each micro-batch's input with its output)
        "act_gpu": (gpu_rows + widest) * row_bytes,
        "act_cpu": cpu_bytes,
        "transient_gpu": transient,
        "decode_graphs_gpu": _graph_bytes(cfg, policy, sizes) * elt,
    }


def _graph_bytes(cfg: ModelConfig, policy: Policy, sizes: list[int]) -> int:
    """Elements (fp32 logits counted as two) the decode graphs keep, one set per
    micro-batch (`executor.graphs`): each layer's qkv (and RoPE's new q and k: twice the
    qkv at most) and residual, the logits, and one layer's decode temporaries in their
    memory pool. They stay allocated between batches."""
    if not policy.decode_graphs or cfg.num_experts:  # (MoE: no graphs, `Executor`)
        return 0
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    per_row = cfg.num_layers * (2 * qkv + cfg.hidden_size) + 2 * cfg.vocab_size
    return sum(
        rows * per_row + _layer_transient(cfg, rows, prefill=False, compressed=False)
        for rows in sizes
    )


def _layer_transient(
    cfg: ModelConfig,
    tokens: int,
    prefill: bool = True,
    compressed: bool = False,
    seq_len: int = 1,
) -> int:
    """Elements a layer holds at its peak over `tokens` new rows, besides its input and
    output (counted as activations); counted from `decoder`'s own code:
    attention half: norm output + the fused qkv + RoPE's (q roped, and beside it the
    rotated k and its result: 3 x hidden at most; `ops.apply_rope`)
    or SDPA's output and its reshape, and in prefill with grouped-query heads K and V
    expanded to every query head (`decoder.attend`), and with attention sinks their
    bounded scores (`attention.attend_sinks`); MLP half (the executor drops the
    attention's output after the projection): the projection at full size, and beside
    it the output where the rows go in slices (`decoder.mlp_chunks`; compressed: the
    layer's weights are), plus one slice's norm, activation and output. The activation
    holds the intermediate once where ReLU runs in the matmul's epilogue, twice for
    GELU (its input and output), three times gated (the gate and up projection, then
    the SiLU beside them). Latent attention's attention half is its own
    (`mla.attention_elements`, its sequences' `seq_len` tokens attending as many)."""
    hidden, qkv = cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    attn_half = tokens * (qkv + (4 if cfg.rotary else 3) * hidden)
    if prefill and cfg.num_kv_heads != cfg.num_heads:
        attn_half += 2 * tokens * cfg.num_heads * cfg.head_dim
    if cfg.kv_lora_rank:
        new = seq_len if prefill else 1
        attn_half = mla.attention_elements(cfg, max(1, tokens // new), new, seq_len)
    if cfg.attn_softcap is not None:  # a chunk of soft-capped scores (`softcap_attend`)
        attn_half += attention.SOFTCAP_TRANSIENT
    if prefill and cfg.attention_sinks:  # `attention.attend_sinks`' scores (2-byte elements)
        attn_half += attention.SINK_SCORE_TENSORS * attention.SINK_SCORE_BYTES // 2
    if cfg.gated_mlp:
        act = 3 * cfg.intermediate_size
    else:
        act = (1 if cfg.activation == "relu" else 2) * cfg.intermediate_size
    chunks = decoder.mlp_chunks(tokens, compressed)
    mlp_half = (1 if len(chunks) == 1 else 2) * tokens * hidden
    mlp_half += max(chunks) * (2 * hidden + act)
    return max(attn_half, mlp_half)


def _moe_transient(cfg: ModelConfig, tokens: int, micro_tokens: int, seq_len: int = 1) -> int:
    """Elements a mixture-of-experts layer holds at its peak over a block of `tokens`
    rows in micro-batches of `micro_tokens` (`executor.moe_layer`): the block's normed
    rows, its output and its residuals throughout; beside them one micro-batch's
    attention (`_layer_transient`), or the routing (float32 logits and probabilities,
    ids and weights: at most 4 elements an expert and 6 a choice of a row), or one
    expert's slice of rows (`moe.apply_expert`: its input, gate and up, activation,
    output, weighted output and the gathered rows they are added to), or a micro-batch's
    shared expert and output."""
    hidden, k = cfg.hidden_size, cfg.experts_per_token
    held = 3 * tokens * hidden
    rows = min(tokens, moe.EXPERT_CHUNK_ROWS)
    expert = rows * (4 * hidden + 3 * cfg.moe_intermediate_size)
    routing = tokens * (4 * cfg.num_experts + 6 * k)
    shared = micro_tokens * (3 * hidden + 3 * cfg.shared_expert_intermediate_size)
    attention = _layer_transient(cfg, micro_tokens, seq_len=seq_len)
    return held + max(attention, expert, routing, shared)


def plan_memory(
    cfg: ModelConfig, policy: Policy, dtype: torch.dtype, prompt_len: int, max_new_tokens: int
) -> MemoryPlan:
    """Peak bytes per tier for one block at this prompt and generation length."""
    batch = policy.block_size
    max_slots = prompt_len + max_new_tokens
    detail = {
        **weight_plan(cfg, policy, dtype),
        **kv_plan(cfg, policy, dtype, batch, max_slots),
        **activation_plan(cfg, policy, dtype, batch, prompt_len, max_slots),
    }
    return MemoryPlan.from_detail(detail)
