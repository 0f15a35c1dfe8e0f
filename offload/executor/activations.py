"""Activations between stages: a micro-batch's hidden states, partly kept on the GPU and
partly parked in pinned host memory (`Policy.activations`) while the next stage's weights
stream in. A parked part leaves on the d2h lane after the stage that made it and comes
back on the compute stream right before the stage that reads it (it is on the critical
path, and the h2d lane may be busy with the next stage's weights)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload.executor.lanes import Lanes
from offload.io.pinned import PoolBlock


@dataclass
class StoredAct:
    """A micro-batch's hidden states between stages: rows [0, len(gpu)) on the GPU and,
    where the policy parks some, the rest in `host` once the d2h event `stored` is done."""

    gpu: torch.Tensor
    host: torch.Tensor | None = None
    stored: torch.cuda.Event | None = None


class ActivationHomes:
    """Where each micro-batch of the block in flight keeps its activations."""

    def __init__(self, lanes: Lanes, device: torch.device, dtype: torch.dtype) -> None:
        self.lanes, self.device, self.dtype = lanes, device, dtype
        self.gpu_rows: list[int] = []  # rows a micro-batch keeps on the GPU
        self.blocks: list[PoolBlock | None] = []  # its pinned block for the rest

    def start(self, gpu_rows: list[int], blocks: list[PoolBlock | None]) -> None:
        self.gpu_rows, self.blocks = gpu_rows, blocks

    def store(self, k: int, x: torch.Tensor) -> StoredAct:
        gpu_rows, block = self.gpu_rows[k], self.blocks[k]
        if block is None:
            return StoredAct(x)
        host = block.view(self.dtype, (x.shape[0] - gpu_rows, *x.shape[1:]))
        self.lanes.wait("d2h", self.lanes.record("compute"))
        with self.lanes.on("d2h", f"act mb{k}", host.numel() * host.element_size()):
            host.copy_(x[gpu_rows:], non_blocking=True)
        return StoredAct(x[:gpu_rows], host, self.lanes.record("d2h"))

    def load(self, k: int, act: StoredAct) -> torch.Tensor:
        if act.host is None:
            return act.gpu
        self.lanes.wait("compute", act.stored)
        with self.lanes.on("compute", f"act in mb{k}", act.host.numel() * act.host.element_size()):
            back = act.host.to(self.device, non_blocking=True)
        return torch.cat([act.gpu, back], dim=0) if act.gpu.shape[0] else back
