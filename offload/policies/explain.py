"""Why this plan: the chosen policy beside its neighbours, each priced for the job.

    batch      the next micro-batch size up and down, the next micro-batch count up
               and down (`search.BATCH_SIZES`, `search.NUM_BATCHES`)
    weights    a grid step (`search.WEIGHT_STEPS`) more and less of the weights on the GPU
    kv         one sequence's KV cache more and less on the GPU
    attention  the attention on the other device
    formats    the best plan of each other weight and KV format the run allows

Each neighbour is costed (`cost.estimate`), checked by the engine's own fit check
(`caps.fit_problem`, as the search checks) and, where it fits, priced for the job
(`job.predict_job`: the load and every block). offload-plan --explain prints them
ranked; --stats records them for the run.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from offload.core.config import ModelConfig
from offload.core.errors import UserError
from offload.kernels.formats import Compression
from offload.policies.caps import Baseline, Caps, fit_problem, peak_bytes
from offload.policies.cost import estimate
from offload.policies.cost_moe import with_cpu_experts
from offload.policies.hardware import HardwareProfile, format_name
from offload.policies.job import Job, predict_job
from offload.policies.policy import Placement, Policy
from offload.policies.search import BATCH_SIZES, NUM_BATCHES, WEIGHT_STEPS, search

GB = 1e9


@dataclass(frozen=True)
class Candidate:
    """A plan beside the chosen one: what differs, its predicted job time (None: it does
    not fit), the lane that bounds its decode step, and why it was not chosen."""

    policy: Policy
    change: str
    job_seconds: float | None
    bottleneck: str | None
    reason: str
    chosen: bool = False

    def to_dict(self) -> dict:
        return {
            "policy": self.policy.to_dict(),
            "change": self.change,
            "job_seconds": self.job_seconds,
            "bottleneck": self.bottleneck,
            "reason": self.reason,
            "chosen": self.chosen,
        }


@dataclass(frozen=True)
class _Pricing:
    """What every candidate is priced with."""

    cfg: ModelConfig
    dtype: torch.dtype
    job: Job
    hw: HardwareProfile
    caps: Caps
    lengths: tuple[int, int]
    nvme: Path | None
    checkpoint_bytes: int
    tp: int


def neighbours(
    cfg: ModelConfig,
    dtype: torch.dtype,
    chosen: Policy,
    job: Job,
    hw: HardwareProfile,
    caps: Caps,
    lengths: tuple[int, int],
    weight_formats: tuple[Compression | None, ...],
    kv_formats: tuple[Compression | None, ...],
    nvme: Path | None = None,
    checkpoint_bytes: int = 0,
    tp: int = 1,
) -> list[Candidate]:
    """The chosen plan and its neighbours, fitting ones by predicted job time first,
    then those that do not fit."""
    pricing = _Pricing(cfg, dtype, job, hw, caps, lengths, nvme, checkpoint_bytes, tp)
    best = _price(pricing, chosen, "chosen")
    assert best.job_seconds is not None, "the chosen plan fits"
    out = [dataclasses.replace(best, chosen=True, reason="chosen: the least predicted time")]
    seen = {_key(chosen)}
    variants = [*_shape_variants(chosen), *_split_variants(chosen)]
    variants += _format_variants(pricing, chosen, weight_formats, kv_formats)
    for change, policy in variants:
        if isinstance(policy, str):  # a format with no plan that fits: its refusal
            out.append(Candidate(chosen, change, None, None, f"no plan fits: {policy}"))
            continue
        if _key(policy) in seen or not _in_grid(policy, job):
            continue
        seen.add(_key(policy))
        out.append(_judged(_price(pricing, policy, change), best.job_seconds))
    return sorted(out, key=lambda c: (c.job_seconds is None, c.job_seconds or 0.0))


def _in_grid(policy: Policy, job: Job) -> bool:
    """The search's own bound (`search.candidates`): no block of several micro-batches
    larger than the job."""
    return policy.num_gpu_batches == 1 or policy.block_size <= max(job.count, 1)


def _key(policy: Policy) -> str:
    return policy.to_json()


def _price(pricing: _Pricing, policy: Policy, change: str) -> Candidate:
    """The policy costed and checked as the search does; priced for the job if it fits."""
    p = pricing
    policy = with_cpu_experts(p.cfg, policy, p.dtype, p.hw)
    est = estimate(p.cfg, policy, p.dtype, *p.lengths, p.hw, tp=p.tp)
    base = Baseline.from_profile(p.hw)
    problem = _placement_problem(policy, p.caps) or fit_problem(est.memory, p.caps, base)
    if problem is not None:
        over = _over_by(est.memory, p.caps, base)
        return Candidate(policy, change, None, est.bottleneck, f"does not fit: {over}{problem}")
    seconds = predict_job(
        p.cfg, policy, p.dtype, p.job, p.hw, p.nvme, p.checkpoint_bytes, p.tp
    ).seconds
    return Candidate(policy, change, seconds, est.bottleneck, "")


def _placement_problem(policy: Policy, caps: Caps) -> str | None:
    if not caps.nvme and (policy.weights.disk > 0 or policy.kv_cache.disk > 0):
        return "it puts bytes on disk and no --nvme is given"
    return None


def _over_by(memory, caps: Caps, base: Baseline) -> str:
    """Which cap the plan breaks and by how much: "--gpu-mem by 1.20 GB; "."""
    gpu, cpu = peak_bytes(memory, base, caps.shared_weights)
    parts = []
    if caps.gpu_bytes is not None and gpu > caps.gpu_bytes:
        parts.append(f"--gpu-mem by {(gpu - caps.gpu_bytes) / GB:.2f} GB")
    if caps.cpu_bytes is not None and cpu > caps.cpu_bytes:
        parts.append(f"--cpu-mem by {(cpu - caps.cpu_bytes) / GB:.2f} GB")
    return f"breaks {' and '.join(parts)}; " if parts else ""


def _judged(candidate: Candidate, chosen_s: float) -> Candidate:
    if candidate.job_seconds is None:
        return candidate
    ratio = candidate.job_seconds / chosen_s - 1
    if ratio >= 0:
        why = f"{100 * ratio:.1f}% slower for this job ({candidate.bottleneck}-bound)"
    else:  # the search ranks plans by the job at its longest prompt (`search.ranked`)
        why = (
            f"{-100 * ratio:.1f}% faster for this job by its blocks' own shapes, but not at "
            "the job's longest prompt, which the search ranks by"
        )
    return dataclasses.replace(candidate, reason=why)


def _neighbours_in(values: tuple[int, ...], value: int) -> list[int]:
    """The values on either side of `value` in a sorted grid."""
    below = [v for v in values if v < value]
    above = [v for v in values if v > value]
    return ([below[-1]] if below else []) + ([above[0]] if above else [])


def _shape_variants(chosen: Policy) -> list[tuple[str, Policy]]:
    out = []
    for size in _neighbours_in(BATCH_SIZES, chosen.gpu_batch_size):
        change = f"micro-batch {chosen.gpu_batch_size} -> {size}"
        out.append((change, dataclasses.replace(chosen, gpu_batch_size=size)))
    for count in _neighbours_in(NUM_BATCHES, chosen.num_gpu_batches):
        change = f"micro-batches {chosen.num_gpu_batches} -> {count}"
        out.append((change, dataclasses.replace(chosen, num_gpu_batches=count)))
    flipped = "CPU" if not chosen.attention_on_cpu else "GPU"
    out.append((f"attention on the {flipped}",
                dataclasses.replace(chosen, attention_on_cpu=not chosen.attention_on_cpu)))  # fmt: skip
    return out


def _split_variants(chosen: Policy) -> list[tuple[str, Policy]]:
    """A grid step of weights and one sequence of KV moved onto and off the GPU."""
    out = []
    step = 1 / WEIGHT_STEPS
    for delta in (step, -step):
        moved = _moved(chosen.weights, delta)
        if moved is not None:
            change = f"weights on the GPU {chosen.weights.gpu:.0%} -> {moved.gpu:.0%}"
            out.append((change, dataclasses.replace(chosen, weights=moved)))
    row = 1 / chosen.block_size
    for delta in (row, -row):
        moved = _moved(chosen.kv_cache, delta)
        if moved is not None:
            change = f"KV on the GPU {chosen.kv_cache.gpu:.0%} -> {moved.gpu:.0%}"
            out.append((change, dataclasses.replace(chosen, kv_cache=moved)))
    return out


def _moved(place: Placement, delta: float) -> Placement | None:
    """`delta` of the whole moved onto the GPU (negative: off it), taken from or given to
    the CPU, then the disk; None past the ends."""
    gpu = round(place.gpu + delta, 6)
    if not 0 <= gpu <= 1 or gpu == place.gpu:
        return None
    if delta < 0:  # off the GPU: into CPU RAM
        return Placement(gpu, round(place.cpu - delta, 6), place.disk)
    cpu = max(0.0, round(place.cpu - delta, 6))
    disk = round(1.0 - gpu - cpu, 6)
    return Placement(gpu, cpu, disk) if disk >= 0 else None


def _format_variants(
    pricing: _Pricing,
    chosen: Policy,
    weight_formats: tuple[Compression | None, ...],
    kv_formats: tuple[Compression | None, ...],
) -> list[tuple[str, Policy | str]]:
    """Each other pair of allowed formats: its best plan for the job (the search's), or
    why none fits."""
    p, out = pricing, []
    for weights, kv in itertools.product(weight_formats, kv_formats):
        if (weights, kv) == (chosen.weight_compression, chosen.kv_compression):
            continue
        change = f"weights {format_name(weights)}, KV {format_name(kv)}"
        try:
            best = search(
                p.cfg, p.dtype, *p.lengths, p.hw, p.caps, None, (weights,), (kv,), p.tp, p.job
            )
        except UserError as exc:
            out.append((change, str(exc)))
            continue
        out.append((change, best.policy))
    return out
