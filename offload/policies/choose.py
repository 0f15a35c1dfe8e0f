"""`choose_policy`: the plan search's entry point, shared by offload-plan, offload-run and
`LLM(max_memory=...)`.

It loads the hardware profile (or measures this machine once and caches it), turns
the memory caps into the search's budget (checked against the machine), and searches.
Flags and caps are checked by `EngineArgs` before this runs, so a bad cap never costs a
measurement.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from offload.core.config import ModelConfig, resolve_dtype
from offload.core.errors import UserError
from offload.kernels.formats import Compression
from offload.policies.caps import Baseline, Caps, cpu_only_caps
from offload.policies.cost import Estimate
from offload.policies.hardware import (
    HardwareProfile,
    code_version,
    load_profile,
    profile_path,
    save_profile,
)
from offload.policies.job import Job
from offload.policies.latent import check_latent_kv_formats
from offload.policies.measure import measure
from offload.policies.node import rank_profile
from offload.policies.search import ranked

log = logging.getLogger(__name__)

GB = 1e9


@dataclass(frozen=True)
class Choice:
    """The searched plan, and the machine and budget it was searched for."""

    best: Estimate
    profile: HardwareProfile
    caps: Caps
    dtype: torch.dtype
    ranked: list[Estimate]  # the `top` plans of differing kinds, fastest (best) first


def hardware_profile(
    path: Path | None,
    nvme: Path | None,
    announce: Callable[[str], None] | None = None,
    measure_machine: Callable[[Path | None], HardwareProfile] | None = None,
) -> HardwareProfile:
    """The profile at `path`, else this machine's cached one, else measured now (cached).

    measure_machine: how to measure (`executor.probe.measure_profile` adds the
    executor's fixed costs to `measure.measure`'s device rates; callers above the
    executor pass it)."""
    if path is not None:
        hw = HardwareProfile.from_file(path)
        if hw.code_version != code_version():
            log.warning("the hardware profile %s was measured with other code", path)
        return hw
    cached = load_profile()
    if cached is not None:
        return cached
    (announce or log.warning)(f"measuring this machine once (cached in {profile_path()})")
    hw = (measure_machine or (lambda where: measure(where, quick=True)))(nvme)
    save_profile(hw)
    return hw


def known_profile(path: Path | None) -> HardwareProfile | None:
    """The profile at `path`, else this machine's cached one; None where there is none
    (nothing is measured: a prediction is not worth a measurement)."""
    return HardwareProfile.from_file(path) if path is not None else load_profile()


def plan_caps(gpu_bytes: int, cpu_bytes: int | None, nvme: bool, hw: HardwareProfile) -> Caps:
    """The search budget; a cap the machine cannot honour is an error."""
    cpu = cpu_bytes if cpu_bytes is not None else hw.default_cpu_cap
    if gpu_bytes <= 0 or cpu <= 0:
        raise UserError("memory caps must be positive")
    if hw.has_gpu and gpu_bytes > hw.gpu_mem_bytes:
        raise UserError(
            f"--gpu-mem {gpu_bytes / GB:.1f} GB is more than the GPU's {hw.gpu_mem_bytes / GB:.1f} GB"
        )
    return Caps(gpu_bytes, cpu, nvme)


def _needs_gpu_cap() -> UserError:
    return UserError(
        "the plan search needs a GPU budget: give --gpu-mem (in Python, max_memory="
        '{"cuda:0": "24GB", ...}) along with the CPU cap or store directory'
    )


def choose_policy(
    cfg: ModelConfig,
    dtype: torch.dtype | str,
    gpu_bytes: int | None,
    cpu_bytes: int | None,
    nvme: Path | None,
    prompt_len: int,
    gen_len: int,
    profile: Path | None = None,
    num_prompts: int | None = None,
    compressions: tuple[Compression | None, ...] = (None,),
    kv_compressions: tuple[Compression | None, ...] = (None,),
    announce: Callable[[str], None] | None = None,
    tp: int = 1,
    measure_machine: Callable[[Path | None], HardwareProfile] | None = None,
    top: int = 1,
    dp: int = 1,
    job: Job | None = None,
    baseline: Baseline | None = None,
) -> Choice:
    """The placement and batch shape with the highest predicted throughput in the caps,
    or with a job, the least predicted wall time for its requests (`search.ranked`).

    dtype may be a flag's name ("auto": as offload-run would pick on the profiled machine).
    tp: tensor-parallel ranks (cfg is one rank's shard); dp: data-parallel groups of them
    on this node. The node's cores, DRAM and disk are divided among its tp x dp ranks
    (`node.rank_profile`: the choice's profile is one rank's view), and its groups share
    one pinned copy of the weights (`Caps.shared_weights`). On a machine without a GPU,
    no GPU cap is needed: the plan's device share and its host share are the same
    memory, and share the CPU cap (`caps.cpu_only_caps`). baseline: what the process
    that will run the plan holds already (`Baseline.measure`): the search counts the
    larger of its GPU context and the profile's, so the plan it returns passes that
    run's fit check (a tensor- or data-parallel rank's NCCL buffers are in it, not in
    the profile: 1.5-1.8 GB against 0.8 on the H200 pair, docs/parallel.md)."""
    if gpu_bytes is None and profile is None and torch.cuda.is_available():  # (not measured)
        raise _needs_gpu_cap()
    if prompt_len < 1 or gen_len < 1:
        raise UserError("--prompt-len and --max-tokens must be positive")
    check_latent_kv_formats(cfg, kv_compressions)  # (before a profile is measured)
    hw = rank_profile(hardware_profile(profile, nvme, announce, measure_machine), tp * dp)
    if baseline is not None and baseline.gpu_context_bytes > hw.gpu_context_bytes:
        hw = dataclasses.replace(hw, gpu_context_bytes=baseline.gpu_context_bytes)
    if gpu_bytes is None:
        if hw.has_gpu:
            raise _needs_gpu_cap()
        gpu_bytes, cpu_bytes = cpu_only_caps(
            cpu_bytes or hw.default_cpu_cap, Baseline.from_profile(hw)
        )
    if tp > 1 and not hw.allreduce_gbps:
        log.warning(
            "the hardware profile has no all-reduce figure (offload-profile measures it on a "
            "node with two or more GPUs): the plan leaves the all-reduce out"
        )
    caps = dataclasses.replace(
        plan_caps(gpu_bytes, cpu_bytes, nvme is not None, hw), shared_weights=dp
    )
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype, hw.has_gpu, cfg.checkpoint_dtype)
    plans = ranked(
        cfg,
        dtype,
        prompt_len,
        gen_len,
        hw,
        caps,
        num_prompts,
        compressions,
        kv_compressions,
        tp,
        top,
        job=job,
    )
    return Choice(plans[0], hw, caps, dtype, plans)
