"""`KVManager`: a batch's KV cache across GPU, pinned CPU memory and disk, and attention
over it; the one entry point the executor uses (start, prefetch, prefetch_after,
attention, close).

For one layer and one micro-batch, rows [0, g) keep their K/V on the GPU, rows
[g, g + c) in the pinned pool and the rest in a spill file on disk (the homes and their
layouts: `kv_homes.py`). Attention for rows off the GPU runs
- at prefill, on the GPU over the fresh K/V (no cache to read), which are then stored;
- at decode with attention_on_cpu, on the CPU next to the cache: only q, the new K/V
  and the attention output cross PCIe;
- at decode otherwise, on the GPU over the cache loaded into a scratch buffer, which is
  prefetched while the previous micro-batch computes; only the new K/V go back.

A compressed cache (policy.kv_compression, `kernels.kv_cache.QuantKV`) has homes in all
three tiers, and compressed bytes are what crosses PCIe and the disk: the entries of
off-GPU rows are quantized on the GPU in a compressed scratch (at prefill, and at decode
with attention on the GPU, where the scratch first receives the CPU home whole and the
disk home's held slots) and `QuantKV.pack` sends back only what the write changed (a
decode step's entry's pages in the tails, and a group's codes once a group). With
attention on the CPU a decode step's entries are quantized and attended next to the
home (the torch path, bit-exact with the kernels).

Composition, not mixins: `KVManager` holds a `KVHomes` (every byte: homes, scratches,
staging; `kv_homes.py`) and a `KVTransfer` (the threads and futures that move entries
between them and the disk; `kv_transfer.py`), and keeps only the attention-side state:
the prefetches in flight and when each GPU scratch is free again.
"""

from __future__ import annotations

import bisect
import functools
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import torch

from offload.core.config import ModelConfig
from offload.executor.kv_homes import KVBlock, KVHomes
from offload.executor.kv_transfer import KVTransfer, _wait_all, _wait_future
from offload.executor.lanes import Lanes
from offload.io.layout import DISK_BUFFERS
from offload.io.pinned import PinnedPool, PoolBlock
from offload.io.tiers import MemoryLedger
from offload.kernels.formats import Compression
from offload.models import attention


class KVManager:
    """Allocates KV homes for a batch and runs each micro-batch's attention over them."""

    def __init__(
        self,
        cfg: ModelConfig,
        lanes: Lanes,
        device: torch.device,
        dtype: torch.dtype,
        ledger: MemoryLedger,
        spill_dir: Path | str,
        attention_on_cpu: bool,
        overlap: bool,
        compression: Compression | None = None,
        disk_buffers: int = DISK_BUFFERS,
    ) -> None:
        """compression: the cache format of every home (policy.kv_compression)."""
        self.cfg, self.lanes, self.device, self.dtype = cfg, lanes, device, dtype
        self.compression, self.disk_buffers = compression, disk_buffers
        self.attention_on_cpu = attention_on_cpu
        self.cap = cfg.attn_softcap  # soft-capped scores (`attention.softcap_attend`)
        self.homes = KVHomes(
            cfg, device, dtype, ledger, spill_dir, attention_on_cpu, compression, disk_buffers
        )
        self.transfer = KVTransfer(self.homes, lanes, overlap)
        self.elt = self.homes.elt
        self._pending: dict[tuple[int, int], tuple] = {}  # (layer, mb): (tokens, disk read)
        self._disk_order: list[tuple[int, int]] = []  # blocks with disk rows, attention order
        # (layer, mb): the landing of a compressed home's copy issued ahead of its attention
        self._quant_loaded: dict[tuple[int, int], torch.cuda.Event | None] = {}
        # per GPU scratch (a ring, `KVLayout.scratch_depth`): its last reader's event
        self._scratch_free: list[torch.cuda.Event | None] = []
        # every row of the batch's cache lives on the GPU: no transfer takes part in a
        # step (set once a batch by `start`, read every decode step)
        self.all_on_gpu = True

    @property
    def pool(self) -> PinnedPool | None:
        """The per-batch pinned pool of CPU homes, staging and activations."""
        return self.homes.pool

    @property
    def blocks(self) -> list[list[KVBlock]]:
        return self.homes.blocks

    def start(
        self, row_splits: list[tuple[int, int, int]], max_slots: int, act_bytes: list[int]
    ) -> list[PoolBlock | None]:
        """Fresh homes for micro-batches with the given (gpu, cpu, disk) row counts.

        Also hands out the pinned blocks for CPU-resident activations (act_bytes per
        micro-batch), from the same per-batch pool."""
        self.release()
        acts = self.homes.start(row_splits, max_slots, act_bytes)
        depth = self.homes.layout.scratch_depth(len(row_splits), self.attention_on_cpu)
        self._scratch_free = [None] * depth
        self._disk_order = [
            (layer, mb)
            for layer, row in enumerate(self.blocks)
            for mb, blk in enumerate(row)
            if blk.rows[2]
        ]
        self.all_on_gpu = all(not (c or d) for _, c, d in row_splits)
        return acts

    def settle(self) -> None:
        """Wait for every transfer in flight, the disk reads ahead included: none of
        their threads' CUDA calls may fall inside a graph capture."""
        self.transfer.settle()
        _wait_all(*(future for _, future in self._pending.values()))

    def release(self) -> None:
        self.transfer.drain()
        self.homes.release()
        self._pending, self._quant_loaded = {}, {}

    def close(self) -> None:
        self.transfer.close()
        self.homes.close()
        self._pending, self._quant_loaded = {}, {}

    # -- decode prefetch (attention on the GPU over an off-GPU cache) ----------------------
    def prefetch(self, layer: int, mb: int, num_tokens: int) -> None:
        """Start loading the off-GPU cache of (layer, mb) for its decode attention."""
        key = (layer, mb)
        if (
            self.attention_on_cpu
            or not num_tokens
            or key in self._pending
            or key in self._quant_loaded
        ):
            return
        blk = self.blocks[layer][mb]
        _, c, d = blk.rows
        # a compressed CPU home crosses at attention (as _load_scratch); its disk rows
        # are read ahead here all the same
        if not (d if self.compression is not None else c + d):
            return
        disk_future: Future | None = None
        if d:
            disk_future = self.transfer.read_disk_ahead(blk, num_tokens)
        self._pending[layer, mb] = (num_tokens, disk_future)

    def prefetch_after(self, layer: int, mb: int, num_tokens: int) -> None:
        """After the attention of (layer, mb) was issued (and its store): start the disk
        reads of the next blocks with disk rows in attention order, one per disk staging
        block. Each of those uses the staging block of a disk block attended and stored
        by now, so its read (a worker's, queued after that block's write-back) never
        overwrites a staging block in use. Reads run ahead by disk blocks, not by
        micro-batches: BLOOM-176B's searched plan has one disk block among a layer's 16
        micro-batches, and reading it two micro-batches ahead (3 ms of compute, against
        an 8 ms read) stalled every layer 24 ms (H100 trace; docs/executor.md)."""
        done = bisect.bisect_right(self._disk_order, (layer, mb))
        for key in self._disk_order[done : done + self.disk_buffers]:
            self.prefetch(*key, num_tokens)

    def _load_scratch(self, layer: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        num_tokens, disk_future = self._pending.pop((layer, mb))
        blk = self.blocks[layer][mb]
        _, c, d = blk.rows
        which = blk.slot
        sk, sv = self.homes.scratch[which]
        self.lanes.wait("h2d_kv", self._scratch_free[which])
        with self.lanes.blocked(f"kv L{layer} mb{mb} stored, read"):
            _wait_all(blk.stored, disk_future)
        nbytes = 2 * (c + d) * self.cfg.num_kv_heads * num_tokens * self.cfg.head_dim * self.elt
        with self.lanes.on("h2d_kv", f"kv L{layer} mb{mb}", nbytes):
            if c:
                assert blk.cpu_k is not None and blk.cpu_v is not None
                # whole contiguous homes: a strided pinned source would make torch copy
                # synchronously through pageable memory; unused slots cost (S - t) / S
                sk[:c].copy_(blk.cpu_k, non_blocking=True)
                sv[:c].copy_(blk.cpu_v, non_blocking=True)
            if d:
                # token-major pages cross as they are (contiguous), and are transposed
                # into the scratch layout on the device
                dk, dv = self.homes.disk_views(blk)
                for home, scratch in ((dk, sk), (dv, sv)):
                    moved = home[:num_tokens].to(self.device, non_blocking=True)
                    scratch[c : c + d, :, :num_tokens].copy_(moved.permute(1, 2, 0, 3))
        loaded = self.lanes.record("h2d_kv")
        if d:
            self.transfer.staging_read(blk, loaded)
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
        causal: bool = False,
        out: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> Callable[[], torch.Tensor]:
        """Attention of micro-batch `mb` at `layer`; stores the new K/V in their homes
        (causal: `attention.attend`'s). out: where the caller will want the context (the
        decode graphs' buffer); the attention writes it there when all of the rows'
        KV is on the GPU and compressed, else the caller copies what is returned.

        Returns the call that gives the context. Everything on the GPU is issued here;
        rows attended on the CPU (`attention_on_cpu`, decode) have their query and new
        K/V copied out here and are attended in the call, on the host thread: a caller
        issues the next micro-batch's work in between (`Executor._layers`), so the GPU
        computes it while the CPU attends this one. sinks: the layer's attention sinks
        (`attention.attend_sinks`: on the GPU only; `policies.paths` keeps such a model's
        plans off the CPU attention and the compressed cache)."""
        blk = self.blocks[layer][mb]
        g, c, d = blk.rows
        end = start + q.shape[2]
        outs: list[torch.Tensor | Callable[[], torch.Tensor]] = []
        if g:
            assert blk.gpu is not None
            whole = None if c + d else out
            outs.append(
                blk.gpu.attention(
                    q[:g], k_new[:g], v_new[:g], bias[:g], start, causal, whole, sinks
                )
            )
        if c + d:
            off = slice(g, g + c + d)
            assert sinks is None or not (self.compression or self.attention_on_cpu), "sinks"

            def attend(q_rows, keys, values, bias_rows) -> torch.Tensor:
                return attention.attend(q_rows, keys, values, bias_rows, causal, self.cap, sinks)

            if self.compression is not None:
                outs.append(
                    self._quant_attention(
                        layer, blk, mb, q[off], k_new[off], v_new[off], bias[off], start, causal
                    )
                )
            elif start == 0:
                outs.append(attend(q[off], k_new[off], v_new[off], bias[off]))
                self.transfer.store(blk, mb, k_new[off], v_new[off], start, end)
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
                keys, values = sk[:n, :, :end], sv[:n, :, :end]
                outs.append(attend(q[off], keys, values, bias[off]))
                self._scratch_free[blk.slot] = self.lanes.record("compute")
                self.transfer.store(blk, mb, k_new[off], v_new[off], start, end)

        def context() -> torch.Tensor:
            done = [part() if callable(part) else part for part in outs]
            return done[0] if len(done) == 1 else torch.cat(done, dim=0)

        return context

    def _quant_attention(
        self,
        layer: int,
        blk: KVBlock,
        mb: int,
        q,
        k_new,
        v_new,
        bias,
        start: int,
        causal: bool = False,
    ) -> torch.Tensor | Callable[[], torch.Tensor]:
        """Attention of the off-GPU rows of a compressed cache; stores their new entries.
        Attended on the CPU: the call that attends them (`_cpu_attention`)."""
        end = start + k_new.shape[2]
        if start and self.attention_on_cpu:
            return self._cpu_attention(blk, mb, q, k_new, v_new, bias, start, end)
        _, c, d = blk.rows
        which = blk.slot
        scratch = self.homes.quant_scratch[which].rows(0, c + d)
        if start:  # the homes' cache into the scratch first
            if (layer, mb) in self._quant_loaded:
                loaded = self._quant_loaded.pop((layer, mb))
            else:
                loaded = self._load_quant(layer, mb, start)
            self.lanes.wait("compute", loaded)
        out = attention.quant_attention(
            scratch, q, k_new, v_new, bias, start, causal, softcap=self.cap
        )
        packed = [
            scratch.rows(first, last).pack(start, end)
            for first, last in ((0, c), (c, c + d))
            if last > first
        ]
        self._scratch_free[which] = self.lanes.record("compute")
        self.transfer.store_packed(blk, mb, packed, start, end)
        return out

    def _load_quant(self, layer: int, mb: int, start: int) -> torch.cuda.Event | None:
        """Issue the copy of (layer, mb)'s compressed homes into its GPU scratch (after
        the scratch's last reader); returns the event of its landing."""
        blk = self.blocks[layer][mb]
        _, c, d = blk.rows
        which = blk.slot
        scratch = self.homes.quant_scratch[which].rows(0, c + d)
        if d and (layer, mb) not in self._pending:
            self.prefetch(layer, mb, start)
        disk_future = self._pending.pop((layer, mb))[1] if d else None
        self.lanes.wait("h2d_kv", self._scratch_free[which])
        with self.lanes.blocked(f"kv L{layer} mb{mb} stored, read"):
            _wait_all(blk.stored, disk_future)
        home = blk.disk_quant
        nbytes = 0
        if self.lanes.tracer.enabled:  # (the bytes are only the trace's)
            nbytes = blk.cpu_quant.nbytes if blk.cpu_quant is not None else 0
            nbytes += home.slot_bytes(start) if home is not None else 0
        with self.lanes.on("h2d_kv", f"kv L{layer} mb{mb}", nbytes):
            if blk.cpu_quant is not None:  # whole contiguous tensors (see _load_scratch)
                scratch.rows(0, c).copy_from(blk.cpu_quant, non_blocking=True)
            if home is not None:  # the slots held, piece by piece
                scratch.rows(c, c + d).copy_slots_from(home, start, non_blocking=True)
        loaded = self.lanes.record("h2d_kv")
        if d:
            self.transfer.staging_read(blk, loaded)
        return loaded

    def load_layer(self, layer: int, start: int, copy_follows: bool) -> None:
        """Issue the loads of this layer's compressed off-GPU homes (attention on the
        GPU), each into its micro-batch's scratch, after that scratch's reader in the
        layer before.

        copy_follows: the next stage's weight copy is issued next. The loads share the
        weights' copy stream (`Lanes`), so each one issued here runs before that copy
        and never behind it. Loaded one micro-batch ahead on a stream of their own, the
        copy engine drained the whole queued weight copy (25 ms) first, then the loads:
        a BLOOM-176B layer took both, one after the other (H100; docs/executor.md). So with a
        copy to follow the host waits here for each disk read; without one, a block
        whose read is still running loads at its attention instead, and the micro-
        batches before it go on computing meanwhile (OPT-30B, int4 weights on the GPU,
        a disk row in each of 2 micro-batches: the host waited for the second's read
        before it issued the first's layer, H100 trace; docs/executor.md).
        Of the layer's blocks with disk rows, the first `disk_buffers` only: each later
        one is read into the staging block of one before it in this layer, which its
        attention still updates and writes back (they load at their attention)."""
        if not (start and self.compression is not None and not self.attention_on_cpu):
            return
        on_disk = 0
        for mb, blk in enumerate(self.blocks[layer]):
            _, c, d = blk.rows
            on_disk += 1 if d else 0
            if not (c + d) or (layer, mb) in self._quant_loaded:
                continue
            if d and on_disk > self.disk_buffers:
                continue
            if d and not copy_follows:
                self.prefetch(layer, mb, start)  # (if not read ahead yet)
                if not self._read_done(layer, mb):
                    continue
            self._quant_loaded[(layer, mb)] = self._load_quant(layer, mb, start)

    def _read_done(self, layer: int, mb: int) -> bool:
        """Whether the disk read ahead of (layer, mb) has landed in its staging block."""
        future = self._pending[layer, mb][1]
        return future is None or future.done()

    def _cpu_attention(
        self, blk: KVBlock, mb: int, q, k_new, v_new, bias, start: int, end: int
    ) -> Callable[[], torch.Tensor]:
        """Issues the copy of the query and new K/V to the host; returns the call that
        attends them there (after the copy and the block's last store) and sends the
        context back to the GPU."""
        cpu = torch.device("cpu")
        ready = self.lanes.record("compute")
        self.lanes.wait("d2h", ready)
        with self.lanes.on("d2h", f"q/kv to cpu mb{mb}", 3 * q.numel() * self.elt):
            on_host = [t.to(cpu, non_blocking=True) for t in (q, k_new, v_new, bias)]
        for source in (q, k_new, v_new, bias):
            # the host goes on without waiting for the copy: the allocator must not
            # give the sources' memory to the next micro-batch's work meanwhile
            self.lanes.keep(source, "d2h")
        copied = self.lanes.record("d2h")
        return functools.partial(self._attend_on_cpu, blk, mb, *on_host, copied, start, end)

    def _attend_on_cpu(
        self, blk: KVBlock, mb: int, q_h, k_h, v_h, bias_h, copied, start: int, end: int
    ) -> torch.Tensor:
        _, c, d = blk.rows
        with self.lanes.blocked(f"kv mb{mb} stored"):
            _wait_future(blk.stored)
        self.lanes.host_wait(copied)
        started = time.perf_counter()
        outs = []
        if blk.cpu_quant is not None:
            outs.append(
                attention.quant_attention(
                    blk.cpu_quant, q_h[:c], k_h[:c], v_h[:c], bias_h[:c], start, softcap=self.cap
                )
            )
        elif c:
            assert blk.cpu_k is not None and blk.cpu_v is not None
            blk.cpu_k[:, :, start:end] = k_h[:c]
            blk.cpu_v[:, :, start:end] = v_h[:c]
            keys, values = blk.cpu_k[:, :, :end], blk.cpu_v[:, :, :end]
            outs.append(attention.attend(q_h[:c], keys, values, bias_h[:c], softcap=self.cap))
        if d:
            self.transfer.read_disk(blk, start)
            rows = slice(c, None)
            if self.compression is not None:
                home = blk.disk_quant
                outs.append(
                    attention.quant_attention(
                        home, q_h[rows], k_h[rows], v_h[rows], bias_h[rows], start, softcap=self.cap
                    )
                )
            else:
                dk, dv = self.homes.disk_views(blk)
                dk[start:end] = k_h[rows].permute(2, 0, 1, 3)
                dv[start:end] = v_h[rows].permute(2, 0, 1, 3)
                keys = dk[:end].permute(1, 2, 0, 3)
                values = dv[:end].permute(1, 2, 0, 3)
                outs.append(
                    attention.attend(q_h[rows], keys, values, bias_h[rows], softcap=self.cap)
                )
            self.transfer.write_disk(blk, start, end)
        context = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        self.lanes.tracer.host_span("cpu_attn", f"attn mb{mb}", started, time.perf_counter(), 0)
        # The output is small and on the critical path: it goes on the compute stream,
        # not queued on the h2d stream behind the next layer's weights. It still waits
        # for the copy engine to finish that weight copy (about 11 ms, the first micro-
        # batch of every layer; H2D copies of all streams share the engine in order):
        # splitting weight copies into chunks would shorten that wait (not built;
        # docs/executor.md).
        # A pinned high-priority stream for it measured no better.
        with self.lanes.on("compute", f"attn out mb{mb}", context.numel() * self.elt):
            return context.to(self.device, non_blocking=True)
