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
from offload.policies.caps import Baseline, Caps, fit_problem, plan_budget
from offload.policies.cost import Estimate, estimate
from offload.policies.cost_moe import with_cpu_experts
from offload.policies.hardware import HardwareProfile
from offload.policies.memory import plan_memory
from offload.policies.policy import Placement, Policy

# rows a micro-batch and micro-batches a block: fine enough that memory, not the grid,
# sets the block (the 7.2 GB that the tied table freed on BLOOM-176B hold 40 sequences,
# between the old grid's 32 and 48, which does not fit: run 222029; OPT-30B fp16 at
# 24 GB, whose 96 x 1 no longer fits once the host heap is counted, predicts 88 x 1 at
# 90.5 tok/s where the old grid's best was 48 x 2 at 69.8, on run 021705's profile;
# W1c, OPT-30B int4 W + KV all on the GPU at 24 GB: 14 sequences fit where 16 do not)
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
    if gpu_left + scratch >= kv_total:  # all on the GPU, which needs no scratch
        return Placement(1.0, 0.0, 0.0)
    if gpu_left < 0 or cpu_left < 0:  # over a cap before any KV is placed: none fits
        return None
    gpu = min(1.0, max(0.0, gpu_left / kv_total))
    cpu = min(1.0 - gpu, max(0.0, cpu_left / kv_total))
    disk_ok = caps.nvme
    if 1.0 - gpu - cpu > 1e-9 and not disk_ok:
        return None
    # whole sequences, rounded down: a fraction's rows are rounded to the nearest
    # (`Placement.split`), which could place one more sequence than the budget holds
    rows = base.block_size
    gpu = math.floor(gpu * rows) / rows
    if not disk_ok:  # the rounding's remainder goes to the CPU (checked against the cap later)
        return Placement(gpu, round(1.0 - gpu, 6), 0.0)
    cpu = math.floor(cpu * rows) / rows
    return Placement(gpu, cpu, round(1.0 - gpu - cpu, 6))


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
    weights alone / for half of it, the remainder on disk."""
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
        for cpu in sorted(shares):
            cpu = math.floor(cpu * 1000) / 1000
            if not caps.nvme and cpu < rest - 1e-9:
                continue
            disk = round(max(0.0, 1.0 - gpu - cpu), 6)
            if disk and not caps.nvme:
                continue
            out.append(Placement(gpu, round(1.0 - gpu - disk, 6), disk))
    return out


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
                    for placement in weights:
                        yield Policy(
                            size,
                            count,
                            weights=placement,
                            kv_cache=Placement(1.0, 0.0, 0.0),
                            attention_on_cpu=cpu_attention,
                            weight_compression=compression,
                            kv_compression=kv_compression,
                        )


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
) -> Estimate:
    """The best fitting policy's estimate; `UserError` with the smallest fit if none.

    `compressions` and `kv_compressions` are the weight and KV formats the search may
    choose among (None: uncompressed); tp: tensor-parallel ranks (cfg is a rank's shard)."""
    return ranked(
        cfg, dtype, prompt_len, gen_len, hw, caps, num_prompts, compressions, kv_compressions, tp
    )[0]


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
) -> list[Estimate]:
    """The `top` fitting plans, fastest first, one per kind of plan (batch shape,
    attention placement and formats: the best weight and KV split of each), so the
    runners-up differ in what a probe can tell apart (`executor.probe`)."""
    if caps.gpu_bytes is None or caps.cpu_bytes is None:
        raise ValueError(f"the search needs both caps resolved to bytes, got {caps}")
    if prompt_len + gen_len > cfg.max_position_embeddings:
        raise UserError(
            f"prompt {prompt_len} + generation {gen_len} tokens exceed the model's context of "
            f"{cfg.max_position_embeddings}"
        )
    best: dict[tuple, Estimate] = {}  # per kind of plan
    for base in candidates(cfg, dtype, hw, caps, num_prompts, compressions, kv_compressions):
        kv = _kv_placement(cfg, base, dtype, prompt_len, gen_len, hw, caps)
        if kv is None:
            continue
        policy = with_cpu_experts(cfg, _with(base, kv=kv), dtype, hw)
        est = estimate(cfg, policy, dtype, prompt_len, gen_len, hw, tp=tp)
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
        message = _smallest_fit(cfg, dtype, prompt_len, gen_len, hw, caps, smallest, smallest_kv)
        int4 = Compression(4, 64, False)  # the smaller formats' fit, where it is smaller
        need = _smallest_need(cfg, dtype, prompt_len, gen_len, hw, caps, int4, int4)
        if need not in message:
            message += f"; with --compress int4 --kv-compress int4 it needs {need}"
        raise UserError(message)
    return sorted(best.values(), key=lambda e: -e.total_tok_s)[:top]


def _smallest_need(
    cfg, dtype, prompt_len, gen_len, hw: HardwareProfile, caps: Caps, compression, kv_compression
) -> str:
    """The peaks of the smallest plan: one sequence, weights and KV on disk (with a
    disk) or in CPU memory, attention on the CPU, in these formats."""
    on_disk = caps.nvme
    weights = Placement(0.0, 0.0, 1.0) if on_disk else Placement(0.0, 1.0, 0.0)
    kv = Placement(0.0, 0.0, 1.0) if on_disk else Placement(0.0, 1.0, 0.0)
    policy = Policy(
        1, 1, weights=weights, kv_cache=kv, attention_on_cpu=True,
        weight_compression=compression, kv_compression=kv_compression,
    )  # fmt: skip
    est = estimate(cfg, policy, dtype, prompt_len, gen_len, hw)
    return f"{est.gpu_peak_bytes / 1e9:.1f} GB GPU and {est.cpu_peak_bytes / 1e9:.1f} GB CPU"


def _smallest_fit(
    cfg, dtype, prompt_len, gen_len, hw: HardwareProfile, caps: Caps, compression, kv_compression
) -> str:
    need = _smallest_need(cfg, dtype, prompt_len, gen_len, hw, caps, compression, kv_compression)
    hint = "" if caps.nvme else " (less CPU memory with --nvme)"
    return (
        f"no policy fits --gpu-mem {caps.gpu_bytes / 1e9:.1f} GB and --cpu-mem "
        f"{caps.cpu_bytes / 1e9:.1f} GB; the smallest fit needs {need}{hint}"
    )
