"""Policy search: the placement and batch shape with the highest predicted throughput
that fits the caps.

An exact search over a bounded grid (batch shapes x attention placement x weight
fractions in 5% steps x disk shares), with KV placed greedily in each candidate
(GPU memory left after the weights, then CPU, then disk). Throughput is not linear in
the batch shape (FlexGen's LP relaxes it and rounds); the grid is small enough
(a few thousand candidates, ~1 ms each) to evaluate exactly. docs/cost_model.md.
"""

from __future__ import annotations

import itertools
import math

import torch

from offload.core.config import ModelConfig
from offload.core.errors import UserError
from offload.io.layout import stage_image_bytes
from offload.kernels.formats import Compression
from offload.policies import paths
from offload.policies.caps import Baseline, Caps, fit_problem, others_weight_bytes, plan_budget
from offload.policies.cost import Estimate, estimate
from offload.policies.cost_moe import with_cpu_experts
from offload.policies.hardware import HardwareProfile
from offload.policies.job import Block, Job, estimate_job
from offload.policies.latent import latent_problem
from offload.policies.memory import plan_memory
from offload.policies.policy import Placement, Policy

# rows a micro-batch and micro-batches a block: fine enough that memory, not the grid,
# sets the block (the 7.2 GB that the tied table frees on BLOOM-176B hold 40 sequences,
# between 32 and 48, which does not fit; OPT-30B fp16 at 24 GB, where 96 x 1 does not
# fit once the host heap is counted, predicts 88 x 1 at 90.5 tok/s where a grid of
# powers of two's best is 48 x 2 at 69.8; W1c, OPT-30B int4 W + KV all on the GPU at
# 24 GB: 14 sequences fit where 16 do not; docs/cost_model.md)
BATCH_SIZES = (1, 2, 4, 5, 6, 8, 10, 12, 14, 16, 18, 20, 24, 28, 32, 40, 48, 56, 64, 72)
BATCH_SIZES += (80, 88, 96)
BATCH_SIZES += (112, 128, 160, 192, 224, 256)
NUM_BATCHES = (1, 2, 4, 6, 8, 12, 16)
WEIGHT_STEPS = 20


def _fits(est: Estimate, caps: Caps, hw: HardwareProfile) -> bool:
    """The engine's own check (`policies.caps`), so a returned plan is never refused."""
    return fit_problem(est.memory, caps, Baseline.from_profile(hw)) is None


def _kv_placement(
    cfg, base: Policy, dtype, prompt_len, gen_len, hw: HardwareProfile, caps: Caps
) -> Placement | None:
    """Greedy KV placement: as much on the GPU as fits, then the CPU, then disk."""
    probe = plan_memory(cfg, _with(base, kv=Placement(0.0, 1.0, 0.0)), dtype, prompt_len, gen_len)
    kv_total = max(probe.detail["kv_cpu"], 1)
    scratch = probe.detail["kv_scratch_gpu"]  # only where some rows are off the GPU
    gpu_budget, cpu_budget = plan_budget(caps, Baseline.from_profile(hw))
    gpu_left = gpu_budget - (probe.run_bytes("gpu") - probe.detail["kv_gpu"])
    cpu_left = cpu_budget - (probe.run_bytes("cpu") - probe.detail["kv_cpu"])
    cpu_left += others_weight_bytes(probe, caps.shared_weights)
    if gpu_left + scratch >= kv_total:  # all on the GPU, which needs no scratch
        return Placement(1.0, 0.0, 0.0)
    if cfg.kv_lora_rank:  # a latent cache lives on the GPU only (`policies.latent`)
        return None
    if gpu_left < 0 or cpu_left < 0:  # over a cap before any KV is placed: none fits
        return None
    return _whole_rows(base.block_size, gpu_left / kv_total, cpu_left / kv_total, caps.nvme)


def _whole_rows(rows: int, gpu_room: float, cpu_room: float, disk_ok: bool) -> Placement | None:
    """KV fractions of whole sequences out of `rows`: as many on the GPU as its room
    holds (rounded down: a fraction's rows are rounded to the nearest by
    `Placement.split`, which could place one more sequence than the budget holds), then
    the CPU's out of the rows the GPU leaves (counted after the GPU's rounding, so a
    CPU with room leaves nothing for the disk), the rest on disk. Without a disk the
    CPU takes the rest (its cap is checked later); None where that needs a disk. Room
    is in multiples of the whole cache."""
    gpu = min(rows, math.floor(max(0.0, gpu_room) * rows + 1e-9))
    cpu = min(rows - gpu, math.floor(max(0.0, cpu_room) * rows + 1e-9))
    if not disk_ok:
        if min(1.0, gpu_room) + cpu_room < 1.0 - 1e-9:
            return None
        return Placement(gpu / rows, (rows - gpu) / rows, 0.0)
    return Placement(gpu / rows, cpu / rows, round(1.0 - (gpu + cpu) / rows, 6))


def _with(p: Policy, kv: Placement | None = None, weights: Placement | None = None) -> Policy:
    return Policy(
        gpu_batch_size=p.gpu_batch_size,
        num_gpu_batches=p.num_gpu_batches,
        weights=weights or p.weights,
        kv_cache=kv or p.kv_cache,
        activations=p.activations,
        attention_on_cpu=p.attention_on_cpu,
        overlap=True,
        weight_compression=p.weight_compression,
        kv_compression=p.kv_compression,
        cpu_experts=p.cpu_experts,
    )


def _weight_options(
    cfg, dtype, hw: HardwareProfile, caps: Caps, compression: Compression | None
) -> list[Placement]:
    """Weight placements worth trying: GPU share on a 5% grid up to what the GPU cap
    allows; the rest all in CPU RAM, or (with a disk) as much CPU as the cap leaves for
    weights alone / for half of it, the remainder on disk; a mixture of experts' with a
    disk also all on disk, as its disk experts' staging (two layers of them) and a layer
    placed at the load can take the room those shares leave (DeepSeek-V3 at --cpu-mem
    120GB: 47.6 GB and 24.4 GB beside half the room's weights, 134 GB in all)."""
    total = sum(stage_image_bytes(cfg, dtype, compression))
    cpu_room = max(0.0, plan_budget(caps, Baseline.from_profile(hw))[1] / total)
    out = []
    for step in range(WEIGHT_STEPS + 1):
        gpu = step / WEIGHT_STEPS
        if gpu * total > caps.gpu_bytes:
            break
        rest = 1.0 - gpu
        shares = (
            {rest}
            if not caps.nvme
            else {rest, min(rest, 0.95 * cpu_room), min(rest, 0.5 * cpu_room)}
        )
        if caps.nvme and cfg.num_experts:
            shares.add(0.0)
        for cpu in sorted(shares):
            cpu = math.floor(cpu * 1000) / 1000
            if not caps.nvme and cpu < rest - 1e-9:
                continue
            disk = round(max(0.0, 1.0 - gpu - cpu), 6)
            if disk and not caps.nvme:
                continue
            out.append(Placement(gpu, round(1.0 - gpu - disk, 6), disk))
    return out


def kv_formats(
    cfg: ModelConfig, kv_compressions: tuple[Compression | None, ...]
) -> tuple[Compression | None, ...]:
    """The KV formats a plan of `cfg` may use. Soft-capped attention scores (Gemma 2)
    keep the cache at full precision: the compressed cache's decode kernels cannot cap
    them (`models.attention`), so auto leaves them out and a format asked for alone (a
    flag, a policy file) is refused."""
    if cfg.attn_softcap is None:
        return kv_compressions
    if None not in kv_compressions:
        raise UserError(
            "a compressed KV cache is not supported for a model with attention soft-capping "
            "(attn_logit_softcapping, as Gemma 2 sets): its decode kernels cannot cap the "
            "scores; use --kv-compress none (or a policy without kv_compression)"
        )
    return (None,)


def candidates(
    cfg,
    dtype,
    hw: HardwareProfile,
    caps: Caps,
    max_block: int | None,
    compressions: tuple[Compression | None, ...] = (None,),
    kv_compressions: tuple[Compression | None, ...] = (None,),
):
    for compression, kv_compression in itertools.product(compressions, kv_compressions):
        weights = _weight_options(cfg, dtype, hw, caps, compression)
        for size in BATCH_SIZES:
            for count in NUM_BATCHES:
                if max_block is not None and size * count > max(max_block, 1) and count > 1:
                    continue
                for cpu_attention in (False, True):
                    if not _overlaps(cpu_attention, count, hw):
                        continue
                    for placement in weights:
                        policy = Policy(
                            size,
                            count,
                            weights=placement,
                            kv_cache=Placement(1.0, 0.0, 0.0),
                            attention_on_cpu=cpu_attention,
                            weight_compression=compression,
                            kv_compression=kv_compression,
                        )
                        if latent_problem(cfg, policy) is None:  # (`policies.latent`)
                            yield policy


def _overlaps(cpu_attention: bool, micro_batches: int, hw: HardwareProfile) -> bool:
    """Whether a block of `micro_batches` overlaps its CPU attention with GPU work where a
    rank shares its node (`hw.node_ranks`): one micro-batch leaves the GPU idle while the
    CPU attends, and under tensor parallelism the group's all-reduces wait for it."""
    return not cpu_attention or hw.node_ranks == 1 or micro_batches >= 2


def search(
    cfg: ModelConfig,
    dtype: torch.dtype,
    prompt_len: int,
    gen_len: int,
    hw: HardwareProfile,
    caps: Caps,
    num_prompts: int | None = None,
    compressions: tuple[Compression | None, ...] = (None,),
    kv_compressions: tuple[Compression | None, ...] = (None,),
    tp: int = 1,
    job: Job | None = None,
) -> Estimate:
    """The best fitting policy's estimate; `UserError` with the smallest fit if none.

    `compressions` and `kv_compressions` are the weight and KV formats the search may
    choose among (None: uncompressed); tp: tensor-parallel ranks (cfg is a rank's shard);
    job: the requests to plan for (`ranked`)."""
    return ranked(
        cfg, dtype, prompt_len, gen_len, hw, caps, num_prompts, compressions, kv_compressions, tp,
        job=job,
    )[0]  # fmt: skip


def ranked(
    cfg: ModelConfig,
    dtype: torch.dtype,
    prompt_len: int,
    gen_len: int,
    hw: HardwareProfile,
    caps: Caps,
    num_prompts: int | None = None,
    compressions: tuple[Compression | None, ...] = (None,),
    kv_compressions: tuple[Compression | None, ...] = (None,),
    tp: int = 1,
    top: int = 1,
    job: Job | None = None,
) -> list[Estimate]:
    """The `top` fitting plans, fastest first, one per kind of plan (batch shape,
    attention placement and formats: the best weight and KV split of each), so the
    runners-up differ in what a probe can tell apart (`executor.probe`).

    Fastest: the highest throughput of a full block; with a job, the least predicted
    wall time for its requests (`by_job_time`)."""
    if caps.gpu_bytes is None or caps.cpu_bytes is None:
        raise ValueError(f"the search needs both caps resolved to bytes, got {caps}")
    kv_compressions = kv_formats(cfg, kv_compressions)
    if prompt_len + gen_len > cfg.max_position_embeddings:
        raise UserError(
            f"prompt {prompt_len} + generation {gen_len} tokens exceed the model's context of "
            f"{cfg.max_position_embeddings}"
        )
    best: dict[tuple, Estimate] = {}  # per kind of plan
    if num_prompts is None and job is not None:
        num_prompts = job.count
    for base in candidates(cfg, dtype, hw, caps, num_prompts, compressions, kv_compressions):
        kv = _kv_placement(cfg, base, dtype, prompt_len, gen_len, hw, caps)
        if kv is None:
            continue
        policy = with_cpu_experts(cfg, _with(base, kv=kv), dtype, hw)
        est = estimate(cfg, policy, dtype, prompt_len, gen_len, hw, tp=tp)
        if paths.ruled_out(cfg, policy):  # (a path the model's math cannot take)
            continue
        kind = (
            policy.gpu_batch_size,
            policy.num_gpu_batches,
            policy.attention_on_cpu,
            policy.weight_compression,
            policy.kv_compression,
        )
        held = best.get(kind)
        if _fits(est, caps, hw) and (held is None or est.total_tok_s > held.total_tok_s):
            best[kind] = est
    if not best:
        smallest = min(compressions, key=lambda c: sum(stage_image_bytes(cfg, dtype, c)))
        smallest_kv = min(kv_compressions, key=lambda c: 16 if c is None else c.bits)
        args = (cfg, dtype, prompt_len, gen_len, hw, caps)
        need = _smallest_need(*args, smallest, smallest_kv)
        message = _smallest_fit(caps, need)
        int4 = Compression(4, 64, False)  # the smaller formats' fit, where it is nearer
        need_int4 = _smallest_need(*args, int4, int4)
        if _beyond_caps(need_int4, caps) < _beyond_caps(need, caps):
            message += f"; with --compress int4 --kv-compress int4 it needs {_peaks(need_int4)}"
        raise UserError(message)
    if job is not None:  # each request at the lengths the plans were sized for
        uniform = Job.uniform(job.count, prompt_len, gen_len)
        return by_job_time(list(best.values()), cfg, dtype, hw, uniform, tp, top)
    return sorted(best.values(), key=lambda e: -e.total_tok_s)[:top]


def by_job_time(
    plans: list[Estimate], cfg: ModelConfig, dtype: torch.dtype, hw: HardwareProfile, job: Job,
    tp: int = 1, top: int = 1,
) -> list[Estimate]:  # fmt: skip
    """The `top` plans by the job's predicted wall time (`policies.job`: the load and
    every block at its own shape); on a tie, the smaller block. The plans' estimates are
    for a full block at the job's longest request.

    A block fuller than another streams the same weights for more rows, so no block
    runs faster than its plan's full block: the job's tokens at that rate bound its
    time from below, and plans are timed by that bound until it passes the top's."""
    prompt_len, gen_len = job.longest
    tokens = sum(job.gen_lens)
    timed: list[tuple[tuple[float, int], Estimate]] = []
    for est in sorted(plans, key=lambda e: -e.total_tok_s):
        kept = sorted(key for key, _ in timed)
        if len(kept) >= top and tokens / est.total_tok_s >= kept[top - 1][0]:
            break  # (the plans after it have lower rates: larger bounds)
        full = Block(est.policy.block_size, prompt_len, gen_len)
        total = estimate_job(cfg, est.policy, dtype, job, hw, tp, known=(full, est)).seconds
        timed.append(((round(total, 6), est.policy.block_size), est))
    return [est for _, est in sorted(timed, key=lambda pair: pair[0])][:top]


def _smallest_need(
    cfg, dtype, prompt_len, gen_len, hw: HardwareProfile, caps: Caps, compression, kv_compression
) -> tuple[int, int]:
    """The (GPU, CPU) peaks of the smallest plan: one sequence, weights and KV on disk
    (with a disk) or in CPU memory, attention on the CPU, in these formats (a latent
    cache on the GPU, uncompressed, attended there: `policies.latent`)."""
    on_disk = caps.nvme
    weights = Placement(0.0, 0.0, 1.0) if on_disk else Placement(0.0, 1.0, 0.0)
    kv = Placement(0.0, 0.0, 1.0) if on_disk else Placement(0.0, 1.0, 0.0)
    latent = bool(cfg.kv_lora_rank)
    policy = Policy(
        1, 1, weights=weights, kv_cache=Placement() if latent else kv,
        attention_on_cpu=not latent, weight_compression=compression,
        kv_compression=None if latent else kv_compression,
    )  # fmt: skip
    est = estimate(cfg, policy, dtype, prompt_len, gen_len, hw)
    return est.gpu_peak_bytes, est.cpu_peak_bytes


def _beyond_caps(peaks: tuple[int, int], caps: Caps) -> int:
    """How far (GPU, CPU) peaks go past the caps, in bytes: a hint must bring it down
    (int4's dequantization buffers can need more GPU than the dense plan's)."""
    gpu, cpu = peaks
    return max(0, gpu - (caps.gpu_bytes or 0)) + max(0, cpu - (caps.cpu_bytes or 0))


def _peaks(peaks: tuple[int, int]) -> str:
    return f"{peaks[0] / 1e9:.1f} GB GPU and {peaks[1] / 1e9:.1f} GB CPU"


def _smallest_fit(caps: Caps, need: tuple[int, int]) -> str:
    hint = "" if caps.nvme else " (less CPU memory with --nvme)"
    return (
        f"no policy fits --gpu-mem {caps.gpu_bytes / 1e9:.1f} GB and --cpu-mem "
        f"{caps.cpu_bytes / 1e9:.1f} GB; the smallest fit needs {_peaks(need)}{hint}"
    )
