"""Hard memory caps: refuse a policy that cannot fit before any long work starts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from offload.config import ModelConfig
from offload.errors import UserError
from offload.policies.memory import plan_memory, weight_plan
from offload.policies.policy import Policy


@dataclass(frozen=True)
class MemoryCaps:
    """Byte caps per tier; None means the device's own size."""

    gpu_bytes: int | None = None
    cpu_bytes: int | None = None


def cuda_context_bytes(device: torch.device) -> int:
    """Device memory in use that the caching allocator does not own (CUDA context,
    cuBLAS workspaces): measured, not assumed."""
    if device.type != "cuda":
        return 0
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


def process_rss() -> int:
    return psutil.Process().memory_info().rss


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _check(tier: str, need: int, cap: int | None, available: int, what: str, fix: str) -> None:
    limit = min(cap, available) if cap is not None else available
    if need > limit:
        raise UserError(
            f"the policy does not fit: {tier} needs {_gb(need)} ({what}) but {_gb(limit)} is "
            f"available; {fix}"
        )


def _gpu_available(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return psutil.virtual_memory().total


def check_weights_fit(
    cfg: ModelConfig,
    policy: Policy,
    dtype: torch.dtype,
    device: torch.device,
    caps: MemoryCaps,
    nvme: Path | None,
) -> None:
    """Before loading: the weights' share of each tier fits its cap."""
    if policy.weights.disk > 0 and nvme is None:
        raise UserError("the policy puts weights on disk; give --nvme DIR for the weight store")
    if policy.kv_cache.disk > 0 and nvme is None:
        raise UserError("the policy puts KV cache on disk; give --nvme DIR for the spill file")
    plan = weight_plan(cfg, policy, dtype)
    gpu = plan["weights_gpu"] + plan["weight_slots_gpu"] + cuda_context_bytes(device)
    cpu = plan["weights_cpu"] + plan["weight_staging_cpu"] + process_rss()
    _check(
        "GPU",
        gpu,
        caps.gpu_bytes,
        _gpu_available(device),
        "weights, ring slots, CUDA context",
        "raise --gpu-mem or move weights to cpu/disk",
    )
    _check(
        "CPU",
        cpu,
        caps.cpu_bytes,
        psutil.virtual_memory().available + process_rss(),
        "weights, staging, this process",
        "raise --cpu-mem or move weights to disk (--nvme)",
    )


def check_block_fits(
    cfg: ModelConfig,
    policy: Policy,
    dtype: torch.dtype,
    device: torch.device,
    caps: MemoryCaps,
    prompt_len: int,
    max_new_tokens: int,
    cpu_resident: int,
) -> None:
    """Before generating: weights, KV cache and activations of a full block fit.

    cpu_resident: host bytes already held (the process with its weight pool loaded)."""
    plan = plan_memory(cfg, policy, dtype, prompt_len, max_new_tokens)
    context = cuda_context_bytes(device)
    _check(
        "GPU",
        plan.gpu_bytes + context,
        caps.gpu_bytes,
        _gpu_available(device),
        f"prompt {prompt_len} + {max_new_tokens} new tokens, block of {policy.block_size}",
        "raise --gpu-mem, lower the batch or move KV/activations to cpu",
    )
    if caps.cpu_bytes is not None:
        extra = sum(plan.detail[k] for k in ("kv_cpu", "kv_staging_cpu", "act_cpu"))
        _check(
            "CPU",
            cpu_resident + extra,
            caps.cpu_bytes,
            psutil.virtual_memory().total,
            "pinned weights, KV cache, activations, this process",
            "raise --cpu-mem or move KV cache to disk (--nvme)",
        )
