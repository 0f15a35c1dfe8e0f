"""The cost model's expert terms: a mixture of experts' layers, experts by module.

A mixture-of-experts layer holds E experts of `expert_bytes` each, k chosen a token;
its image's cut puts `gpu`, `cpu` and `disk` of them on each tier (`io.layout`). In a
step of T tokens (decode: the block's sequences; prefill: their prompt tokens):

- touched: an expert is chosen by at least one of the T tokens with probability
  1 - (1 - p)^T, p = k / E under uniform routing. With the measured usage (`usage`:
  each expert's share of the tokens, most used first), the GPU holds the most used
  (placement by routing, `executor.experts`) and pinned memory and disk the rest alike.
- h2d: every touched expert not on the GPU crosses whole, once: (cpu + disk) touched x
  bytes. disk: the touched disk experts' bytes.
- compute: each touched expert's two matmuls at the rate of its rows (T k / touched
  rows each) plus the executor's host time an expert (`expert_fixed_s`), or the FLOPs
  2 T k x an expert's parameters at the matmul rate, whichever is longer; plus the
  executor's own passes over each of the T k routed rows at the HBM rate
  (`ROUTED_ROW_PASSES`: a prefill's are millions of rows).
- cpu: at decode a share of the touched experts in pinned memory (`Policy.cpu_experts`)
  is computed on the CPU instead of crossing: each at the profile's CPU expert rate
  (`cpu_expert_gbps`) plus its fixed time; the copies beside it run at the rate
  measured beside a DRAM-bound CPU lane (`h2d_under_cpu_attention_gbps`). The share
  that gives the shortest phase is the plan's (`cpu_share`).
- the phase: copies, reads and compute overlap in the fetcher's ring of buffers, so
  it takes its busiest lane plus the first expert's copy (nothing computes before it).

The experts wait for the routing of every micro-batch, so a layer takes its dense
part's time (the attention and what else streams as a stage: `cost`) plus this phase.
The dense schedule (model-based batching, `dense`) fetches every expert not on the GPU
for each micro-batch, and a micro-batch's tokens are T.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from offload.core.config import ModelConfig
from offload.io.layout import expert_span, stage_cuts, stage_image_bytes, stage_keys
from offload.kernels.formats import Compression
from offload.kernels.qmatmul import DENSE_ROWS
from offload.models.moe import EXPERT_CHUNK_ROWS
from offload.policies import paths
from offload.policies.hardware import GB, HardwareProfile, format_name


@dataclass(frozen=True)
class ExpertLayers:
    """A model's mixture-of-experts layers under a placement: how many, their experts'
    size and tiers (averaged over the layers)."""

    layers: int
    count: int  # experts a layer
    k: int  # chosen a token
    expert_bytes: float  # as stored
    params: int  # one expert's
    gpu: float  # experts a layer on each tier
    cpu: float
    disk: float
    row_bytes: float = 0.0  # HBM bytes the executor moves a routed row beside its matmuls


# `moe.apply_expert`'s passes over a routed row, in units of its hidden-wide row in the
# compute dtype, beside the matmuls: the gather of its input (read, write: 2), its
# weighted output (Mixtral's in float32: 1 + 2) cast back (2 + 1), the gather of the
# block's output rows (2), the add (3) and the scatter back (2)
ROUTED_ROW_PASSES = 15


@functools.lru_cache(maxsize=4096)
def expert_layers(
    cfg: ModelConfig, dtype: torch.dtype, compression: Compression | None, placement
) -> ExpertLayers | None:
    """The model's expert layers under a weight placement; None for a dense model."""
    tiers = []
    nbytes = 0
    cuts = stage_cuts(cfg, dtype, compression, placement)
    for key, (gpu_end, cpu_end) in zip(stage_keys(cfg), cuts, strict=True):
        span = expert_span(cfg, key, dtype, compression)
        if span is not None:
            gpu, below_cpu = span.slots_below(gpu_end), span.slots_below(cpu_end)
            tiers.append((gpu, below_cpu - gpu, span.count - below_cpu))
            nbytes = span.expert_bytes
    if not tiers:
        return None
    n = len(tiers)
    params = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    gpu, cpu, disk = (sum(t[i] for t in tiers) / n for i in range(3))
    row_bytes = ROUTED_ROW_PASSES * cfg.hidden_size * dtype.itemsize
    return ExpertLayers(
        n, cfg.num_experts, cfg.experts_per_token, nbytes, params, gpu, cpu, disk, row_bytes
    )


def streamed_bytes(
    cfg: ModelConfig, dtype: torch.dtype, compression: Compression | None
) -> list[int]:
    """Every stage's bytes that stream as a stage: its image, or of a mixture of
    experts' layer its dense part (its experts are fetched one by one)."""
    sizes = stage_image_bytes(cfg, dtype, compression)
    spans = (expert_span(cfg, key, dtype, compression) for key in stage_keys(cfg))
    return [
        size if span is None else span.dense_end for size, span in zip(sizes, spans, strict=True)
    ]


@functools.cache
def fetched_params(cfg: ModelConfig) -> tuple[float, float]:
    """(parameters, of which the MLP's) of the average layer's part that streams as a
    stage: all of a dense layer; a mixture of experts' without its routed experts (its
    attention, router and shared expert)."""
    total = mlp = 0
    hidden = cfg.hidden_size
    for layer in range(cfg.num_layers):
        if cfg.is_moe_layer(layer):
            shared = 3 * hidden * cfg.shared_expert_intermediate_size
            total += (
                cfg.layer_param_count(layer)
                - cfg.num_experts * 3 * hidden * cfg.moe_intermediate_size
            )
            mlp += shared
        else:
            total += cfg.layer_param_count(layer)
            mlp += hidden * cfg.intermediate_size * (3 if cfg.gated_mlp else 2)
    return total / cfg.num_layers, mlp / cfg.num_layers


def touched(x: ExpertLayers, tokens: float, usage: tuple[float, ...] | None = None):
    """Expected experts a layer chosen by at least one of `tokens` tokens, on each tier
    (gpu, cpu, disk): under uniform routing, or the measured `usage` (module doc)."""
    if usage is None:
        share = 1 - (1 - x.k / x.count) ** tokens
        return x.gpu * share, x.cpu * share, x.disk * share
    chosen = [1 - (1 - min(1.0, p)) ** tokens for p in usage]
    gpu = round(x.gpu)
    rest = chosen[gpu:]
    off = sum(rest) / max(1, len(rest))
    return sum(chosen[:gpu]), x.cpu * off, x.disk * off


@dataclass(frozen=True)
class ExpertPhase:
    """One layer's expert phase in one step: its lanes (seconds) and the experts moved."""

    h2d: float
    disk: float
    compute: float
    cpu: float
    seconds: float
    moved: float  # experts that crossed PCIe
    touched: float  # experts chosen
    on_cpu: float  # experts computed on the CPU


def expert_phase(
    x: ExpertLayers,
    hw: HardwareProfile,
    compression: Compression | None,
    tokens: float,
    prefill: bool = False,
    micro: int = 1,
    dense: bool = False,
    usage: tuple[float, ...] | None = None,
    cpu_share: float = 0.0,
) -> ExpertPhase:
    """A layer's experts over a step of `tokens` tokens in `micro` micro-batches, with
    `cpu_share` of its touched experts in pinned memory computed on the CPU."""
    passes = micro if dense else 1
    per_pass = tokens / passes
    gpu, cpu, disk = touched(x, per_pass, usage)
    on_cpu = 0.0 if dense or prefill else cpu_share * cpu
    fetched = (x.cpu, x.disk) if dense else (cpu - on_cpu, disk)  # dense: all of them
    moved = passes * sum(fetched)
    h2d_rate = hw.h2d_gbps
    if on_cpu:
        h2d_rate = hw.h2d_under_cpu_attention_gbps or h2d_rate
    h2d = moved * x.expert_bytes / (h2d_rate * GB)
    disk_s = passes * fetched[1] * x.expert_bytes / (hw.disk_read_gbps * GB)
    cpu_s = on_cpu * _cpu_expert_s(x, hw, compression) if on_cpu else 0.0
    calls = passes * (gpu + cpu + disk) - on_cpu
    rows = max(1.0, per_pass * x.k / max(gpu + cpu + disk, 1e-9))
    compute = calls * hw.expert_fixed_s + _matmuls_s(x, hw, compression, rows, calls, prefill)
    flops = 2 * tokens * x.k * x.params
    rate = hw.prefill_rate(compression) if prefill else hw.decode_tflops
    compute = max(compute, flops / (rate * 1e12))
    compute += tokens * x.k * x.row_bytes / (hw.hbm_gbps * GB) if hw.hbm_gbps else 0.0
    first = x.expert_bytes / (hw.h2d_gbps * GB) if moved else 0.0
    seconds = max(h2d, disk_s, compute, cpu_s) + first
    return ExpertPhase(h2d, disk_s, compute, cpu_s, seconds, moved, calls + on_cpu, on_cpu)


def _cpu_expert_s(x: ExpertLayers, hw: HardwareProfile, compression: Compression | None):
    """Seconds of one expert computed on the CPU at a decode's few rows (inf where the
    profile has not measured it)."""
    rate = hw.cpu_expert_gbps.get(format_name(compression))
    if not rate:
        return math.inf
    return hw.cpu_expert_fixed_s + x.expert_bytes / (rate * GB)


CPU_SHARES = tuple(step / 8 for step in range(9))


def cpu_share(
    x: ExpertLayers, hw: HardwareProfile, compression: Compression | None, tokens: float
) -> float:
    """The share of a decode step's touched experts in pinned memory to compute on the
    CPU (of `CPU_SHARES`) that gives the shortest expert phase; 0 where none helps."""
    if not x.cpu or math.isinf(_cpu_expert_s(x, hw, compression)):
        return 0.0
    phases = {s: expert_phase(x, hw, compression, tokens, cpu_share=s).seconds for s in CPU_SHARES}
    return min(phases, key=lambda s: (phases[s], s))


def _matmuls_s(
    x: ExpertLayers,
    hw: HardwareProfile,
    compression: Compression | None,
    rows: float,
    calls: float,
    prefill: bool,
) -> float:
    """GPU time of `calls` experts' two matmuls over `rows` rows each: at the decode
    matmul rate of their rows, or a prefill's (compressed: from DENSE_ROWS rows each
    slice dequantizes the expert and multiplies at the dense rate, `kernels.qmatmul`)."""
    if not prefill:
        return hw.matmul_seconds(compression, calls * x.expert_bytes, int(rows), 2 * int(calls))
    flops = 2 * rows * x.params * calls
    if compression is None or rows < DENSE_ROWS:
        return flops / (hw.prefill_rate(compression) * 1e12)
    slices = math.ceil(rows / EXPERT_CHUNK_ROWS)
    dequant = calls * slices * x.expert_bytes / (hw.dequant_rate(compression) * GB)
    return flops / (hw.prefill_rate(None) * 1e12) + dequant


@dataclass(frozen=True)
class ExpertSteps:
    """A block's expert phases over all its expert layers: a decode step's and the
    prefill's seconds, the decode step's lanes, and what the plan says of its experts."""

    decode_s: float
    prefill_s: float
    lanes: dict[str, float]
    facts: dict[str, float]

    def added(self, step: float, prefill: float, lanes: dict[str, float]):
        """(step, prefill) with these phases added, and their lanes into `lanes`."""
        for lane, seconds in self.lanes.items():
            lanes[lane] = lanes.get(lane, 0.0) + seconds
        return step + self.decode_s, prefill + self.prefill_s


def expert_steps(
    cfg: ModelConfig,
    policy,
    dtype: torch.dtype,
    hw: HardwareProfile,
    sizes: list[int],
    prompt_len: int,
    dense: bool = False,
) -> ExpertSteps | None:
    """A `policies.Policy`'s expert phases for micro-batches of `sizes` sequences;
    None for a dense model."""
    compression = policy.weight_compression
    x = expert_layers(cfg, dtype, compression, policy.weights)
    if x is None:
        return None
    seqs, micro = sum(sizes), len(sizes)
    share = policy.cpu_experts
    decode = expert_phase(x, hw, compression, seqs, False, micro, dense, cpu_share=share)
    prefill = expert_phase(x, hw, compression, seqs * prompt_len, True, micro, dense)
    facts = {
        "layers": x.layers,
        "experts": x.count,
        "expert_bytes": x.expert_bytes,
        "gpu": x.gpu,
        "cpu": x.cpu,
        "disk": x.disk,
        "decode_chosen": decode.touched,
        "decode_moved": decode.moved,
        "decode_moved_bytes": x.layers * decode.moved * x.expert_bytes,
        "decode_on_cpu": decode.on_cpu,
    }
    lanes = {lane: x.layers * getattr(decode, lane) for lane in ("h2d", "disk", "compute")}
    lanes["cpu_expert"] = x.layers * decode.cpu
    return ExpertSteps(x.layers * decode.seconds, x.layers * prefill.seconds, lanes, facts)


def with_cpu_experts(cfg: ModelConfig, policy, dtype: torch.dtype, hw: HardwareProfile):
    """The policy with the share of its decode's experts in pinned memory that the CPU
    computes best (`cpu_share`; unchanged for a dense model)."""
    compression = policy.weight_compression
    x = expert_layers(cfg, dtype, compression, policy.weights)
    if x is None or not paths.cpu_experts_ok(cfg):
        return policy
    share = cpu_share(x, hw, compression, policy.block_size)
    return dataclasses.replace(policy, cpu_experts=share)
