"""Moving KV entries between the GPU, pinned homes and the spill file, off the host thread.

Two kinds of transfer, both ordered by futures on one thread pool:
- disk pages: a disk home is read into (and written back from) its block's disk
  staging block as whole 4 KiB pages, only the pages that hold the slots a step reads
  or a write changes (a few contiguous ranges: both disk layouts are token-major);
- stores of new entries: `store` (K/V of the off-GPU rows) and `store_packed`
  (`QuantKV.pack`ed bytes of a compressed cache) copy GPU tensors into a contiguous
  pinned store staging block on the d2h stream, two deep; a worker thread, once the
  copy has landed, puts them in the CPU homes and the disk staging block and writes
  the changed pages back. Readers of a home wait on `KVBlock.stored`.

`KVTransfer` holds only the ordering state (which task last used each staging block,
which H2D last read it); the bytes belong to `KVHomes`, which it is given.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from offload.executor.kv_homes import KVBlock, KVHomes
from offload.executor.lanes import Lanes
from offload.io.pinned import ALIGN, align_up


def _wait_future(future: Future | None) -> None:
    if future is not None:
        future.result()


def _wait_all(*futures: Future | None) -> None:
    for future in futures:
        _wait_future(future)


def _after(previous: tuple[Future | None, ...], copied, work) -> None:
    """Worker thread: once `previous` are done and the `copied` event has passed, work()."""
    _wait_all(*previous)
    if copied is not None:
        copied.synchronize()
    work()


def _page_spans(
    base: torch.Tensor, pieces: list[torch.Tensor], gap: int = 0
) -> list[tuple[int, int]]:
    """Byte ranges [lo, hi) of `base`, 4 KiB aligned and merged, that cover the views
    `pieces` of its memory; ranges at most `gap` bytes apart are merged too (the bytes
    between come along)."""
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
        if merged and lo <= merged[-1][1] + gap:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return merged


# a disk read takes the bytes between two pieces it needs (of a disk home's tensors,
# read into its own staging block) when they are at most this far apart: each request
# costs its thread two GIL handoffs beside the launching host thread, and the spill
# file's threads run them in parallel, so a compressed home's eight tensor prefixes
# were eight requests a block (Llama-3.1-8B, H100 profile; docs/io.md); 256 KiB take the
# disk about 0.1 ms. A write-back never merges: the staging block holds only the pages
# read, and the bytes between would overwrite the home's with another block's.
READ_MERGE_GAP = 256 * 1024
STORE_ALIGN = 512  # bytes: where each store starts in its staging block
STORE_DEPTH = 64  # stores in flight at most in one staging block


class KVTransfer:
    """Threaded disk reads and write-backs, and staged stores of new entries."""

    def __init__(self, homes: KVHomes, lanes: Lanes, overlap: bool) -> None:
        """overlap=False waits for every store where it is issued (the serial schedule)."""
        self.homes, self.lanes, self.overlap = homes, lanes, overlap
        self._io = ThreadPoolExecutor(max_workers=8, thread_name_prefix="offload-kv")
        # disk reads have a thread of their own: queued in `_io` behind stores that
        # wait for their micro-batch's compute, a read issued blocks ahead started only
        # when the GPU reached it, and the host then waited for it (BLOOM-176B: about
        # 24 ms a layer; docs/executor.md)
        self._reads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-kv-read")
        # per store staging block: the stores in flight in it, (start, end, future), and
        # where the next one goes (`_claim`)
        self._store_busy: list[list[tuple[int, int, Future]]] = [[], []]
        self._store_head = [0, 0]
        self._store_turn = 0
        # disk staging block p: the last task that uses it, and the last H2D reading it
        self._disk_busy: list[Future | None] = [None] * homes.disk_buffers
        self._disk_h2d: list[torch.cuda.Event | None] = [None] * homes.disk_buffers

    def settle(self) -> None:
        """Wait for every store and disk transfer in flight (their threads then make no
        CUDA call until the next is issued)."""
        _wait_all(*(f for busy in self._store_busy for _, _, f in busy), *self._disk_busy)

    def drain(self) -> None:
        """Wait for every store and disk transfer in flight; forget the orderings."""
        self.settle()
        self._store_busy, self._store_head = [[], []], [0, 0]
        self._disk_busy = [None] * self.homes.disk_buffers
        self._disk_h2d = [None] * self.homes.disk_buffers

    def close(self) -> None:
        self.drain()
        self._io.shutdown(wait=True)
        self._reads.shutdown(wait=True)

    # -- disk pages ---------------------------------------------------------------------
    def _disk_io(self, blk: KVBlock, start: int, end: int, write: bool) -> None:
        """Read (or write back) the whole pages of the disk home that hold slots
        [start, end): a few contiguous ranges, as both layouts are token-major."""
        spill = self.homes.spill
        assert spill is not None
        started = time.perf_counter()
        staging = self.homes.staging_of(blk).tensor
        gap = 0 if write else READ_MERGE_GAP
        spans = _page_spans(staging, self.homes.disk_pieces(blk, start, end), gap)
        spill.transfer([(blk.disk_offset + lo, staging[lo:hi]) for lo, hi in spans], write)
        moved = sum(hi - lo for lo, hi in spans)
        name = f"kv {'write' if write else 'read'} {blk.name}"
        self.lanes.tracer.host_span("disk", name, started, time.perf_counter(), moved)

    def write_disk(self, blk: KVBlock, start: int, end: int) -> None:
        """Write back the whole pages that a write of token slots [start, end) changed
        (on the calling thread: a worker's, or the host's with attention on the CPU)."""
        self._disk_io(blk, start, end, write=True)

    def read_disk(self, blk: KVBlock, num_tokens: int) -> None:
        """On this thread: once its staging block is free, read what holds the block's
        first num_tokens token slots into it."""
        _wait_future(self._disk_busy[blk.disk_slot])
        self._disk_io(blk, 0, num_tokens, write=False)

    def read_disk_ahead(self, blk: KVBlock, num_tokens: int) -> Future:
        """A worker thread reads the block's disk pages (as `read_disk`) once its staging
        block is free: its last task done and the last H2D from it passed."""
        which = blk.disk_slot
        future = self._reads.submit(
            self._read_disk_after, blk, num_tokens, self._disk_busy[which], self._disk_h2d[which]
        )
        self._disk_busy[which] = future
        return future

    def _read_disk_after(self, blk: KVBlock, num_tokens: int, busy, h2d) -> None:
        _wait_future(busy)
        if h2d is not None:
            h2d.synchronize()
        self._disk_io(blk, 0, num_tokens, write=False)

    def staging_read(self, blk: KVBlock, h2d: torch.cuda.Event | None) -> None:
        """The H2D copy that `h2d` records read the block's disk staging block."""
        self._disk_h2d[blk.disk_slot] = h2d

    # -- stores of new entries ----------------------------------------------------------
    def store(
        self, blk: KVBlock, mb: int, k: torch.Tensor, v: torch.Tensor, start: int, end: int
    ) -> None:
        """Copy new entries of off-GPU rows [c rows | d rows] to their homes (`_stage`)."""
        self._ordered_stage(blk, mb, [k, v], self._scatter, start, end)

    def store_packed(self, blk: KVBlock, mb: int, packed: list, start: int, end: int) -> None:
        """Send `QuantKV.pack`ed bytes of the CPU rows and of the disk rows (those
        present, in that order) to their homes, where `_unpack` puts them in place."""
        self._ordered_stage(blk, mb, packed, self._unpack, start, end)

    def _ordered_stage(self, blk: KVBlock, mb: int, sources, work, start: int, end: int):
        """`_stage` after the block's last store and, with disk rows, after the last
        user of its disk staging block (which `work` updates and writes back)."""
        previous = (blk.stored, self._disk_busy[blk.disk_slot] if blk.rows[2] else None)
        future = self._stage(blk, mb, sources, work, start, end, previous)
        if blk.rows[2]:
            self._disk_busy[blk.disk_slot] = future

    def _stage(
        self,
        blk: KVBlock,
        mb: int,
        sources,
        work: Callable,
        start: int,
        end: int,
        previous: tuple[Future | None, ...],
    ) -> Future:
        """The one way new entries reach off-GPU homes: `sources` (GPU tensors) are
        copied one after another into a contiguous piece of a pinned staging block (a
        strided pinned destination makes torch fall back to a synchronous pageable
        copy; two blocks, each a ring: `_claim`); a worker thread, once the copy has landed and `previous` is done, runs
        work(blk, mb, start, end, *staged views), so the host thread goes on launching
        work. Readers of the homes wait on `blk.stored`."""
        which = self._store_turn % 2
        self._store_turn += 1
        sizes = [src.numel() * src.element_size() for src in sources]
        staging, claimed = self._claim(which, sum(sizes))
        views, offset = [], 0
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
        blk.stored = future
        self._store_busy[which].append((*claimed, future))
        if not self.overlap:
            future.result()
        return future

    def _claim(self, which: int, need: int) -> tuple[torch.Tensor, tuple[int, int]]:
        """`need` bytes of store staging block `which`, after the stores in flight that
        read them. The block is a ring: a prefill's store fills it (one in flight, as
        two blocks deep), while a decode step's stores are a few KB each and many fit,
        so the host goes on launching instead of waiting for the GPU's attention a
        micro-batch or two back (BLOOM-176B, 16 micro-batches over a compressed CPU
        cache: that wait set a 2 ms chain per layer and micro-batch, H100 trace)."""
        block = self.homes.store_staging[which].tensor
        assert need <= block.numel(), "the staging block holds the largest store"
        start = align_up(self._store_head[which], STORE_ALIGN)
        if start + need > block.numel():
            start = 0
        end = start + need
        busy = self._store_busy[which]
        waits = [f for lo, hi, f in busy if lo < end and start < hi]
        if len(busy) - len(waits) >= STORE_DEPTH:  # bounded: the oldest waits
            waits.append(busy[0][2])
        with self.lanes.blocked(f"store staging {which}"):
            _wait_all(*waits)
        self._store_busy[which] = [item for item in busy if item[2] not in waits]
        self._store_head[which] = end
        return block[start:end], (start, end)

    def _unpack(self, blk: KVBlock, mb: int, start: int, end: int, *packed) -> None:
        """Worker thread: put packed bytes in the compressed CPU home and in the disk
        home (updated in the staging block its attention read it into, then the
        changed pages written back)."""
        started = time.perf_counter()
        if blk.cpu_quant is not None:
            blk.cpu_quant.unpack(packed[0], start, end)
        if blk.rows[2]:
            assert blk.disk_quant is not None
            blk.disk_quant.unpack(packed[-1], start, end)
            self.write_disk(blk, start, end)
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
            nbytes = 2 * sk[:c].numel() * self.homes.elt
            self.lanes.tracer.host_span(
                "cpu_copy", f"kv scatter mb{mb}", started, time.perf_counter(), nbytes
            )
        if d:
            # the staging block this micro-batch's attention read its pages into
            dk, dv = self.homes.disk_views(blk)
            dk[start:end].copy_(sk[c:].permute(2, 0, 1, 3))
            dv[start:end].copy_(sv[c:].permute(2, 0, 1, 3))
            self.write_disk(blk, start, end)
