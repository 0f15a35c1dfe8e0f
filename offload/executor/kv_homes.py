"""Where a batch's KV cache lives: homes per (layer, micro-batch), scratches and staging.

For one layer and one micro-batch of B sequences, rows [0, g) keep their K/V on the
GPU, rows [g, g + c) in the pinned pool and the rest in a spill file on disk. GPU and
CPU homes are laid out [rows, kv_heads, slots, head_dim]; disk homes are token-major
[slots, rows, kv_heads, head_dim] so one decode step's new entries are one contiguous
range, written back as whole 4 KiB pages. A compressed cache
(`kernels.kv_cache.QuantKV`) has homes in all three tiers: QuantKVs on the GPU, in the
pinned pool, and slot-major in the spill file.

`KVHomes` owns every byte of this (sizes from `offload.io.layout.KVLayout`, which the
memory plan reads too) and the ledger entries for them; it moves nothing. Besides the
homes, `start` hands out
- two GPU scratches of the off-GPU rows (uncompressed, for decode attention on the GPU;
  or compressed, where those rows' entries are quantized), which blocks take in turn;
- `disk_buffers` pinned staging blocks, each the size of the largest disk home, where
  disk homes are read, attended, updated and written back from;
- two pinned store staging blocks, where new entries land from the GPU;
- the pinned blocks of CPU-resident activations, from the same per-batch pool.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from offload.core.config import ModelConfig
from offload.io.layout import KVLayout
from offload.io.pinned import PinnedPool, PoolBlock, align_up
from offload.io.spill import SpillFile
from offload.io.tiers import MemoryLedger, Tier
from offload.kernels.formats import Compression
from offload.kernels.kv_cache import QuantKV
from offload.models import attention


@dataclass
class KVBlock:
    """One layer's KV for one micro-batch, split by rows across tiers."""

    rows: tuple[int, int, int]  # (gpu, cpu, disk) row counts
    name: str = ""  # "L<layer> mb<micro-batch>", for traces
    slot: int = 0  # which of the GPU scratches it uses (`KVLayout.scratch_depth`)
    disk_slot: int = 0  # which of the disk staging blocks it is read and updated in
    gpu: attention.LayerKV | None = None  # the GPU rows' cache (compressed or not)
    cpu_blocks: list[PoolBlock] = field(default_factory=list)
    cpu_k: torch.Tensor | None = None
    cpu_v: torch.Tensor | None = None
    cpu_quant: QuantKV | None = None  # the CPU rows' home of a compressed cache
    # a compressed cache's disk rows: their slot-major home as read into the block's
    # disk staging block (`disk_slot`), where it is attended and updated
    disk_quant: QuantKV | None = None
    disk_offset: int = 0  # spill offset of the K region; V follows at + disk_region
    disk_region: int = 0
    stored: Future | None = None  # the last store of new entries into the off-GPU homes


class KVHomes:
    """The homes, scratches and staging of one batch's KV cache (`start` / `release`)."""

    def __init__(
        self,
        cfg: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        ledger: MemoryLedger,
        spill_dir: Path | str,
        attention_on_cpu: bool,
        compression: Compression | None,
        disk_buffers: int,
    ) -> None:
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.ledger, self.spill_dir = ledger, spill_dir
        self.attention_on_cpu, self.compression = attention_on_cpu, compression
        self.disk_buffers = disk_buffers
        self.elt = dtype.itemsize
        self.pool: PinnedPool | None = None  # sized per batch in start()
        self.spill: SpillFile | None = None
        self.max_slots = 0
        self.blocks: list[list[KVBlock]] = []  # [layer][micro-batch]
        self.scratch: list[tuple[torch.Tensor, torch.Tensor]] = []  # (k, v), two deep
        self.quant_scratch: list[QuantKV] = []  # two deep
        self.staging: list[PoolBlock] = []  # disk staging, `disk_buffers` deep
        self.store_staging: list[PoolBlock] = []  # two deep
        self._owned: list[PoolBlock] = []
        self._gpu_bytes = 0

    def start(
        self, row_splits: list[tuple[int, int, int]], max_slots: int, act_bytes: list[int]
    ) -> list[PoolBlock | None]:
        """Fresh homes for micro-batches with the given (gpu, cpu, disk) row counts, and
        the pinned blocks for CPU-resident activations (act_bytes per micro-batch).

        Frees the previous batch's first: the caller has drained the transfers that
        use them (`KVManager.start` does)."""
        self.release()
        self.max_slots = max_slots
        self.layout = kv = KVLayout(self.cfg, self.dtype, max_slots, self.compression)
        disk_homes = [kv.home_bytes(d) for _, _, d in row_splits]
        off_rows = max((c + d for _, c, d in row_splits), default=0)
        self._open_pool_and_spill(row_splits, disk_homes, off_rows, act_bytes)
        depth = kv.scratch_depth(len(row_splits), self.attention_on_cpu)
        self._open_blocks(row_splits, disk_homes, depth)
        if off_rows:  # device -> host staging of new entries, two deep
            self.store_staging = [
                self.pool.alloc(kv.store_staging_bytes(off_rows)) for _ in range(2)
            ]
        self._open_scratches(off_rows, depth)
        acts = [self.pool.alloc(b) if b else None for b in act_bytes]
        self._owned += [b for b in acts if b is not None]
        self.ledger.add(Tier.GPU, self._gpu_bytes)
        self._owned += self.store_staging
        self.ledger.add(Tier.CPU, sum(b.reserved for b in self._owned + self.staging))
        return acts

    def _open_pool_and_spill(
        self,
        row_splits: list[tuple[int, int, int]],
        disk_homes: list[int],
        off_rows: int,
        act_bytes: list[int],
    ) -> None:
        """The pinned pool, grown to the batch's CPU homes, disk staging, activations
        and store staging; the spill file of the disk homes; the disk staging blocks."""
        kv, cfg = self.layout, self.cfg
        need = sum(kv.home_bytes(c) for _, c, _ in row_splits) * cfg.num_layers
        need += self.disk_buffers * max(disk_homes, default=0)
        need += sum(align_up(b) for b in act_bytes)
        need += 2 * align_up(kv.store_staging_bytes(off_rows))
        if self.pool is None or self.pool.capacity < need:
            if self.pool is not None:
                self.pool.close()
            self.pool = PinnedPool(max(need, 4096))
        spill_bytes = cfg.num_layers * sum(disk_homes)
        if spill_bytes:
            self.spill = SpillFile(self.spill_dir, spill_bytes)
            self.ledger.add(Tier.DISK, spill_bytes)
        max_disk = max(disk_homes, default=0)
        if max_disk:  # where disk homes are read, updated and written back
            self.staging = [self.pool.alloc(max_disk) for _ in range(self.disk_buffers)]

    def _open_blocks(
        self, row_splits: list[tuple[int, int, int]], disk_homes: list[int], depth: int
    ) -> None:
        """Every (layer, micro-batch)'s `KVBlock`: its GPU cache, CPU home and place in
        the spill file. Blocks take turns at the GPU scratches in the order they are
        attended; the disk staging blocks go round the blocks with disk rows alone, so
        a layer's read never waits for the write-back of the layer before it."""
        offset = 0
        disk_turn = 0
        for layer in range(self.cfg.num_layers):
            row = []
            for mb, (rows, home) in enumerate(zip(row_splits, disk_homes, strict=True)):
                turn = layer * len(row_splits) + mb
                blk = KVBlock(
                    rows,
                    name=f"L{layer} mb{mb}",
                    slot=turn % depth,
                    disk_slot=disk_turn % self.disk_buffers,
                )
                disk_turn += 1 if rows[2] else 0
                self._open_block_homes(blk, offset)
                offset += home if rows[2] else 0
                row.append(blk)
            self.blocks.append(row)

    def _open_block_homes(self, blk: KVBlock, disk_offset: int) -> None:
        g, c, d = blk.rows
        cfg, kv = self.cfg, self.layout
        shape = (c, cfg.num_kv_heads, self.max_slots, cfg.head_dim)
        if g:
            blk.gpu = attention.LayerKV(
                g, cfg, self.max_slots, self.dtype, self.device, self.compression
            )
            self._gpu_bytes += blk.gpu.nbytes
        if c and self.compression is not None:
            blk.cpu_blocks = [self.pool.alloc(kv.home_bytes(c))]
            blk.cpu_quant = self._quant(c, torch.device("cpu"), blk.cpu_blocks[0].tensor)
            self._owned += blk.cpu_blocks
        elif c:
            blk.cpu_blocks = [self.pool.alloc(c * kv.row_bytes) for _ in range(2)]
            blk.cpu_k = blk.cpu_blocks[0].view(self.dtype, shape)
            blk.cpu_v = blk.cpu_blocks[1].view(self.dtype, shape)
            self._owned += blk.cpu_blocks
        if d:
            blk.disk_offset, blk.disk_region = disk_offset, align_up(d * kv.row_bytes)
        if d and self.compression is not None:  # its view of its staging block
            staging = self.staging[blk.disk_slot].tensor
            blk.disk_quant = self._quant(d, torch.device("cpu"), staging, slot_major=True)

    def _open_scratches(self, off_rows: int, depth: int) -> None:
        """The GPU ring of the off-GPU rows: compressed where those rows' entries are
        quantized (and attended at decode), else uncompressed for decode attention on
        the GPU (prefetched, `depth` deep)."""
        if not off_rows:
            return
        if self.compression is not None:
            self.quant_scratch = [self._quant(off_rows, self.device) for _ in range(depth)]
            self._gpu_bytes += depth * self.quant_scratch[0].nbytes
        elif not self.attention_on_cpu:
            cfg = self.cfg
            for _ in range(depth):
                k = torch.empty(
                    (off_rows, cfg.num_kv_heads, self.max_slots, cfg.head_dim),
                    dtype=self.dtype,
                    device=self.device,
                )
                self.scratch.append((k, torch.empty_like(k)))
            self._gpu_bytes += depth * 2 * off_rows * self.layout.row_bytes

    def _quant(self, rows: int, device: torch.device, buffer=None, slot_major=False) -> QuantKV:
        cfg = self.cfg
        return QuantKV(
            rows,
            cfg.num_kv_heads,
            cfg.head_dim,
            self.max_slots,
            self.compression,
            self.dtype,
            device,
            buffer,
            slot_major,
        )

    def release(self) -> None:
        """Free the batch's homes (the pool itself is kept for the next batch)."""
        for block in self._owned + self.staging:
            block.free()
        cpu = sum(b.reserved for b in self._owned + self.staging)
        if cpu:
            self.ledger.release(Tier.CPU, cpu)
        if self._gpu_bytes:
            self.ledger.release(Tier.GPU, self._gpu_bytes)
        if self.spill is not None:
            self.ledger.release(Tier.DISK, self.spill.capacity)
            self.spill.close()
        self.blocks, self._owned, self.staging, self.scratch = [], [], [], []
        self.quant_scratch = []
        self.store_staging = []
        self._gpu_bytes, self.spill = 0, None

    def close(self) -> None:
        self.release()
        if self.pool is not None:
            self.pool.close()

    # -- disk homes as held in a staging block ------------------------------------------
    def staging_of(self, blk: KVBlock) -> PoolBlock:
        """The disk staging block that `blk`'s disk home is read into and updated in."""
        return self.staging[blk.disk_slot]

    def disk_views(self, blk: KVBlock) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-major K and V views [slots, rows, heads, dim] of the block's staging."""
        cfg, d = self.cfg, blk.rows[2]
        shape = (self.max_slots, d, cfg.num_kv_heads, cfg.head_dim)
        count = self.max_slots * d * cfg.num_kv_heads * cfg.head_dim
        base = self.staging_of(blk).tensor
        k = base[: count * self.elt].view(self.dtype).view(shape)
        v = base[blk.disk_region : blk.disk_region + count * self.elt].view(self.dtype).view(shape)
        return k, v

    def disk_pieces(self, blk: KVBlock, start: int, end: int) -> list[torch.Tensor]:
        """Views, in the block's staging, of the disk home's bytes that hold (or, from
        start > 0, a write changes) token slots [start, end)."""
        if self.compression is None:
            dk, dv = self.disk_views(blk)
            return [dk[start:end], dv[start:end]]
        home = blk.disk_quant
        assert home is not None
        return [getattr(home, name)[:, :, part] for name, part in home.changed(start, end)]
