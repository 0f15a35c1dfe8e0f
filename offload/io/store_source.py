"""A `WeightSource` that reads stages back from the NVMe weight store."""

from __future__ import annotations

import torch

from offload.core.config import ModelConfig
from offload.core.errors import UserError
from offload.io.layout import EMBED_TABLE, HEAD_TABLE, shares_table
from offload.io.pinned import PinnedPool
from offload.io.reader import ExtentReader
from offload.io.store_format import WeightStore
from offload.models.shapes import Weights
from offload.models.weights import WeightSource


class StoreSource(WeightSource):
    """Stage weights read through pinned staging blocks, checksums verified."""

    def __init__(
        self, config: ModelConfig, store: WeightStore, pool: PinnedPool, reader: ExtentReader
    ) -> None:
        if not store.whole:
            raise UserError(
                f"weight store {store.directory} holds only the parts of stages a policy puts "
                "on disk; offload-convert writes a whole one"
            )
        self.config = config
        self.store = store
        self.pool = pool
        self.reader = reader

    def stored_stage(
        self, stage: str, index: int, dtype: torch.dtype, device: torch.device
    ) -> Weights:
        key = f"layer.{index}" if stage == "layer" else stage
        weights = self._read(key)
        if stage == "embed" and shares_table(self.config):  # the store's one table is the head's
            weights[EMBED_TABLE] = self._read("head")[HEAD_TABLE]
        return {name: t.to(device=device, dtype=dtype) for name, t in weights.items()}

    def _read(self, key: str) -> dict[str, torch.Tensor]:
        extents = self.store.extents(key)
        blocks = [self.pool.alloc(e.padded) for e in extents]
        try:
            futures = [self.reader.submit(e, b) for e, b in zip(extents, blocks, strict=True)]
            loads = [f.result() for f in futures]
            return {load.extent.name: load.host_view().clone() for load in loads}
        finally:
            for block in blocks:
                block.free()
