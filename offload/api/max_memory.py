"""`LLM(...)`'s memory caps as accelerate names them: `max_memory` ({0 or "cuda:0":
"24GB", "cpu": "100GB"}), or the `EngineArgs` fields `gpu_mem` and `cpu_mem`, given one
way or the other."""

from __future__ import annotations

from typing import Any

import torch

from offload.api.args import parse_size
from offload.core.errors import UserError


def caps_from_args(
    max_memory: dict[Any, Any] | None, engine_args: dict[str, Any], device
) -> tuple[str | None, str | None]:
    """(gpu_mem, cpu_mem) from accelerate's `max_memory` or the `EngineArgs` fields of
    the same names (popped from engine_args), given one way or the other."""
    caps = caps_from_max_memory(max_memory, device)
    out = []
    for name, from_max_memory in zip(("gpu_mem", "cpu_mem"), caps, strict=True):
        value = engine_args.pop(name, None)
        if value is not None and from_max_memory is not None:
            raise UserError(f"{name} and max_memory both cap that memory; give one")
        out.append(from_max_memory if value is None else value)
    return out[0], out[1]


def caps_from_max_memory(
    max_memory: dict[Any, Any] | None, device: torch.device
) -> tuple[str | None, str | None]:
    """accelerate's `max_memory` ({0 or "cuda:0": "24GB", "cpu": "100GB"}) as
    (gpu_mem, cpu_mem); an entry that cannot take effect is an error."""
    if not max_memory:
        return None, None
    gpu, cpu = None, None
    for key, value in max_memory.items():
        name = f"cuda:{key}" if isinstance(key, int) else str(key)
        size = str(value) if not isinstance(value, int) else f"{value}B"
        if name == "cpu":
            cpu = size
        elif name == "cuda" or name.startswith("cuda:"):
            index = int(name.split(":")[1]) if ":" in name else 0
            wanted = device.index or 0
            if gpu is not None or (device.type == "cuda" and index != wanted):
                raise UserError(
                    f"max_memory names {name}, but offload runs on one device ({device}); give "
                    f"one GPU entry, for the device it runs on"
                )
            gpu = size
        elif name == "disk":
            raise UserError(
                'max_memory["disk"] cannot be honoured: disk use is not capped; pass '
                "offload_folder=DIR for the weight store and drop the disk entry"
            )
        else:
            raise UserError(f"max_memory key {key!r} is not a device; use 0 / 'cuda:0' and 'cpu'")
        parse_size(size, f"max_memory[{key!r}]")
    return gpu, cpu
