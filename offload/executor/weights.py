"""Weight homes and the weight fetcher.

Each stage (the embedding, every layer, the head) is one byte image of its tensors,
each 4 KiB aligned, in the weight store's layout. A policy's weight fractions cut that
image at two 4 KiB boundaries: bytes [0, gpu_end) live on the GPU, [gpu_end, cpu_end)
in the pinned pool, [cpu_end, size) in the store file on disk (which holds the image
from its tail_start <= cpu_end on: `io.store`). The cut falls inside
tensors, so "20% on the GPU" means 20% of every layer's bytes (FlexGen rounds whole
tensors to one tier). Before a stage computes, its image is assembled in one of two
GPU ring slots (GPU part by a device copy, CPU part by host -> GPU, disk part by
disk -> pinned staging -> GPU) while the previous stage computes; a stage held
entirely on the GPU is used in place.

A mixture of experts' layer is fetched this way only up to its experts (its dense part:
`StageImage.fetch_end`); its experts have homes of their own (`experts.ExpertHomes`)
and are fetched one by one once the layer has routed (`experts.ExpertFetcher`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from offload.core.errors import UserError
from offload.core.progress import tracked
from offload.executor.experts import ExpertHomes
from offload.executor.lanes import Lanes
from offload.io.layout import (
    EMBED_TABLE,
    HEAD_TABLE,
    ExpertSpan,
    TensorSlot,
    expert_span,
    gathered,
    gathered_gpu_bytes,
    image_bytes,
    shares_table,
    stage_cuts,
    stage_keys,
    stage_layout,
    stage_pieces,
)
from offload.io.pinned import PinnedPool, PoolBlock, align_up
from offload.io.reader import ExtentReader
from offload.io.store_format import Extent, WeightStore
from offload.io.tiers import MemoryLedger, Tier
from offload.kernels.formats import Compression
from offload.kernels.quant import assemble_stage, compress_stage
from offload.models.shapes import Weights, stage_shapes
from offload.models.weights import WeightSource
from offload.policies.policy import Placement

log = logging.getLogger(__name__)


@dataclass
class StageImage:
    key: str
    layout: tuple[TensorSlot, ...]
    size: int
    gpu_end: int
    cpu_end: int
    shapes: dict[str, tuple[int, ...]]  # the stage's canonical tensors
    dtype: torch.dtype
    compression: Compression | None
    gpu_home: torch.Tensor | None = None  # uint8 [gpu_end] on the compute device
    cpu_home: PoolBlock | None = None  # [cpu_end - gpu_end] pinned
    disk_extents: tuple[Extent, ...] = ()  # cover [cpu_end, fetch_end), offsets in the store file
    tail_start: int = 0  # where the store file begins in the image
    # a GPU-resident stage's views, built once (50 tensors' views cost 0.15 ms of host
    # time a stage, 7 ms a decode step of OPT-30B; scripts/profile_step.py shows it)
    resident_views: Weights | None = None
    # the embedding's stage when not every weight is on the GPU (`io.layout.gathered`):
    # whole in pinned memory, its table read there a few rows a step
    gathered: bool = False
    span: ExpertSpan | None = None  # a mixture of experts' layer: where its experts lie
    experts: ExpertHomes | None = None

    @property
    def fetch_end(self) -> int:
        """Where the part fetched as a whole ends: the image, or a mixture of experts'
        dense part (its experts are fetched one by one)."""
        return self.size if self.span is None else self.span.dense_end

    @property
    def resident(self) -> bool:
        """Used in place: held whole on the GPU (up to `fetch_end`), or gathered from."""
        return self.gpu_end >= self.fetch_end or self.gathered

    def staging_offset(self, extent: Extent) -> int:
        """Where a disk extent lands in the staging block that holds [cpu_end, size)."""
        return extent.offset + self.tail_start - self.cpu_end

    def views(self, image: torch.Tensor) -> Weights:
        """The stage's tensors up to `fetch_end` over its image's bytes."""
        stored = {
            t.name: image[t.offset : t.offset + t.nbytes].view(t.dtype).view(t.shape)
            for t in self.layout
            if t.offset < self.fetch_end
        }
        return assemble_stage(stored, self.shapes, self.dtype, self.compression)


def _disk_extents(
    image: StageImage, store: WeightStore, host: torch.Tensor, span: tuple[int, int] | None = None
) -> tuple[Extent, ...]:
    """Extents over [cpu_end, fetch_end) (or the image bytes `span`) at their offsets in
    the store file (image offset - tail_start): whole tensors keep the store's
    checksum; the piece of the tensor the cut falls in gets a checksum computed now from
    the verified bytes."""
    path: Path = store.path(image.key)
    assert image.tail_start <= image.cpu_end, "the store lacks part of what is read from disk"
    low, high = span or (image.cpu_end, image.fetch_end)
    out = []
    for t in image.layout:
        start, end = max(t.offset, low), min(t.offset + t.nbytes, high)
        if start >= end:
            continue
        whole = start == t.offset and end == t.offset + t.nbytes
        xxh = (
            store.checksum(image.key, t.name)
            if whole
            else xxhash.xxh3_64_hexdigest(memoryview(host[start:end].numpy()))
        )
        at = start - image.tail_start
        out.append(
            Extent(image.key, t.name, path, at, end - start, (end - start,), torch.uint8, xxh)
        )
    return tuple(out)


def _expert_homes(image: StageImage, store: WeightStore | None, host: torch.Tensor) -> ExpertHomes:
    """A mixture of experts' layer's expert homes over its placed image: its disk
    slots' extents (each expert whole: the cut falls on an expert's edge)."""
    span = image.span
    assert span is not None
    disk = {}
    for slot in range(span.slots_below(image.cpu_end), span.count):
        assert store is not None
        start = span.offset(slot)
        extents = _disk_extents(image, store, host, (start, start + span.expert_bytes))
        disk[slot] = tuple((e, e.offset + image.tail_start - start) for e in extents)
    return ExpertHomes(
        image.key, span, image.layout, image.shapes, image.dtype, image.compression,
        (image.gpu_end, image.cpu_end), (image.gpu_home, image.cpu_home), disk,
    )  # fmt: skip


class WeightHomes:
    """Places every stage's image across the tiers, reading each stage once at set-up."""

    def __init__(
        self,
        source: WeightSource,
        placement: Placement,
        dtype: torch.dtype,
        device: torch.device,
        pool: PinnedPool,
        ledger: MemoryLedger,
        store: WeightStore | None,
        compression: Compression | None = None,
        progress: bool = False,
        fill_cpu: bool = True,
    ) -> None:
        """fill_cpu: False where another process writes the pool's pages (one pinned copy
        shared by a node's processes, `placing.SharedWeights`): a stage held wholly in
        CPU memory is then not made at all, and no stage's CPU part is written here."""
        cfg = source.config
        if placement.disk > 0 and store is None:
            raise UserError("the policy puts weights on disk; give --nvme DIR for the weight store")
        self.images: list[StageImage] = []
        cuts = stage_cuts(cfg, dtype, compression, placement)
        # every stage's GPU home in one allocation, made before the stages are drawn or
        # read: the caching allocator has no home to scatter among the load's transient
        # blocks, so the transients' segments go back whole once the load ends
        self.gpu_arena = torch.empty(
            sum(align_up(gpu_end) for gpu_end, _ in cuts), dtype=torch.uint8, device=device
        )
        arena_at = 0
        stages = zip(stage_keys(cfg), cuts, strict=True)
        if progress:
            stages = tracked(stages, len(cuts), "placing weights", "stage")
        for key, (gpu_end, cpu_end) in stages:
            layout = (
                store.layout(key)
                if store is not None
                else stage_layout(cfg, key, dtype, compression)
            )
            size = image_bytes(layout)
            stage, _, index = key.partition(".")
            shapes = stage_shapes(cfg, stage, int(index or 0))
            image = StageImage(key, layout, size, gpu_end, cpu_end, shapes, dtype, compression)
            image.span = expert_span(cfg, key, dtype, compression)
            image.gathered = gathered(key, placement)
            image.tail_start = store.tail_start(key) if store is not None else 0
            write = fill_cpu or image.gathered  # (its views are taken now: identical bytes)
            make = write or gpu_end > 0 or size > cpu_end
            host = self._host_image(source, image, dtype, device) if make else None
            if gpu_end:
                image.gpu_home = self.gpu_arena[arena_at : arena_at + gpu_end]
                image.gpu_home.copy_(host[:gpu_end])
                arena_at += align_up(gpu_end)
                ledger.add(Tier.GPU, gpu_end)
            if cpu_end > gpu_end:
                image.cpu_home = pool.alloc(cpu_end - gpu_end)
                if write:
                    image.cpu_home.tensor.copy_(host[gpu_end:cpu_end])
                ledger.add(Tier.CPU, image.cpu_home.reserved)
            if size > cpu_end:
                assert store is not None
                image.disk_extents = _disk_extents(image, store, host)
                ledger.add(Tier.DISK, size - cpu_end)
            if image.span is not None:
                image.experts = _expert_homes(image, store, host)
            if image.gathered:  # the table stays in pinned memory, the rest goes up
                views = image.views(image.cpu_home.tensor[:size]) if size else {}
                image.resident_views = {
                    name: t if name == EMBED_TABLE else t.to(device) for name, t in views.items()
                }
                ledger.add(Tier.GPU, gathered_gpu_bytes(cfg, dtype))
            self.images.append(image)
            del host
        if shares_table(cfg):
            self._share_table()

    def _share_table(self) -> None:
        """A tied model's embedding reads its rows from the head's table, in the one home
        that holds the head whole (`io.layout.whole_in_cpu`): pinned CPU memory, or the
        GPU when every weight is there."""
        embed, head = self.images[0], self.images[-1]
        if head.gpu_end == head.size:
            image = head.gpu_home
        else:
            assert head.gpu_end == 0 and head.cpu_end == head.size, "the head is in one home"
            image = head.cpu_home.tensor[: head.size]
        table = head.views(image)[HEAD_TABLE]
        if embed.resident_views is None:
            embed.resident_views = embed.views(embed.gpu_home) if embed.size else {}
        embed.resident_views[EMBED_TABLE] = table

    @staticmethod
    def _host_image(
        source: WeightSource, image: StageImage, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        stage, _, index = image.key.partition(".")
        # dummy weights are made on the compute device (a GPU draws them far faster)
        make_on = device if source.draws_on_device else torch.device("cpu")
        host = torch.zeros(image.size, dtype=torch.uint8)
        # the whole stage at once, or where the source can, in pieces (`stage_pieces`)
        pieces = stage_pieces(source.config, image.key) if source.makes_tensors_alone else None
        for names in pieces or [None]:
            if names is None:
                made = source.stage(stage, int(index or 0), dtype, make_on)
            else:
                made = source.stored_named(stage, int(index or 0), names, dtype, make_on)
            weights = compress_stage(made, image.compression)
            del made
            for t in image.layout:
                if t.name in weights:
                    host[t.offset : t.offset + t.nbytes] = (
                        weights[t.name].contiguous().view(-1).view(torch.uint8)
                    )
        return host

    @property
    def slot_bytes(self) -> int:
        """Ring slot size: the largest stage not held entirely on the GPU (0 if none);
        of a mixture of experts' layer, its dense part."""
        return max((i.fetch_end for i in self.images if not i.resident), default=0)

    @property
    def staging_bytes(self) -> int:
        return max((max(0, i.fetch_end - i.cpu_end) for i in self.images), default=0)


class WeightFetcher:
    """Assembles stage images in two GPU ring slots, one stage ahead of compute.

    fetch(i) issues the copies of stage i into its slot (after the compute that last
    used that slot) and the disk reads of stage i + 1 into pinned staging; get(i)
    makes compute wait for stage i; done(i) marks stage i's compute as issued.
    """

    def __init__(
        self,
        homes: WeightHomes,
        lanes: Lanes,
        device: torch.device,
        pool: PinnedPool,
        reader: ExtentReader,
        ledger: MemoryLedger,
    ) -> None:
        self.homes, self.lanes, self.reader = homes, lanes, reader
        self.slots = (
            [torch.empty(homes.slot_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
            if homes.slot_bytes
            else []
        )
        ledger.add(Tier.GPU, 2 * homes.slot_bytes)
        self.staging = (
            [pool.alloc(homes.staging_bytes) for _ in range(2)] if homes.staging_bytes else []
        )
        self._slot_free: list[torch.cuda.Event | None] = [None, None]
        self._staging_free: list[torch.cuda.Event | None] = [None, None]
        self._loaded: dict[int, torch.cuda.Event | None] = {}
        self._disk: dict[int, list] = {}

    def close(self) -> None:
        for block in self.staging:
            block.free()
        self.staging = []

    def _start_disk(self, index: int) -> None:
        if index >= len(self.homes.images) or index in self._disk:
            return
        image = self.homes.images[index]
        if not image.disk_extents:
            self._disk[index] = []
            return
        which = index % 2
        self.lanes.host_wait(self._staging_free[which])  # its previous H2D has finished
        block = self.staging[which]
        futures = []
        submitted = time.perf_counter()
        for extent in image.disk_extents:
            future = self.reader.submit(extent, block, block_offset=image.staging_offset(extent))
            future.add_done_callback(lambda f, t0=submitted, e=extent: self._disk_done(e, t0))
            futures.append(future)
        self._disk[index] = futures

    def _disk_done(self, extent, submitted: float) -> None:
        self.lanes.tracer.host_span(
            "disk",
            f"read {extent.stage}/{extent.name}",
            submitted,
            time.perf_counter(),
            extent.nbytes,
        )

    def fetch(self, index: int) -> None:
        """Issue stage `index`'s assembly (and the next stage's disk reads)."""
        if index >= len(self.homes.images) or index in self._loaded:
            return
        self._start_disk(index)
        image = self.homes.images[index]
        if image.resident:
            self._loaded[index] = None
            self._start_disk(index + 1)
            return
        which = index % 2
        slot = self.slots[which]
        self.lanes.wait("h2d", self._slot_free[which])
        end = image.fetch_end  # (a mixture of experts': its dense part)
        moved = end - image.gpu_end
        with self.lanes.on("h2d", f"weights {image.key}", moved):
            if image.gpu_end:
                slot[: image.gpu_end].copy_(image.gpu_home, non_blocking=True)
            if image.cpu_home is not None:
                cpu_end = min(image.cpu_end, end)
                part = image.cpu_home.tensor[: cpu_end - image.gpu_end]
                slot[image.gpu_end : cpu_end].copy_(part, non_blocking=True)
            if image.disk_extents:
                started = time.perf_counter()
                for future in self._disk.pop(index):
                    future.result()
                self.lanes.tracer.host_span(
                    "disk", f"wait {image.key}", started, time.perf_counter()
                )
                staged = self.staging[which].tensor[: end - image.cpu_end]
                slot[image.cpu_end : end].copy_(staged, non_blocking=True)
        self._loaded[index] = self.lanes.record("h2d")
        if image.disk_extents:
            self._staging_free[which] = self._loaded[index]
        self._start_disk(index + 1)

    def get(self, index: int) -> Weights:
        """Stage weights for compute; compute waits (on the GPU) for their copies."""
        self.fetch(index)
        image = self.homes.images[index]
        self.lanes.wait("compute", self._loaded.pop(index))
        if image.resident:
            if image.resident_views is None:
                image.resident_views = image.views(image.gpu_home)
            return image.resident_views
        return image.views(self.slots[index % 2])

    def done(self, index: int) -> None:
        """Compute of stage `index` is issued: its slot may be refilled after it."""
        if not self.homes.images[index].resident:
            self._slot_free[index % 2] = self.lanes.record("compute")
