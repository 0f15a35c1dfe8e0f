"""KV cache homes split across GPU, pinned CPU memory and disk, and attention over them.

For one layer and one micro-batch of B sequences, rows [0, g) keep their K/V on the
GPU, rows [g, g + c) in the pinned pool and the rest in a spill file on disk. GPU and
CPU homes are laid out [rows, kv_heads, slots, head_dim]; disk homes are token-major
[slots, rows, kv_heads, head_dim] so one decode step's new entries are one contiguous
range, written back as whole 4 KiB pages.

Attention for rows off the GPU runs
- at prefill, on the GPU over the fresh K/V (no cache to read), which are then stored;
- at decode with attention_on_cpu, on the CPU next to the cache: only q, the new K/V
  and the attention output cross PCIe;
- at decode otherwise, on the GPU over the cache loaded into a scratch buffer, which is
  prefetched while the previous micro-batch computes; only the new K/V go back.

A compressed cache (policy.kv_compression, `kernels.kv_cache.QuantKV`) has homes in all
three tiers: its CPU homes are QuantKVs in the pinned pool, its disk homes slot-major
QuantKVs in the spill file (the slots a step reads, or a write changes, are a few
contiguous ranges a tensor: a decode step writes back its entry's pages in the tails,
and a group's codes once a group). Compressed bytes are what crosses PCIe and the disk:
the entries of off-GPU rows are quantized on the GPU in a compressed scratch (at
prefill, and at decode with attention on the GPU, where the scratch first receives the
CPU home whole and the disk home's held slots) and `QuantKV.pack` sends back only what
the write changed. With attention on the CPU a decode step's entries are quantized and
attended next to the home (the torch path, bit-exact with the kernels).
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from offload.config import ModelConfig
from offload.executor.lanes import Lanes
from offload.io.layout import DISK_BUFFERS, KVLayout
from offload.io.pinned import ALIGN, PinnedPool, PoolBlock, align_up
from offload.io.spill import SpillFile
from offload.io.tiers import MemoryLedger, Tier
from offload.kernels.formats import Compression
from offload.kernels.kv_cache import QuantKV
from offload.models import decoder


def _wait_future(future: Future | None) -> None:
    if future is not None:
        future.result()


def _wait_all(*futures: Future | None) -> None:
    for future in futures:
        _wait_future(future)


def _after(previous: Future | None, copied, work) -> None:
    """Worker thread: once `previous` is done and the `copied` event has passed, work()."""
    _wait_future(previous)
    if copied is not None:
        copied.synchronize()
    work()


def _page_spans(base: torch.Tensor, pieces: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Byte ranges [lo, hi) of `base`, 4 KiB aligned and merged, that cover the views
    `pieces` of its memory."""
    spans = []
    for piece in pieces:
        if piece.numel():
            lo = piece.data_ptr() - base.data_ptr()
            extent = sum(
                (n - 1) * step for n, step in zip(piece.shape, piece.stride(), strict=True)
            )
            hi = lo + (extent + 1) * piece.element_size()
            spans.append((lo // ALIGN * ALIGN, align_up(hi)))
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


@dataclass
class KVBlock:
    """One layer's KV for one micro-batch, split by rows across tiers."""

    rows: tuple[int, int, int]  # (gpu, cpu, disk) row counts
    slot: int = 0  # which of the two GPU scratch buffers it uses
    disk_slot: int = 0  # which of the disk staging blocks it is read and updated in
    gpu: decoder.LayerKV | None = None  # the GPU rows' cache (compressed or not)
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


class KVManager:
    """Allocates KV homes for a batch and runs each micro-batch's attention over them."""

    def __init__(
        self,
        cfg: ModelConfig,
        lanes: Lanes,
        device: torch.device,
        dtype: torch.dtype,
        ledger: MemoryLedger,
        spill_dir,
        attention_on_cpu: bool,
        overlap: bool,
        compression: Compression | None = None,
        disk_buffers: int = DISK_BUFFERS,
    ) -> None:
        """compression: the cache format of every home (policy.kv_compression)."""
        self.cfg, self.lanes, self.device, self.dtype = cfg, lanes, device, dtype
        self.compression, self.disk_buffers = compression, disk_buffers
        self.pool: PinnedPool | None = None  # sized per batch in start()
        self.ledger, self.spill_dir = ledger, spill_dir
        self.attention_on_cpu, self.overlap = attention_on_cpu, overlap
        self.elt = torch.empty((), dtype=dtype).element_size()
        self.blocks: list[list[KVBlock]] = []
        self.spill: SpillFile | None = None
        self._io = ThreadPoolExecutor(max_workers=8, thread_name_prefix="offload-kv")
        self._owned: list[PoolBlock] = []
        self._gpu_bytes = 0
        self._scratch: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._quant_scratch: list[QuantKV] = []
        self._scratch_free: list[torch.cuda.Event | None] = [None, None]
        self._staging: list[PoolBlock] = []
        self._pending: dict[tuple[int, int], tuple] = {}  # (layer, mb): (tokens, disk read)
        self._store_staging: list[PoolBlock] = []
        self._store_busy: list[Future | None] = [None, None]
        # disk staging block p: the last task that uses it, and the last H2D reading it
        self._disk_busy: list[Future | None] = [None] * disk_buffers
        self._disk_h2d: list[torch.cuda.Event | None] = [None] * disk_buffers
        self._store_turn = 0

    # -- allocation ---------------------------------------------------------------------
    def start(
        self, row_splits: list[tuple[int, int, int]], max_slots: int, act_bytes: list[int]
    ) -> list[PoolBlock | None]:
        """Fresh homes for micro-batches with the given (gpu, cpu, disk) row counts.

        Also hands out the pinned blocks for CPU-resident activations (act_bytes per
        micro-batch), from the same per-batch pool."""
        self.release()
        cfg = self.cfg
        self.max_slots = max_slots
        self.layout = kv = KVLayout(cfg, self.dtype, max_slots, self.compression)
        self.per_row = per_row = kv.row_bytes
        disk_homes = [kv.home_bytes(d) for _, _, d in row_splits]
        need = sum(kv.home_bytes(c) for _, c, _ in row_splits) * cfg.num_layers
        off_rows = max((c + d for _, c, d in row_splits), default=0)
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
            self._staging = [self.pool.alloc(max_disk) for _ in range(self.disk_buffers)]
        offset = 0
        for layer in range(cfg.num_layers):
            row = []
            for mb, ((g, c, d), home) in enumerate(zip(row_splits, disk_homes, strict=True)):
                # blocks take turns at the buffers in the order they are attended
                turn = layer * len(row_splits) + mb
                blk = KVBlock((g, c, d), slot=turn % 2, disk_slot=turn % self.disk_buffers)
                shape = lambda n: (n, cfg.num_kv_heads, max_slots, cfg.head_dim)  # noqa: E731
                if g:
                    blk.gpu = decoder.LayerKV(
                        g, cfg, max_slots, self.dtype, self.device, self.compression
                    )
                    self._gpu_bytes += blk.gpu.nbytes
                if c and self.compression is not None:
                    blk.cpu_blocks = [self.pool.alloc(kv.home_bytes(c))]
                    blk.cpu_quant = self._quant(c, torch.device("cpu"), blk.cpu_blocks[0].tensor)
                    self._owned += blk.cpu_blocks
                elif c:
                    blk.cpu_blocks = [self.pool.alloc(c * per_row) for _ in range(2)]
                    blk.cpu_k = blk.cpu_blocks[0].view(self.dtype, shape(c))
                    blk.cpu_v = blk.cpu_blocks[1].view(self.dtype, shape(c))
                    self._owned += blk.cpu_blocks
                if d:
                    blk.disk_offset, blk.disk_region = offset, align_up(d * per_row)
                    offset += home
                if d and self.compression is not None:  # its view of its staging block
                    staging = self._staging[blk.disk_slot].tensor
                    blk.disk_quant = self._quant(d, torch.device("cpu"), staging, slot_major=True)
                row.append(blk)
            self.blocks.append(row)
        if off_rows:  # device -> host staging of new entries, two deep
            self._store_staging = [
                self.pool.alloc(kv.store_staging_bytes(off_rows)) for _ in range(2)
            ]
        if off_rows and self.compression is not None:
            # where off-GPU rows are quantized (and attended at decode), two deep
            self._quant_scratch = [self._quant(off_rows, self.device) for _ in range(2)]
            self._gpu_bytes += 2 * self._quant_scratch[0].nbytes
        # decode scratch for rows whose cache is off the GPU, two deep (prefetch)
        elif off_rows and not self.attention_on_cpu:
            for _ in range(2):
                k = torch.empty(
                    (off_rows, cfg.num_kv_heads, max_slots, cfg.head_dim),
                    dtype=self.dtype,
                    device=self.device,
                )
                self._scratch.append((k, torch.empty_like(k)))
            self._gpu_bytes += 4 * off_rows * per_row
        acts = [self.pool.alloc(b) if b else None for b in act_bytes]
        self._owned += [b for b in acts if b is not None]
        self.ledger.add(Tier.GPU, self._gpu_bytes)
        self._owned += self._store_staging
        self.ledger.add(Tier.CPU, sum(b.reserved for b in self._owned + self._staging))
        return acts

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
        _wait_all(*self._store_busy, *self._disk_busy)
        self._store_busy = [None, None]
        self._disk_busy = [None] * self.disk_buffers
        self._disk_h2d = [None] * self.disk_buffers
        for block in self._owned + self._staging:
            block.free()
        cpu = sum(b.reserved for b in self._owned + self._staging)
        if cpu:
            self.ledger.release(Tier.CPU, cpu)
        if self._gpu_bytes:
            self.ledger.release(Tier.GPU, self._gpu_bytes)
        if self.spill is not None:
            self.ledger.release(Tier.DISK, self.spill.capacity)
            self.spill.close()
        self.blocks, self._owned, self._staging, self._scratch = [], [], [], []
        self._quant_scratch = []
        self._store_staging = []
        self._gpu_bytes, self.spill, self._pending = 0, None, {}

    def close(self) -> None:
        self.release()
        self._io.shutdown(wait=True)
        if self.pool is not None:
            self.pool.close()

    # -- disk rows -------------------------------------------------------------------
    def _disk_views(self, blk: KVBlock, staging: PoolBlock) -> tuple[torch.Tensor, torch.Tensor]:
        """Token-major K and V views [slots, rows, heads, dim] of a staging block."""
        cfg, d = self.cfg, blk.rows[2]
        shape = (self.max_slots, d, cfg.num_kv_heads, cfg.head_dim)
        count = self.max_slots * d * cfg.num_kv_heads * cfg.head_dim
        base = staging.tensor
        k = base[: count * self.elt].view(self.dtype).view(shape)
        v = base[blk.disk_region : blk.disk_region + count * self.elt].view(self.dtype).view(shape)
        return k, v

    def _disk_pieces(self, blk: KVBlock, staging: PoolBlock, start: int, end: int) -> list:
        """Views, in a staging block, of the disk home's bytes that hold (or, from
        start > 0, a write changes) token slots [start, end)."""
        if self.compression is None:
            dk, dv = self._disk_views(blk, staging)
            return [dk[start:end], dv[start:end]]
        home = blk.disk_quant
        assert home is not None
        return [getattr(home, name)[:, :, part] for name, part in home.changed(start, end)]

    def _disk_io(self, blk, staging: PoolBlock, start: int, end: int, write: bool) -> None:
        """Read (or write back) the whole pages of the disk home that hold slots
        [start, end): a few contiguous ranges, as both layouts are token-major."""
        assert self.spill is not None
        started = time.perf_counter()
        spans = _page_spans(staging.tensor, self._disk_pieces(blk, staging, start, end))
        pieces = [(blk.disk_offset + lo, staging.tensor[lo:hi]) for lo, hi in spans]
        self.spill.transfer(pieces, write)
        moved = sum(hi - lo for lo, hi in spans)
        name = "kv write" if write else "kv read"
        self.lanes.tracer.host_span("disk", name, started, time.perf_counter(), moved)

    def _read_disk(self, blk: KVBlock, staging: PoolBlock, num_tokens: int) -> None:
        """Read what holds the first num_tokens token slots into staging."""
        self._disk_io(blk, staging, 0, num_tokens, write=False)

    def _read_disk_after(self, blk: KVBlock, which: int, num_tokens: int, busy, h2d) -> None:
        """Worker thread: once staging `which` is free, read this block's disk pages."""
        _wait_future(busy)
        if h2d is not None:
            h2d.synchronize()
        self._read_disk(blk, self._staging[which], num_tokens)

    def _write_disk(self, blk: KVBlock, staging: PoolBlock, start: int, end: int) -> None:
        """Write back the whole pages that a write of token slots [start, end) changed."""
        self._disk_io(blk, staging, start, end, write=True)

    # -- decode prefetch (attention on the GPU over an off-GPU cache) ----------------------
    def prefetch(self, layer: int, mb: int, num_tokens: int) -> None:
        """Start loading the off-GPU cache of (layer, mb) for its decode attention."""
        if self.attention_on_cpu or (layer, mb) in self._pending or num_tokens == 0:
            return
        blk = self.blocks[layer][mb]
        _, c, d = blk.rows
        # a compressed CPU home crosses at attention (as _load_scratch); its disk rows
        # are read ahead here all the same
        if not (d if self.compression is not None else c + d):
            return
        which = blk.disk_slot
        disk_future: Future | None = None
        if d:
            disk_future = self._io.submit(
                self._read_disk_after,
                blk,
                which,
                num_tokens,
                self._disk_busy[which],
                self._disk_h2d[which],
            )
            self._disk_busy[which] = disk_future
        self._pending[layer, mb] = (num_tokens, disk_future)

    def prefetch_after(self, layer: int, mb: int, num_tokens: int) -> None:
        """After the attention of (layer, mb) was issued: start loading the next blocks
        in attention order, one per disk staging block. The last of them uses this
        block's staging, so its disk read starts once this block's store is written."""
        count = len(self.blocks[0]) if self.blocks else 0
        for ahead in range(1, self.disk_buffers + 1):
            nxt = layer * count + mb + ahead
            if nxt < len(self.blocks) * count:
                self.prefetch(nxt // count, nxt % count, num_tokens)

    def _load_scratch(self, layer: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens, disk_future = self._pending.pop((layer, mb))
        blk = self.blocks[layer][mb]
        _, c, d = blk.rows
        which = blk.slot
        sk, sv = self._scratch[which]
        self.lanes.wait("h2d", self._scratch_free[which])
        _wait_future(blk.stored)
        if disk_future is not None:
            disk_future.result()
        nbytes = 2 * (c + d) * self.cfg.num_kv_heads * num_tokens * self.cfg.head_dim * self.elt
        with self.lanes.on("h2d", f"kv L{layer} mb{mb}", nbytes):
            if c:
                assert blk.cpu_k is not None and blk.cpu_v is not None
                # whole contiguous homes: a strided pinned source would make torch copy
                # synchronously through pageable memory; unused slots cost (S - t) / S
                sk[:c].copy_(blk.cpu_k, non_blocking=True)
                sv[:c].copy_(blk.cpu_v, non_blocking=True)
            if d:
                # token-major pages cross as they are (contiguous), and are transposed
                # into the scratch layout on the device
                dk, dv = self._disk_views(blk, self._staging[blk.disk_slot])
                for home, scratch in ((dk, sk), (dv, sv)):
                    moved = home[:num_tokens].to(self.device, non_blocking=True)
                    scratch[c : c + d, :, :num_tokens].copy_(moved.permute(1, 2, 0, 3))
        loaded = self.lanes.record("h2d")
        if d:
            self._disk_h2d[blk.disk_slot] = loaded
        self.lanes.wait("compute", loaded)
        return sk, sv

    # -- attention ----------------------------------------------------------------------
    def attention(
        self,
        layer: int,
        mb: int,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        bias: torch.Tensor,
        start: int,
    ) -> torch.Tensor:
        """Attention of micro-batch `mb` at `layer`; stores the new K/V in their homes."""
        blk = self.blocks[layer][mb]
        g, c, d = blk.rows
        end = start + q.shape[2]
        outs = []
        if g:
            assert blk.gpu is not None
            outs.append(blk.gpu.attention(q[:g], k_new[:g], v_new[:g], bias[:g], start))
        if c + d:
            off = slice(g, g + c + d)
            if self.compression is not None:
                outs.append(
                    self._quant_attention(
                        layer, blk, mb, q[off], k_new[off], v_new[off], bias[off], start
                    )
                )
            elif start == 0:
                outs.append(decoder.attend(q[off], k_new[off], v_new[off], bias[off]))
                self._store(blk, mb, k_new[off], v_new[off], start, end)
            elif self.attention_on_cpu:
                outs.append(
                    self._cpu_attention(
                        blk, mb, q[off], k_new[off], v_new[off], bias[off], start, end
                    )
                )
            else:
                if (layer, mb) not in self._pending:
                    self.prefetch(layer, mb, start)
                sk, sv = self._load_scratch(layer, mb)
                n = c + d
                sk[:n, :, start:end] = k_new[off]
                sv[:n, :, start:end] = v_new[off]
                outs.append(decoder.attend(q[off], sk[:n, :, :end], sv[:n, :, :end], bias[off]))
                self._scratch_free[blk.slot] = self.lanes.record("compute")
                self._store(blk, mb, k_new[off], v_new[off], start, end)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

    def _quant_attention(
        self, layer: int, blk: KVBlock, mb: int, q, k_new, v_new, bias, start: int
    ) -> torch.Tensor:
        """Attention of the off-GPU rows of a compressed cache; stores their new entries."""
        end = start + k_new.shape[2]
        if start and self.attention_on_cpu:
            return self._cpu_attention(blk, mb, q, k_new, v_new, bias, start, end)
        _, c, d = blk.rows
        which = blk.slot
        scratch = self._quant_scratch[which].rows(0, c + d)
        if start:  # the homes' cache into the scratch first
            if d and (layer, mb) not in self._pending:
                self.prefetch(layer, mb, start)
            disk_future = self._pending.pop((layer, mb))[1] if d else None
            self.lanes.wait("h2d", self._scratch_free[which])
            _wait_future(blk.stored)
            _wait_future(disk_future)
            home = blk.disk_quant
            nbytes = blk.cpu_quant.nbytes if blk.cpu_quant is not None else 0
            nbytes += home.slot_bytes(start) if home is not None else 0
            with self.lanes.on("h2d", f"kv L{layer} mb{mb}", nbytes):
                if blk.cpu_quant is not None:  # whole contiguous tensors (see _load_scratch)
                    scratch.rows(0, c).copy_from(blk.cpu_quant, non_blocking=True)
                if home is not None:  # the slots held, piece by piece
                    scratch.rows(c, c + d).copy_slots_from(home, start, non_blocking=True)
            loaded = self.lanes.record("h2d")
            if d:
                self._disk_h2d[blk.disk_slot] = loaded
            self.lanes.wait("compute", loaded)
        out = decoder.quant_attention(scratch, q, k_new, v_new, bias, start)
        packed = [
            scratch.rows(first, last).pack(start, end)
            for first, last in ((0, c), (c, c + d))
            if last > first
        ]
        self._scratch_free[which] = self.lanes.record("compute")
        self._store_packed(blk, mb, packed, start, end)
        return out

    def _store(
        self, blk: KVBlock, mb: int, k: torch.Tensor, v: torch.Tensor, start: int, end: int
    ) -> None:
        """Copy new entries of off-GPU rows [c rows | d rows] to their homes (`_stage`)."""
        self._ordered_stage(blk, mb, [k, v], self._scatter, start, end)

    def _ordered_stage(self, blk: KVBlock, mb: int, sources, work, start: int, end: int):
        """`_stage` after the block's last store and, with disk rows, after the last
        user of its disk staging block (which `work` updates and writes back)."""
        previous = blk.stored
        if blk.rows[2]:
            previous = self._io.submit(_wait_all, previous, self._disk_busy[blk.disk_slot])
        future = self._stage(blk, mb, sources, work, start, end, previous)
        if blk.rows[2]:
            self._disk_busy[blk.disk_slot] = future

    def _store_packed(self, blk: KVBlock, mb: int, packed: list, start: int, end: int) -> None:
        """Send `QuantKV.pack`ed bytes of the CPU rows and of the disk rows (those
        present, in that order) to their homes, where `_unpack` puts them in place."""
        self._ordered_stage(blk, mb, packed, self._unpack, start, end)

    def _stage(self, blk: KVBlock, mb: int, sources, work, start: int, end: int, previous):
        """The one way new entries reach off-GPU homes: `sources` (GPU tensors) are
        copied one after another into a contiguous pinned staging block (a strided
        pinned destination makes torch fall back to a synchronous pageable copy), two
        deep; a worker thread, once the copy has landed and `previous` is done, runs
        work(blk, mb, start, end, *staged views), so the host thread goes on launching
        work. Readers of the homes wait on `blk.stored`."""
        which = self._store_turn % 2
        self._store_turn += 1
        _wait_future(self._store_busy[which])  # the work that last read this staging
        staging, views, offset = self._store_staging[which].tensor, [], 0
        for src in sources:
            size = src.numel() * src.element_size()
            views.append(staging[offset : offset + size].view(src.dtype).view(src.shape))
            offset += size
        self.lanes.wait("d2h", self.lanes.record("compute"))
        with self.lanes.on("d2h", f"kv store mb{mb}", offset):
            for view, src in zip(views, sources, strict=True):
                view.copy_(src, non_blocking=True)
                self.lanes.keep(src, "d2h")  # freed by the caller while the copy may run
        copied = self.lanes.record("d2h")
        future = self._io.submit(
            _after, previous, copied, functools.partial(work, blk, mb, start, end, *views)
        )
        blk.stored = self._store_busy[which] = future
        if not self.overlap:
            future.result()
        return future

    def _unpack(self, blk: KVBlock, mb: int, start: int, end: int, *packed) -> None:
        """Worker thread: put packed bytes in the compressed CPU home and in the disk
        home (updated in the staging block its attention read it into, then the
        changed pages written back)."""
        started = time.perf_counter()
        if blk.cpu_quant is not None:
            blk.cpu_quant.unpack(packed[0], start, end)
        if blk.rows[2]:
            staging = self._staging[blk.disk_slot]
            blk.disk_quant.unpack(packed[-1], start, end)
            self._write_disk(blk, staging, start, end)
        nbytes = sum(p.numel() for p in packed)
        self.lanes.tracer.host_span(
            "cpu_copy", f"kv unpack mb{mb}", started, time.perf_counter(), nbytes
        )

    def _scatter(self, blk: KVBlock, mb: int, start: int, end: int, sk, sv) -> None:
        """Worker thread: put the new entries in their homes (and disk pages)."""
        started = time.perf_counter()
        _, c, d = blk.rows
        if c:
            assert blk.cpu_k is not None and blk.cpu_v is not None
            blk.cpu_k[:, :, start:end].copy_(sk[:c])
            blk.cpu_v[:, :, start:end].copy_(sv[:c])
            nbytes = 2 * sk[:c].numel() * self.elt
            self.lanes.tracer.host_span(
                "cpu_copy", f"kv scatter mb{mb}", started, time.perf_counter(), nbytes
            )
        if d:
            # the staging block this micro-batch's attention read its pages into
            staging = self._staging[blk.disk_slot]
            dk, dv = self._disk_views(blk, staging)
            dk[start:end].copy_(sk[c:].permute(2, 0, 1, 3))
            dv[start:end].copy_(sv[c:].permute(2, 0, 1, 3))
            self._write_disk(blk, staging, start, end)

    def _cpu_attention(
        self, blk: KVBlock, mb: int, q, k_new, v_new, bias, start: int, end: int
    ) -> torch.Tensor:
        _, c, d = blk.rows
        _wait_future(blk.stored)
        cpu = torch.device("cpu")
        ready = self.lanes.record("compute")
        self.lanes.wait("d2h", ready)
        with self.lanes.on("d2h", f"q/kv to cpu mb{mb}", 3 * q.numel() * self.elt):
            q_h, k_h, v_h, bias_h = (t.to(cpu, non_blocking=True) for t in (q, k_new, v_new, bias))
        self.lanes.host_wait(self.lanes.record("d2h"))
        started = time.perf_counter()
        outs = []
        if blk.cpu_quant is not None:
            outs.append(
                decoder.quant_attention(blk.cpu_quant, q_h[:c], k_h[:c], v_h[:c], bias_h[:c], start)
            )
        elif c:
            assert blk.cpu_k is not None and blk.cpu_v is not None
            blk.cpu_k[:, :, start:end] = k_h[:c]
            blk.cpu_v[:, :, start:end] = v_h[:c]
            outs.append(
                decoder.attend(q_h[:c], blk.cpu_k[:, :, :end], blk.cpu_v[:, :, :end], bias_h[:c])
            )
        if d:
            staging = self._staging[blk.disk_slot]
            _wait_future(self._disk_busy[blk.disk_slot])
            self._read_disk(blk, staging, start)
            rows = slice(c, None)
            if self.compression is not None:
                home = blk.disk_quant
                outs.append(
                    decoder.quant_attention(
                        home, q_h[rows], k_h[rows], v_h[rows], bias_h[rows], start
                    )
                )
            else:
                dk, dv = self._disk_views(blk, staging)
                dk[start:end] = k_h[rows].permute(2, 0, 1, 3)
                dv[start:end] = v_h[rows].permute(2, 0, 1, 3)
                keys = dk[:end].permute(1, 2, 0, 3)
                values = dv[:end].permute(1, 2, 0, 3)
                outs.append(decoder.attend(q_h[rows], keys, values, bias_h[rows]))
            self._write_disk(blk, staging, start, end)
        context = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        self.lanes.tracer.host_span("cpu_attn", f"attn mb{mb}", started, time.perf_counter(), 0)
        # The output is small and on the critical path: it goes on the compute stream,
        # not queued on the h2d stream behind the next layer's weights. It still waits
        # for the copy engine to finish that weight copy (about 11 ms, the first micro-
        # batch of every layer; H2D copies of all streams share the engine in order):
        # splitting weight copies into chunks is the measured next step (docs/executor.md).
        # A pinned high-priority stream for it measured no better.
        with self.lanes.on("compute", f"attn out mb{mb}", context.numel() * self.elt):
            return context.to(self.device, non_blocking=True)
