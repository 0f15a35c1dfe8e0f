"""Memory caps and the one fit check.

A cap (`--gpu-mem`, `--cpu-mem`) is a promise: the search returns only policies whose
peak fits, the engine checks the same peak before it loads anything, and the run's
measured peaks are reported against the same numbers. The peak of a tier is

    GPU:  plan.gpu_bytes x (1 + GPU_SLACK) + the CUDA context and library workspaces
    CPU:  plan.cpu_bytes + the process's own resident bytes before any plan bytes
          + HOST_SLACK_BYTES

where the plan (`policies.memory.plan_memory`) counts every buffer the executor
allocates, from the byte layout in `io.layout`. The baseline (context, process) comes
from the hardware profile when planning and is measured live by the engine; both go
through `peak_bytes`, so the search and the engine never disagree on a plan.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil
import torch

from offload.core.config import ModelConfig
from offload.core.errors import UserError
from offload.policies.hardware import HardwareProfile
from offload.policies.memory import MemoryPlan, plan_memory, weight_plan
from offload.policies.memory_limit import node_memory_limit
from offload.policies.policy import Policy

# The plan counts every tensor the executor allocates, but not the CUDA caching
# allocator's block rounding and fragmentation: a GPU peak carries this share on top.
GPU_SLACK = 0.02
# Nor does it count what the process's heap grows by as a run goes on: glibc keeps the
# freed memory of a step's host temporaries (CPU attention's fp32 query, output and
# split partials, logits) and libraries load on first use. Measured outside the pools
# with scripts/lab/rss_watch.py on the H100 machine, OPT-30B at prompt 512: +0.14 GB over
# the profile's baseline with GPU attention (6 x 16), +0.64 GB with CPU attention
# (96 x 1, which breaks its CPU cap by 0.56 GB without this; docs/cost_model.md).
HOST_SLACK_BYTES = 1 << 30
# Nor the libraries' workspaces (cuBLAS, cuBLASLt), which the caching allocator hands out
# on first use: a run's allocations held 25-26 MB beyond the plan's parts, the same at
# 12, 14 and 16 sequences (OPT-30B int4 W + KV cut to 3 layers, scripts/memory_truth.py,
# H100; docs/cost_model.md). Counted where there is a GPU (a CUDA context).
GPU_WORKSPACE_BYTES = 32 << 20


@dataclass(frozen=True)
class Caps:
    """Byte caps per tier (None: the device's own size) and whether a disk is given.
    shared_weights: processes of this node that share one pinned copy of the weights'
    CPU homes (the data-parallel groups of `--dp`), each counting its share of it."""

    gpu_bytes: int | None = None
    cpu_bytes: int | None = None
    nvme: bool = False
    shared_weights: int = 1

    def __post_init__(self) -> None:
        for name in ("gpu_bytes", "cpu_bytes"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"memory cap {name}={value!r} must be positive")


@dataclass(frozen=True)
class Baseline:
    """What a run holds besides its plan: the CUDA context (device bytes the caching
    allocator does not own) and the process's resident host bytes before any weights."""

    gpu_context_bytes: int = 0
    process_bytes: int = 0

    @classmethod
    def measure(cls, device: torch.device) -> Baseline:
        return cls(cuda_context_bytes(device), process_rss())

    @classmethod
    def from_profile(cls, hw: HardwareProfile) -> Baseline:
        return cls(hw.gpu_context_bytes, hw.process_base_bytes)


def cuda_context_bytes(device: torch.device) -> int:
    """Device memory in use that the caching allocator does not own (CUDA context,
    cuBLAS workspaces): measured, not assumed."""
    if device.type != "cuda":
        return 0
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


@dataclass(frozen=True)
class AllocatorHold:
    """What `hold_gpu_allocator` changed in this process, to put back (`release`)."""

    device_index: int
    fraction: float  # the per-process memory fraction before
    settings: str | None  # allocator settings that undo expandable segments (None: kept)

    def release(self) -> None:
        torch.cuda.set_per_process_memory_fraction(self.fraction, self.device_index)
        if self.settings is not None:
            _set_allocator(self.settings)


def hold_gpu_allocator(caps: Caps, base: Baseline, device: torch.device) -> AllocatorHold | None:
    """Hold the CUDA caching allocator to the GPU cap less the context, with expandable
    segments (`EngineArgs.hold_gpu_mem`), until the hold's `release`: what it reserves
    (with the context, what nvidia-smi shows) is held under the cap, not only what it
    hands out, which is what the plan counts. Left to itself, W1c (24 GB cap, 23.48 GB
    allocated with the context) reserved 27.25 GB; held, 23.85 GB, at 396-397 tok/s
    against 410-419 (H100; docs/throughput.md). At the limit
    the allocator frees its cached blocks and retries (a synchronization); with
    expandable segments it maps pages into a segment rather than keeping whole blocks no
    other size fits: held without them, W1c and a BLOOM plan cut to 3 layers ran out of
    memory (scripts/memory_truth.py). W1u held reserved 24.32 GB with the context measured
    at its end, which grew after the plan's. The process's other allocator settings
    (`PYTORCH_ALLOC_CONF`, `PYTORCH_CUDA_ALLOC_CONF`) are kept, and expandable segments
    that they name (or CUDA's own asynchronous allocator, which has none) are left as
    they say. None where there is nothing to hold (no GPU cap)."""
    if device.type != "cuda" or caps.gpu_bytes is None:
        return None
    index = _index(device)
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    before = getter(index) if getter is not None else 1.0
    own = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    undo = None
    if "expandable_segments" not in own and "cudaMallocAsync" not in own:
        # the settings string replaces the whole configuration: the user's go with it
        _set_allocator(",".join(filter(None, (own, "expandable_segments:True"))))
        undo = ",".join(filter(None, (own, "expandable_segments:False")))
    total = torch.cuda.get_device_properties(device).total_memory
    share = (caps.gpu_bytes - base.gpu_context_bytes) / total
    torch.cuda.set_per_process_memory_fraction(min(1.0, max(share, 0.0)), index)
    return AllocatorHold(index, before, undo)


def _set_allocator(settings: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    (setter or torch.cuda.memory._set_allocator_settings)(settings)


def _index(device: torch.device) -> int:
    """The CUDA device's index ("cuda": the current one)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def process_rss() -> int:
    return psutil.Process().memory_info().rss


def peak_bytes(plan: MemoryPlan, base: Baseline, shared_weights: int = 1) -> tuple[int, int]:
    """(GPU, CPU) peak of a run of this plan: the one accounting. shared_weights: the
    processes that share the weights' CPU homes (`Caps.shared_weights`)."""
    gpu = max(gpu_phase_peaks(plan, base))
    cpu = plan.cpu_bytes - others_weight_bytes(plan, shared_weights)
    return gpu, cpu + base.process_bytes + HOST_SLACK_BYTES


def others_weight_bytes(plan: MemoryPlan, shared_weights: int) -> int:
    """The part of a plan's CPU weight homes that the other processes sharing them count
    (`Caps.shared_weights`): a node holds one copy, each process its share."""
    weights = plan.detail.get("weights_cpu", 0)
    return weights - weights // max(1, shared_weights)


def gpu_phase_peaks(plan: MemoryPlan, base: Baseline) -> tuple[int, int]:
    """The GPU peak of each phase, (while the weights load, once they are placed): the
    plan's bytes of the phase, its allocator slack, the context and workspaces."""
    fixed = _gpu_fixed(base)
    load = int(plan.load_bytes("gpu") * (1 + GPU_SLACK)) + fixed
    run = int(plan.run_bytes("gpu") * (1 + GPU_SLACK)) + fixed
    return load, run


def _gpu_fixed(base: Baseline) -> int:
    """GPU bytes a run holds whatever its plan: the CUDA context and the workspaces."""
    return base.gpu_context_bytes + (GPU_WORKSPACE_BYTES if base.gpu_context_bytes else 0)


def plan_budget(caps: Caps, base: Baseline) -> tuple[float, float]:
    """(GPU, CPU) plan bytes the caps leave: the inverse of `peak_bytes`."""
    assert caps.gpu_bytes is not None and caps.cpu_bytes is not None, "a search has both caps"
    gpu = (caps.gpu_bytes - _gpu_fixed(base)) / (1 + GPU_SLACK)
    return gpu, caps.cpu_bytes - base.process_bytes - HOST_SLACK_BYTES


def device_limits(device: torch.device) -> tuple[int, int]:
    """(GPU, CPU) bytes there are when no cap is given: the GPU's memory, and the node's
    limit (`node_memory_limit`: the cgroup's where there is one, since MemTotal reads 31
    GiB at start on the machines whose memory grows to 256 GiB as it is used)."""
    cpu = node_memory_limit()[0]
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, cpu
    return cpu, cpu


@dataclass(frozen=True)
class Machine:
    """The machine a plan is for: the device it computes on, its (GPU, CPU) memory (the
    caps of a run that gives none; on the CPU device both tiers are one memory), and what
    a process holds there before any weights. `here`: this process's machine, measured;
    `profiled`: the one a hardware profile describes (offload-plan --profile FILE)."""

    device: torch.device
    limits: tuple[int, int]
    baseline: Baseline
    where: str  # where the CPU memory figure comes from

    @classmethod
    def here(cls, device: torch.device) -> Machine:
        where = node_memory_limit()[1]
        return cls(device, device_limits(device), Baseline.measure(device), where)

    @classmethod
    def profiled(cls, hw: HardwareProfile) -> Machine:
        device = torch.device("cuda" if hw.has_gpu else "cpu")
        gpu = hw.gpu_mem_bytes if hw.has_gpu else hw.cpu_mem_bytes
        where = f"the hardware profile's, measured on {hw.device_name}"
        return cls(device, (gpu, hw.cpu_mem_bytes), Baseline.from_profile(hw), where)


def default_cpu_bytes() -> int:
    """The CPU budget of a search that is given none: the node's limit, less a tenth
    that the OS, the page cache and other processes keep."""
    return int(0.9 * node_memory_limit()[0])


def whole_problem(
    cfg: ModelConfig,
    policy: Policy,
    dtype: torch.dtype,
    device: torch.device,
    caps: Caps,
    base: Baseline,
    prompt_len: int,
    max_new_tokens: int,
) -> str | None:
    """Why the whole model and a full block of `policy` do not fit the caps on `device`
    (None: they fit). On the CPU device, its tier and the host's are one memory."""
    plan = plan_memory(cfg, policy, dtype, prompt_len, max_new_tokens)
    if device.type == "cuda":
        return fit_problem(plan, caps, base)
    assert caps.cpu_bytes is not None
    need = plan.gpu_bytes + plan.cpu_bytes + base.process_bytes + HOST_SLACK_BYTES
    if need <= caps.cpu_bytes:
        return None
    weights = sum(v for k, v in plan.detail.items() if k.startswith("weights_"))
    return (
        f"it needs {_gb(need)}: weights {_gb(weights)} in {str(dtype).removeprefix('torch.')}, "
        f"the KV cache and activations of {policy.block_size} sequences of "
        f"{prompt_len + max_new_tokens} tokens, this process {_gb(base.process_bytes)} and "
        f"heap growth {_gb(HOST_SLACK_BYTES)}, but this machine has {_gb(caps.cpu_bytes)}"
    )


def cpu_only_caps(cpu_bytes: int, base: Baseline) -> tuple[int, int]:
    """(device, host) caps of a run without a GPU given only a CPU cap: the CPU computes,
    so the plan's device tier is host memory too. The host keeps what it holds whatever
    the plan (this process, its heap growth); the two tiers share the rest in halves.
    A cap that leaves nothing beyond what the process holds plans nothing: refused."""
    held = base.process_bytes + HOST_SLACK_BYTES
    device = max(0, cpu_bytes - held) // 2
    if device < 1:
        raise UserError(
            f"the CPU cap (--cpu-mem, max_memory['cpu']) {_gb(cpu_bytes)} leaves nothing for "
            f"the model: this process already holds {_gb(base.process_bytes)} and keeps "
            f"{_gb(HOST_SLACK_BYTES)} for heap growth; raise the cap above {_gb(held)} "
            "(enough for the weights too), or leave it out to plan for this machine's memory"
        )
    return device, cpu_bytes - device


def check_caps_within_machine(
    caps: Caps, device: torch.device, machine: Machine | None = None
) -> None:
    """A cap above what the machine has is a promise the search would plan for and the
    engine could not keep (its fit check holds the smaller): refused before any search.
    Only the CPU's, and on a GPU the GPU's (on the CPU device the GPU cap is a share of
    the same memory)."""
    gpu, cpu = machine.limits if machine is not None else device_limits(device)
    if caps.cpu_bytes is not None and caps.cpu_bytes > cpu:
        raise UserError(
            f"--cpu-mem {_gb(caps.cpu_bytes)} is more than this machine has "
            f"({_gb(cpu)}, {machine.where if machine is not None else node_memory_limit()[1]}); lower it, or leave it out to plan for "
            "this machine's memory"
        )
    if device.type == "cuda" and caps.gpu_bytes is not None and caps.gpu_bytes > gpu:
        raise UserError(
            f"--gpu-mem {_gb(caps.gpu_bytes)} is more than the GPU has ({_gb(gpu)}); lower "
            "it, or leave it out to plan for the whole GPU"
        )


def fit_problem(
    plan: MemoryPlan, caps: Caps, base: Baseline, limits: tuple[int, int] | None = None
) -> str | None:
    """None when the plan's peaks fit the caps (and the devices' sizes, where given);
    else which tier overflows, by how much, and with what in it."""
    gpu, cpu = peak_bytes(plan, base, caps.shared_weights)
    gpu_limit, cpu_limit = _limits(caps, limits)
    if gpu_limit is not None and gpu > gpu_limit:
        return (
            f"GPU needs {_gb(gpu)} (plan {_gb(plan.gpu_bytes)} + {GPU_SLACK:.0%} allocator slack "
            f"+ CUDA context and workspaces {_gb(_gpu_fixed(base))}) but {_gb(gpu_limit)} is "
            "available"
        )
    if cpu_limit is not None and cpu > cpu_limit:
        return (
            f"CPU needs {_gb(cpu)} (plan {_gb(plan.cpu_bytes)} + this process "
            f"{_gb(base.process_bytes)} + heap growth {_gb(HOST_SLACK_BYTES)}) but "
            f"{_gb(cpu_limit)} is available"
        )
    return None


def _limits(caps: Caps, limits: tuple[int, int] | None) -> tuple[int | None, int | None]:
    gpu_dev, cpu_dev = limits if limits is not None else (None, None)
    return _smaller(caps.gpu_bytes, gpu_dev), _smaller(caps.cpu_bytes, cpu_dev)


def _smaller(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def check_weights_fit(
    cfg: ModelConfig,
    policy: Policy,
    dtype: torch.dtype,
    device: torch.device,
    caps: Caps,
    base: Baseline,
    limits: tuple[int, int] | None = None,
) -> None:
    """Before loading: the weights' share of each tier (homes, ring slots, staging) fits
    (limits: the machine's (GPU, CPU) memory, default this one's)."""
    if policy.weights.disk > 0 and not caps.nvme:
        raise UserError("the policy puts weights on disk; give --nvme DIR for the weight store")
    if policy.kv_cache.disk > 0 and not caps.nvme:
        raise UserError("the policy puts KV cache on disk; give --nvme DIR for the spill file")
    plan = MemoryPlan.from_detail(weight_plan(cfg, policy, dtype))
    problem = fit_problem(plan, caps, base, limits or device_limits(device))
    if problem:
        raise UserError(
            f"the policy's weights do not fit: {problem}; raise the cap or move weights to "
            "cpu/disk (--nvme)"
        )


def check_block_fits(
    cfg: ModelConfig,
    policy: Policy,
    dtype: torch.dtype,
    device: torch.device,
    caps: Caps,
    base: Baseline,
    prompt_len: int,
    max_new_tokens: int,
    limits: tuple[int, int] | None = None,
) -> None:
    """Before generating: weights, KV cache and activations of a full block fit."""
    plan = plan_memory(cfg, policy, dtype, prompt_len, max_new_tokens)
    problem = fit_problem(plan, caps, base, limits or device_limits(device))
    if problem:
        raise UserError(
            f"the policy does not fit prompt {prompt_len} + {max_new_tokens} new tokens in a "
            f"block of {policy.block_size}: {problem}; raise the cap, lower the batch, "
            "or move KV cache to cpu/disk (--nvme)"
        )
