"""A mixture of experts' routed experts: their homes, and the fetcher that runs each
chosen expert once, its weights crossing at most once a layer and step.

A mixture-of-experts layer's image ends with its experts (`io.layout.ExpertSpan`), cut
at expert edges: its first `gpu_slots` expert slots live on the GPU, the next
`cpu_slots` in pinned memory, the rest in the weight store on disk. Which expert sits
in which slot is a map (`ExpertHomes.slot_of`), so the most used experts can be moved
to the GPU slots between blocks (`ExpertHomes.swap`: an expert on the GPU trades
places with one in pinned memory; the disk's experts stay where the store put them).

Placement by routing: the fetcher counts the rows each expert takes (`usage`), and
between steps (`rebalance`) moves the most used experts of each layer to its GPU slots:
an expert in pinned memory that took more rows than one on the GPU trades places with
it. It rebalances once the rows counted have doubled since the last time (the first
block's prefill, a large sample of the job's routing, then ever more rarely).

`ExpertFetcher.run` takes a layer's chosen experts in ascending order: an expert on the
GPU is used in place; the others are copied into a ring of `EXPERT_BUFFERS` GPU
buffers, up to that many ahead of the compute, and a disk expert is read first into
pinned staging (every disk read of the layer is issued at once, on the reader's
threads). An expert no token chose is neither read nor copied.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from offload.executor.lanes import Lanes
from offload.executor.moe_layer import moe_layer
from offload.io.layout import EXPERT_BUFFERS, ExpertSpan, TensorSlot
from offload.io.pinned import PinnedPool, PoolBlock
from offload.io.reader import ExtentReader
from offload.io.store_format import Extent
from offload.io.tiers import MemoryLedger, Tier
from offload.kernels.formats import Compression
from offload.kernels.quant import assemble_stage
from offload.models import moe


@dataclass
class ExpertTraffic:
    """One layer's experts in one step: chosen, used where they live on the GPU,
    computed on the CPU, copied from pinned memory, read from disk (and copied), and the
    bytes each way crossed."""

    chosen: int = 0
    resident: int = 0
    on_cpu: int = 0  # computed on the CPU beside its weights
    from_cpu: int = 0
    from_disk: int = 0
    h2d_bytes: int = 0
    disk_bytes: int = 0
    moved: list[int] = field(default_factory=list)  # the experts copied, in order

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in vars(self).items() if k != "moved"}

    def add(self, other: ExpertTraffic) -> None:
        for name, value in vars(other).items():
            setattr(self, name, getattr(self, name) + value)


class ExpertHomes:
    """One mixture-of-experts layer's routed experts on their tiers (module docstring)."""

    def __init__(
        self,
        key: str,
        span: ExpertSpan,
        layout: tuple[TensorSlot, ...],
        shapes: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        compression: Compression | None,
        cuts: tuple[int, int],
        homes: tuple[torch.Tensor | None, PoolBlock | None],
        disk: dict[int, tuple[tuple[Extent, int], ...]],
    ) -> None:
        """layout, shapes: the stage's stored tensors and canonical shapes; cuts: the
        image's (gpu_end, cpu_end); homes: its GPU part and pinned block; disk: per disk
        slot, its extents and where each lands in the slot."""
        self.key, self.span = key, span
        self.dtype, self.compression = dtype, compression
        (self.gpu_end, cpu_end), (self.gpu_home, self.cpu_home) = cuts, homes
        self.gpu_slots = span.slots_below(self.gpu_end)
        self.cpu_slots = span.slots_below(cpu_end) - self.gpu_slots
        self.disk = disk
        self.slot_of = list(range(span.count))  # expert -> slot
        self.expert_in = list(range(span.count))  # slot -> expert
        first = span.offset(0)
        prefix = "experts.0."
        # expert 0's tensors relative to its slot (every expert's are the same)
        self._relative = [
            (t.name[len(prefix) :], t.offset - first, t.nbytes, t.shape, t.dtype)
            for t in layout
            if t.name.startswith(prefix)
        ]
        # expert 0's canonical tensors (matrices, gpt-oss's biases or MXFP4 blocks and
        # scales) by their names after the prefix
        self._shapes = {n[len(prefix) :]: s for n, s in shapes.items() if n.startswith(prefix)}
        self._resident: dict[int, tuple] = {}

    def tier(self, expert: int) -> Tier:
        slot = self.slot_of[expert]
        if slot < self.gpu_slots:
            return Tier.GPU
        return Tier.CPU if slot < self.gpu_slots + self.cpu_slots else Tier.DISK

    def home(self, expert: int) -> torch.Tensor:
        """The bytes of an expert on the GPU or in pinned memory."""
        start = self.span.offset(self.slot_of[expert])
        if self.tier(expert) is Tier.GPU:
            assert self.gpu_home is not None
            return self.gpu_home[start : start + self.span.expert_bytes]
        assert self.cpu_home is not None and self.tier(expert) is Tier.CPU
        start -= self.gpu_end
        return self.cpu_home.tensor[start : start + self.span.expert_bytes]

    def weights(self, expert: int, base: torch.Tensor) -> tuple:
        """Expert `expert`'s (mlp_in, mlp_out) over its bytes `base`."""
        stored = {
            f"experts.{expert}.{suffix}": base[at : at + nbytes].view(dtype).view(shape)
            for suffix, at, nbytes, shape, dtype in self._relative
        }
        shapes = {f"experts.{expert}.{n}": shape for n, shape in self._shapes.items()}
        views = assemble_stage(stored, shapes, self.dtype, self.compression)
        return moe.expert_weights(views, expert)

    def resident(self, expert: int) -> tuple:
        """A GPU expert's weights, built once."""
        if expert not in self._resident:
            self._resident[expert] = self.weights(expert, self.home(expert))
        return self._resident[expert]

    def swap(self, on_gpu: int, on_cpu: int, scratch: torch.Tensor) -> None:
        """Trade the homes of an expert on the GPU and one in pinned memory, through a
        GPU scratch of an expert's bytes (stream-ordered on the current stream)."""
        assert self.tier(on_gpu) is Tier.GPU and self.tier(on_cpu) is Tier.CPU
        gpu, cpu = self.home(on_gpu), self.home(on_cpu)
        scratch.copy_(cpu, non_blocking=True)
        cpu.copy_(gpu)  # (waits: the pinned bytes are rewritten before the next reads)
        gpu.copy_(scratch)
        a, b = self.slot_of[on_gpu], self.slot_of[on_cpu]
        self.slot_of[on_gpu], self.slot_of[on_cpu] = b, a
        self.expert_in[a], self.expert_in[b] = on_cpu, on_gpu
        self._resident.pop(on_gpu, None)

    @property
    def off_gpu(self) -> int:
        return self.span.count - self.gpu_slots


class ExpertFetcher:
    """Runs a layer's chosen experts in ascending order, fetching those not on the GPU
    (module docstring); `traffic` holds a layer's `ExpertTraffic` since the last
    `step_traffic`, `job` over the job."""

    def __init__(
        self,
        fetcher,  # the stages' `weights.WeightFetcher`: their images, lanes and reader
        device: torch.device,
        pool: PinnedPool,
        ledger: MemoryLedger,
        policy,  # the run's `policies.Policy`: its overlap and cpu_experts
        movable: bool = True,
    ) -> None:
        """movable: experts may change places by routing (`rebalance`); not where the
        pinned homes are shared with other processes (`placing.SharedWeights`)."""
        self.lanes: Lanes = fetcher.lanes
        self.reader: ExtentReader = fetcher.reader
        self.overlap, self.cpu_share = policy.overlap, policy.cpu_experts
        self.movable = movable
        # computes experts on the CPU (`kernels.cpu_expert`) beside the launching thread
        self.cpu_worker = ThreadPoolExecutor(1, "cpu-expert") if self.cpu_share else None
        # run every expert for every micro-batch, as model-based batching does, for
        # comparison only (`moe_layer`'s dense schedule)
        self.dense = False
        images = fetcher.homes.images
        self.homes: dict[int, ExpertHomes] = {
            index: image.experts for index, image in enumerate(images) if image.experts
        }
        homes = list(self.homes.values())
        expert_bytes = max((h.span.expert_bytes for h in homes), default=0)
        depth = min(EXPERT_BUFFERS, max((h.off_gpu for h in homes), default=0))
        self.buffers = torch.empty((depth, expert_bytes), dtype=torch.uint8, device=device)
        ledger.add(Tier.GPU, depth * expert_bytes)
        disk = max((len(h.disk) for h in homes), default=0) * expert_bytes
        # (the memory plan counts the same: `io.layout.expert_buffers`)
        self.staging = [pool.alloc(disk) for _ in range(2)] if disk else []
        self._buffer_free: list = [None] * depth
        self._staging_free: list = [None, None]
        self._turn = 0  # buffers are taken in turn
        self.traffic: dict[int, ExpertTraffic] = {}
        self.job: dict[int, ExpertTraffic] = {}
        # rows routed to each expert of each layer over the job, and their sum at the
        # last rebalance
        self.usage = {index: [0] * h.span.count for index, h in self.homes.items()}
        self._counted = self._rebalanced_at = 0
        self.swaps = 0  # experts moved to the GPU by rebalancing, over the job

    def close(self) -> None:
        for block in self.staging:
            block.free()
        self.staging = []
        if self.cpu_worker is not None:
            self.cpu_worker.shutdown()

    def layer(self, ex, layer: int, w, hidden: list, steps: list, begin: Callable) -> None:
        """A mixture of experts' layer `layer` in executor `ex`: `moe_layer.moe_layer`."""
        moe_layer(ex, layer, w, hidden, steps, begin)

    def run(
        self,
        index: int,
        experts: list[int],
        compute: Callable[[int, tuple], None],
        rows: list[int] | None = None,
        cpu: Callable[[int, tuple], Callable[[], None]] | None = None,
    ) -> None:
        """compute(expert, (mlp_in, mlp_out)) for each of `experts` (ascending) of stage
        `index`, with the weights of each on the GPU when its compute runs. rows: how
        many rows chose each (counted as its usage). cpu(expert, its weights in pinned
        memory): starts an expert on the CPU, returning what adds its output once done;
        given (at decode), the policy's share of the experts in pinned memory (the
        fewest rows first) go to it, started before the others and added after them."""
        homes = self.homes[index]
        for expert, count in zip(experts, rows or (), strict=False):
            self.usage[index][expert] += count
            self._counted += count
        traffic = ExpertTraffic(chosen=len(experts))
        on_cpu = self._cpu_choice(homes, experts, rows) if cpu is not None else set()
        finish = [cpu(e, homes.weights(e, homes.home(e))) for e in experts if e in on_cpu]
        traffic.on_cpu += len(on_cpu)
        experts = [e for e in experts if e not in on_cpu]
        reads = self._start_disk(index, homes, [e for e in experts if homes.tier(e) is Tier.DISK])
        fetched = [e for e in experts if homes.tier(e) is not Tier.GPU]
        ahead = len(self.buffers) if self.overlap else 1
        loaded: dict[int, tuple[int, object]] = {}
        for expert in fetched[:ahead]:
            loaded[expert] = self._fetch(homes, expert, reads, traffic)
        issued = len(loaded)
        for expert in experts:
            if homes.tier(expert) is Tier.GPU:
                traffic.resident += 1
                compute(expert, homes.resident(expert))
                continue
            buffer, event = loaded.pop(expert)
            self.lanes.wait("compute", event)
            compute(expert, homes.weights(expert, self.buffers[buffer]))
            self._buffer_free[buffer] = self.lanes.record("compute")
            if not self.overlap:
                self.lanes.host_wait(self._buffer_free[buffer])
            if issued < len(fetched):
                loaded[fetched[issued]] = self._fetch(homes, fetched[issued], reads, traffic)
                issued += 1
        for done in finish:
            done()
        for counts in (self.traffic, self.job):
            counts.setdefault(index, ExpertTraffic()).add(traffic)

    def _cpu_choice(self, homes: ExpertHomes, experts: list[int], rows: list[int] | None):
        """The policy's share of these experts in pinned memory, the fewest rows first."""
        pinned = [(n, e) for e, n in zip(experts, rows or [0] * len(experts), strict=True)
                  if homes.tier(e) is Tier.CPU]  # fmt: skip
        return {e for _, e in sorted(pinned)[: round(self.cpu_share * len(pinned))]}

    def _fetch(self, homes: ExpertHomes, expert: int, reads: dict, traffic: ExpertTraffic):
        """Copy one expert into the next buffer (after the compute that last read it)."""
        buffer = self._turn % len(self.buffers)
        self._turn += 1
        self.lanes.wait("h2d", self._buffer_free[buffer])
        nbytes = homes.span.expert_bytes
        target = self.buffers[buffer]
        name = f"{homes.key} expert {expert}"
        if expert in reads:
            staged, futures = reads.pop(expert)
            started = time.perf_counter()
            for future in futures:
                future.result()
            self.lanes.tracer.host_span("disk", f"wait {name}", started, time.perf_counter())
            with self.lanes.on("h2d", name, nbytes):
                target.copy_(staged, non_blocking=True)
            traffic.from_disk += 1
            traffic.disk_bytes += nbytes
            self._staging_free[self._parity] = self.lanes.record("h2d")
        else:
            with self.lanes.on("h2d", name, nbytes):
                target.copy_(homes.home(expert), non_blocking=True)
            traffic.from_cpu += 1
        traffic.h2d_bytes += nbytes
        traffic.moved.append(expert)
        return buffer, self.lanes.record("h2d")

    def _start_disk(self, index: int, homes: ExpertHomes, experts: list[int]) -> dict:
        """Issue every disk read of these experts into the stage's half of the staging
        (after the copies that last read it): {expert: (its staged bytes, futures)}."""
        self._parity = index % 2
        if not experts:
            return {}
        self.lanes.host_wait(self._staging_free[self._parity])
        block = self.staging[self._parity]
        first_disk = homes.gpu_slots + homes.cpu_slots
        nbytes = homes.span.expert_bytes
        reads = {}
        submitted = time.perf_counter()
        for expert in experts:
            slot = homes.slot_of[expert]
            at = (slot - first_disk) * nbytes
            futures = []
            for extent, offset in homes.disk[slot]:
                future = self.reader.submit(extent, block, block_offset=at + offset)
                future.add_done_callback(
                    lambda f, e=extent: self.lanes.tracer.host_span(
                        "disk", f"read {e.stage}/{e.name}", submitted, time.perf_counter(), e.nbytes
                    )
                )
                futures.append(future)
            reads[expert] = (block.tensor[at : at + nbytes], futures)
        return reads

    def rebalance(self, now: bool = False) -> int:
        """Between steps: once the rows counted have doubled since the last time (or
        `now`), each layer's most used experts in pinned memory trade places with its
        least used on the GPU (while they took more rows). Returns the swaps made."""
        if not self.movable or not self._counted:
            return 0
        if self._counted < 2 * self._rebalanced_at and not now:
            return 0
        self._rebalanced_at = self._counted
        swaps = 0
        for index, homes in self.homes.items():
            usage = self.usage[index]
            tier = [homes.tier(e) for e in range(homes.span.count)]
            on_gpu = sorted((e for e, t in enumerate(tier) if t is Tier.GPU), key=usage.__getitem__)
            on_cpu = sorted(
                (e for e, t in enumerate(tier) if t is Tier.CPU), key=lambda e: -usage[e]
            )
            for cold, hot in zip(on_gpu, on_cpu, strict=False):
                if usage[hot] <= usage[cold]:
                    break
                homes.swap(cold, hot, self.buffers[0])
                swaps += 1
        if swaps and self.buffers.is_cuda:  # the swaps' copies done before any fetch
            torch.cuda.synchronize(self.buffers.device)
        self.swaps += swaps
        return swaps

    def report(self) -> dict | None:
        """The job's experts, layer by layer and in all: where they live, and how many
        were chosen, used on the GPU, computed on the CPU, copied from pinned memory and
        read from disk, with the bytes (None without experts)."""
        if not self.homes:
            return None
        layers = []
        total = ExpertTraffic()
        for index, homes in self.homes.items():
            traffic = self.job.get(index, ExpertTraffic())
            total.add(traffic)
            tiers = [homes.tier(e).value for e in range(homes.span.count)]
            placed = {t.value: tiers.count(t.value) for t in Tier}
            layers.append({"stage": homes.key, **placed, **traffic.as_dict()})
        nbytes = max(h.span.expert_bytes for h in self.homes.values())
        return {
            "expert_bytes": nbytes,
            "swaps": self.swaps,
            "total": total.as_dict(),
            "layers": layers,
        }

    def step_traffic(self) -> dict[int, ExpertTraffic]:
        """The traffic since the last call, by stage; counting starts afresh."""
        traffic, self.traffic = self.traffic, {}
        return traffic
