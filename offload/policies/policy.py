"""`Policy`: the single source of truth for where weights, KV cache and activations live.

It round-trips through JSON with exactly these fields, so people and tools can write
policies by hand:

    {"gpu_batch_size": 8, "num_gpu_batches": 4,
     "weights":     {"gpu": 0.2, "cpu": 0.8, "disk": 0.0},
     "kv_cache":    {"gpu": 0.0, "cpu": 1.0, "disk": 0.0},
     "activations": {"gpu": 1.0, "cpu": 0.0, "disk": 0.0},
     "attention_on_cpu": true, "overlap": true,
     "weight_compression": null, "kv_compression": null, "cpu_experts": 0.0}

Weight fractions are of each layer's bytes (exact, split inside tensors at 4 KiB
boundaries; a mixture of experts' layer is cut at whole experts among its experts);
KV and activation fractions are of the block's sequences. cpu_experts: the share of a
mixture of experts' chosen experts in pinned memory that a decode step computes on the
CPU beside their weights instead of copying them (those with the fewest rows first).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from offload.core.errors import UserError
from offload.kernels.formats import KV_GROUPS, Compression

TOLERANCE = 1e-6


@dataclass(frozen=True)
class Placement:
    """Fractions on the GPU, in CPU RAM and on disk; they sum to 1."""

    gpu: float = 1.0
    cpu: float = 0.0
    disk: float = 0.0

    def __post_init__(self) -> None:
        for name in ("gpu", "cpu", "disk"):
            value = getattr(self, name)
            if (
                not isinstance(value, (int, float))
                or not math.isfinite(value)
                or not 0 <= value <= 1
            ):
                raise ValueError(f"placement fraction {name}={value!r} must be in [0, 1]")
        total = self.gpu + self.cpu + self.disk
        if abs(total - 1.0) > TOLERANCE:
            raise ValueError(
                f"placement fractions gpu={self.gpu}, cpu={self.cpu}, disk={self.disk} sum to "
                f"{total:g}, not 1"
            )

    def split(self, count: int) -> tuple[int, int, int]:
        """Whole counts (gpu, cpu, disk) of `count` items, by cumulative rounding."""
        gpu = round(self.gpu * count)
        cpu = round((self.gpu + self.cpu) * count) - gpu
        return gpu, cpu, count - gpu - cpu


@dataclass(frozen=True)
class Policy:
    gpu_batch_size: int = 8
    num_gpu_batches: int = 1
    weights: Placement = field(default_factory=Placement)
    kv_cache: Placement = field(default_factory=Placement)
    activations: Placement = field(default_factory=Placement)
    attention_on_cpu: bool = False
    overlap: bool = True
    weight_compression: Compression | None = None
    kv_compression: Compression | None = None
    cpu_experts: float = 0.0

    def __post_init__(self) -> None:
        for name in ("gpu_batch_size", "num_gpu_batches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not (isinstance(self.cpu_experts, (int, float)) and 0 <= self.cpu_experts <= 1):
            raise ValueError(f"cpu_experts={self.cpu_experts!r} must be a share in [0, 1]")
        if self.activations.disk > 0:
            raise ValueError("activations on disk are not supported; put them on the gpu or cpu")
        kv = self.kv_compression
        if kv is not None and (kv.zero_point or kv.fp8 or not kv.head):
            raise ValueError("kv_compression takes bits, group_size and symmetric only")
        if kv is not None and kv.group_size not in KV_GROUPS:
            raise ValueError(
                f"kv_compression group_size is tokens a key group: one of "
                f"{', '.join(map(str, KV_GROUPS))}, got {kv.group_size}"
            )

    @property
    def block_size(self) -> int:
        """Sequences generated together: num_gpu_batches x gpu_batch_size."""
        return self.gpu_batch_size * self.num_gpu_batches

    @property
    def decode_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs (on CUDA): every weight and activation
        on the GPU, so the work between attentions is the same every step
        (`executor.graphs`; the memory plan counts their buffers)."""
        return self.weights.gpu == 1.0 and self.activations.gpu == 1.0

    # -- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Policy:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown policy field(s): {', '.join(sorted(unknown))}")
        kwargs = dict(data)
        for name in ("weights", "kv_cache", "activations"):
            if name in kwargs:
                value = kwargs[name]
                if not isinstance(value, dict) or set(value) - {"gpu", "cpu", "disk"}:
                    raise ValueError(f"policy field {name} must be an object with gpu, cpu, disk")
                kwargs[name] = Placement(**value)
        for name in ("weight_compression", "kv_compression"):
            if kwargs.get(name) is not None:
                kwargs[name] = Compression(**kwargs[name])
        return cls(**kwargs)

    @classmethod
    def from_file(cls, path: Path) -> Policy:
        """A policy's JSON, or `offload-plan --json`'s output (its "policy")."""
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"policy file {path} does not exist") from None
        except json.JSONDecodeError as exc:
            raise UserError(f"policy file {path} is not valid JSON ({exc})") from None
        if isinstance(data, dict) and isinstance(data.get("policy"), dict):
            data = data["policy"]  # a plan, as offload-plan --json prints it
        try:
            return cls.from_dict(data)
        except (ValueError, TypeError) as exc:
            raise UserError(f"policy file {path}: {exc}") from None
