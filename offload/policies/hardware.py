"""`HardwareProfile`: this machine's measured figures, cached per machine.

Every rate the cost model uses comes from here, measured by `offload-profile`
(`policies.measure` for the device's rates, `executor.probe` for the executor's own
fixed costs), or read from a profile file of another machine with `--profile`; none is
a constant in code.

A profile records the code version it was measured with (`code_version`: the sources
of the kernels, the executor, the I/O layer and the model math, and the torch and
triton versions). A new kernel, a new triton or a new executor loop makes the cached
figures stale: this machine's cached profile is then measured again.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import platform
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import xxhash

from offload.core.errors import UserError
from offload.io.atomic import atomic_write
from offload.kernels.formats import Compression
from offload.models.demo import cache_dir

log = logging.getLogger(__name__)

GB = 1e9
# the rows of x at which the decode matmul rates are measured (`matmul_gbps`,
# `matmul_gbps_mid`, `matmul_gbps_wide`): the row tiles of the dequantizing kernel
# (`qmatmul_tiles.ROW_TILES`; on Hopper, int4 up to 64 rows: `qmatmul_wgmma`'s wgmma N of 16,
# 32 and 64), each of which runs every row count up to it at its own rate
DECODE_ROWS, MID_DECODE_ROWS, WIDE_DECODE_ROWS = 16, 32, 64
# what the profile's figures depend on (relative to the package): the code they time,
# and how they are measured (a figure measured another way is measured again)
VERSIONED_SOURCES = (
    "kernels",
    "executor",
    "io",
    "models/decoder.py",
    "models/ops.py",
    "models/moe.py",
    "policies/measure.py",
    "policies/measure_cpu_attention.py",
    "policies/measure_disk.py",
    "policies/measure_experts.py",
    "policies/measure_kernels.py",
    "policies/timers.py",
)
# figures that may be zero: "not measured" (the cost model then leaves the term out)
OPTIONAL_FIGURES = (
    "layer_fixed_s",
    "micro_fixed_s",
    "offgpu_kv_s",
    "offgpu_kv_graph_s",
    "disk_kv_s",
    "disk_kv_graph_s",
    "cpu_attention_fixed_s",
    "graph_layer_s",
    "allreduce_gbps",
    "allreduce_latency_s",
    "rank_skew",
    "h2d_all_gbps",
    "h2d_under_cpu_attention_gbps",
    "disk_kv_read_gbps",
    "prefill_attention_tflops",
    "prefill_elementwise_s",
    "matmul_call_s",
    "attention_call_s",
    "attention_pair_s",
    "decode_elementwise_s",
    "cpu_attention_pair_s",
    "cpu_quant_attention_pair_s",
    "expert_fixed_s",
    "cpu_expert_fixed_s",
    "pin_gbps",
    "place_gbps",
)


def format_name(compression: Compression | None) -> str:
    """The key of a storage format in the profile's per-format rates (fp8: none measured
    yet, so its matmuls are costed at the profile's defaults, its bytes at their size)."""
    if compression is not None and compression.fp8:
        return "fp8"
    return "dense" if compression is None else f"int{compression.bits}"


@dataclass(frozen=True)
class HardwareProfile:
    device_name: str
    has_gpu: bool
    gpu_mem_bytes: int
    cpu_mem_bytes: int
    h2d_gbps: float
    d2h_gbps: float
    bidir_gbps: float
    pageable_h2d_gbps: float
    disk_read_gbps: float
    disk_write_gbps: float
    prefill_tflops: float
    decode_tflops: float
    hbm_gbps: float
    cpu_attention_gbps: float
    # the same over a compressed (int4-g64) cache, counting its K/V at the compute dtype
    cpu_quant_attention_gbps: float
    dram_gbps: float
    # pinned host -> GPU copies while the CPU attention reads DRAM beside them: the
    # weight stream of a CPU-attention policy. W1u (OPT-30B, 88 x 1) copied 0.93 GB a
    # layer in 18.4-19.3 ms (48-50 GB/s) where the copy alone ran at 53 (H100 machine;
    # docs/cost_model.md); 0: not measured (the alone rate is used)
    h2d_under_cpu_attention_gbps: float = 0.0
    # the two CPU attention rates above at grouped-query shapes, keyed by the query
    # heads a KV head ("4", "8"; the figures above are one a KV head): the kernel runs
    # every query head of a KV head over each block it reads, so its arithmetic a KV
    # byte grows with the group. Llama-3.1-8B (4 a KV head), 88 x 8: its CPU attention
    # ran at 43 GB/s at most in the executor where the MHA shape measured 97 (H100,
    # validate_cost_model; docs/cost_model.md); missing: the MHA figure stands for every group
    cpu_attention_grouped_gbps: dict[str, float] = field(default_factory=dict)
    cpu_quant_attention_grouped_gbps: dict[str, float] = field(default_factory=dict)
    # per group ("1", "4", "8"): the CPU attention's time a (sequence, KV head) beyond
    # its bytes at the rates above (each work item's query load, softmax, output and
    # last partial block), fitted with the rate from 1024 and 256 slots
    # (`measure_cpu_attention.cpu_attention_rates`). Llama-3.1-8B's executor attended 88 x 8 KV heads
    # x 528 slots at 57.6 GB/s where 64 x 8 x 1024 read 80.5 (H100): about 2.8 us
    # a pair beyond 140 GB/s. Missing or 0: not measured
    cpu_attention_pair_s: dict[str, float] = field(default_factory=dict)
    cpu_quant_attention_pair_s: dict[str, float] = field(default_factory=dict)
    gpu_context_bytes: int = 0  # CUDA context and library workspaces, measured
    process_base_bytes: int = 0  # host RSS of a loaded engine before any weights
    measured_at: str = ""
    # per storage format (`format_name`): the weight bytes a decode-shaped matmul reads
    # a second; the prefill-shaped matmul's TFLOP/s (dense: cuBLAS at 4096 rows; int4
    # and int8: the fused kernel at FUSED_PREFILL_ROWS, as micro-batches of fewer than
    # `qmatmul.DENSE_ROWS` tokens run it); and the stored bytes a second that a
    # compressed matmul of DENSE_ROWS or more rows dequantizes into its scratch before
    # cuBLAS multiplies at the dense rate. Missing formats fall back to hbm_gbps /
    # prefill_tflops
    matmul_gbps: dict[str, float] = field(default_factory=dict)
    # the same at WIDE_DECODE_ROWS (the kernel's 64-row tiles: Llama-3.1-8B int4 at 48
    # rows took 15.5 ms a step against 7.9 predicted from the 16-row rate)
    # and at MID_DECODE_ROWS (its 32-row tiles: at 24 rows Llama-3.1-8B's int4 matmuls
    # read 940 GB/s where a rate interpolated between 16 and 64 rows said 1557, H100;
    # docs/cost_model.md)
    matmul_gbps_wide: dict[str, float] = field(default_factory=dict)
    matmul_gbps_mid: dict[str, float] = field(default_factory=dict)
    prefill_format_tflops: dict[str, float] = field(default_factory=dict)
    dequant_gbps: dict[str, float] = field(default_factory=dict)
    # decode attention on the GPU: the cache bytes (as stored) it reads a second
    gpu_attention_gbps: dict[str, float] = field(default_factory=dict)
    # per format: a decode matmul call's time beyond its bytes at matmul_gbps, and a
    # decode attention call's beyond its cache bytes at gpu_attention_gbps (launch,
    # ramp-up, the last wave), fitted with those rates from a large and a small call.
    # W1c's four matrices averaged 1.75 TB/s where one 8192 x 28672 matrix read 2.0, and
    # its attention 1.1 TB/s where 32 x 32 heads x 2048 slots read 1.95 (H100)
    matmul_call_s: dict[str, float] = field(default_factory=dict)
    attention_call_s: dict[str, float] = field(default_factory=dict)
    # per format: a decode attention's time a (sequence, KV head) beyond its bytes (the
    # query's load, the tail's program, the splits' merge, the output's store), fitted
    # with the two figures above from three calls (`measure_kernels.gpu_attention_rates`). On
    # the H100 dense's is 22 ns and int4's and int8's come out 0:
    # the fit's calls do not show what W1c's shape costs (its int4 attention, 14 x 56
    # heads x 544 slots, read about 1.6 TB/s against the fitted 1.92). 0: not measured
    attention_pair_s: dict[str, float] = field(default_factory=dict)
    # the executor's host time: per layer of a step, per micro-batch of a layer, per
    # layer and micro-batch whose KV lives off the GPU and is attended there (load,
    # store and their handoffs), and per layer of a step replayed from CUDA graphs
    # (`executor.probe`)
    layer_fixed_s: float = 0.0
    micro_fixed_s: float = 0.0
    offgpu_kv_s: float = 0.0
    graph_layer_s: float = 0.0
    # the off-GPU KV's chain a layer and micro-batch where the work between attentions
    # replays from CUDA graphs (every weight on the GPU): measured with the weights on
    # the GPU, where offgpu_kv_s is measured with them streamed. Llama-3.1-8B int4,
    # 8 x 2, every row's KV in CPU homes (H100): 63 ms a step against 28
    # predicted with offgpu_kv_s's 0.26 ms, about 0.75 ms a layer and micro-batch
    offgpu_kv_graph_s: float = 0.0
    # per layer and micro-batch with KV rows on disk, beyond a CPU home's chain: the
    # read's and the write-back's latency and their turns (OPT-30B int4, 8 x 2, one row
    # of each micro-batch on disk: 675 ms a step where the bytes over the disk's
    # sequential rates took 373; docs/cost_model.md)
    disk_kv_s: float = 0.0
    # the same where decode replays graphs (every weight on the GPU), measured with the
    # weights on the GPU beyond offgpu_kv_graph_s's chain
    disk_kv_graph_s: float = 0.0
    # disk KV homes read whole, one after another, beside the launching host thread
    # (`measure_disk.kv_disk_read_rate`): OPT-30B int4, 8 x 2, read 4.4 MB homes in 2.6-2.9
    # ms where the profile's 16 MiB sequential reads measured 2.7 GB/s (H100 machine;
    # docs/io.md); 0: not measured (disk_read_gbps is used)
    disk_kv_read_gbps: float = 0.0
    # per layer and micro-batch attended on the CPU: the fixed part of the CPU
    # attention's chain (Llama-3.1-8B, 8 x 8, H100, validate_cost_model: about 1.3 ms
    # a call beyond the KV bytes over the measured rate; docs/cost_model.md)
    cpu_attention_fixed_s: float = 0.0
    # prefill: masked attention (the executor's `decoder.attend`) in TFLOP/s of
    # 4 x rows x T x S x heads x head_dim, and a layer's time beyond its matmuls and
    # attention (norms, activations, residuals, the KV's quantization and store, the
    # gaps between kernels) per token and hidden unit, per model family
    # (`ModelConfig.family`): on CUDA the wall time beyond the matmul and attention
    # kernels' GPU time (`executor.fixed_costs.elementwise`)
    prefill_attention_tflops: float = 0.0
    prefill_elementwise_s: dict[str, float] = field(default_factory=dict)
    # decode, per model family: a layer's GPU time a micro-batch beyond its matmuls and
    # attention: the other kernels' (norms, activations, residuals, the KV's write) and
    # the short gaps between kernels, measured by kernel name on a full-width layer
    # replayed from CUDA graphs (`executor.timing.decode_kernels`). W1c: 0.7 ms of such
    # kernels and 0.8 ms of gaps in a 14.3 ms step (H100; docs/cost_model.md)
    decode_elementwise_s: dict[str, float] = field(default_factory=dict)
    # tensor parallelism: NCCL all-reduce bus bandwidth and latency between this node's
    # GPUs (measured where there are two or more)
    allreduce_gbps: float = 0.0
    allreduce_latency_s: float = 0.0
    # a mixture of experts' expert phase (`policies.cost_moe`): the executor's time an
    # expert beyond its matmuls' bytes (its gather, activation, weighted add and the
    # host's launches of them), measured over small experts (`measure_experts`)
    expert_fixed_s: float = 0.0
    # an expert computed on the CPU over its pinned weights at a decode's few rows
    # (`kernels.cpu_expert`): the weight bytes it reads a second, per storage format,
    # and its time beyond them (the rows' copies both ways and the hand-off to the
    # worker thread); missing: not measured (no expert is computed on the CPU)
    cpu_expert_gbps: dict[str, float] = field(default_factory=dict)
    cpu_expert_fixed_s: float = 0.0
    # ranks meeting at an all-reduce: the mean time a rank waits there for the slowest,
    # as a share of the host-side work since the last one (the same CPU work on every
    # rank, with each rank's threads on its share of the cores: `parallel.bandwidth`);
    # 0: not measured (the cost model leaves the wait out)
    rank_skew: float = 0.0
    # pinned host -> GPU, each GPU's rate while every GPU of the node copies at once
    # (`parallel.bandwidth`); 0: not measured (each link's own rate, h2d_gbps, stands)
    h2d_all_gbps: float = 0.0
    # how many ranks of a node this profile is the view of (`policies.node.rank_profile`:
    # the shared rates divided among them); a measured profile is the node's, 1
    node_ranks: int = 1
    # the load (`policies.job.load_estimate`): host memory pinned a second for the
    # weights' and the KV homes' pools (`io.pinned.PinnedPool`: mapped, then registered
    # with CUDA), and, per weight format and the tier that holds the bytes
    # ("int4/gpu", "dense/cpu"), the stage bytes (as stored) the executor places a
    # second from dummy weights (drawn and quantized on the device, assembled in host
    # memory, copied to their home: `executor.probe.place_rates`). 0 or missing: not
    # measured (the term is left out)
    pin_gbps: float = 0.0
    place_gbps: dict[str, float] = field(default_factory=dict)
    code_version: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float):
                ok = value >= 0 if f.name in OPTIONAL_FIGURES else value > 0
                if not ok:
                    raise ValueError(f"hardware profile figure {f.name}={value} must be positive")
            if isinstance(value, dict):
                for key, rate in value.items():
                    if not (rate >= 0 if f.name in OPTIONAL_FIGURES else rate > 0):
                        raise ValueError(f"hardware profile figure {f.name}[{key}]={rate} must be positive")  # fmt: skip

    @property
    def default_cpu_cap(self) -> int:
        """The CPU budget when the user gives none: the OS, the page cache and other
        processes keep a tenth of the machine's memory."""
        return int(0.9 * self.cpu_mem_bytes)

    def matmul_rate(self, compression: Compression | None, rows: int = DECODE_ROWS) -> float:
        """GB/s of stored weight bytes a decode-shaped matmul of `rows` rows reads in this
        format: the rate measured at the first of DECODE_ROWS, MID_DECODE_ROWS and
        WIDE_DECODE_ROWS at or above `rows` (the kernel's row tile), WIDE_DECODE_ROWS'
        from there. A profile without the middle figure: the time a byte linear in the
        rows between the other two."""
        name = format_name(compression)
        narrow = self.matmul_gbps.get(name, self.hbm_gbps)
        wide = self.matmul_gbps_wide.get(name)
        if wide is None or rows <= DECODE_ROWS:
            return narrow
        mid = self.matmul_gbps_mid.get(name)
        if mid is not None:
            return mid if rows <= MID_DECODE_ROWS else wide
        share = (min(rows, WIDE_DECODE_ROWS) - DECODE_ROWS) / (WIDE_DECODE_ROWS - DECODE_ROWS)
        return 1 / ((1 - share) / narrow + share / wide)

    def matmul_seconds(
        self, compression: Compression | None, nbytes: float, rows: int, calls: int
    ) -> float:
        """GPU seconds of `calls` decode matmuls of `rows` rows reading `nbytes` stored
        weight bytes in all."""
        fixed = self.matmul_call_s.get(format_name(compression), 0.0)
        return calls * fixed + nbytes / (self.matmul_rate(compression, rows) * GB)

    def prefill_rate(self, compression: Compression | None) -> float:
        return self.prefill_format_tflops.get(format_name(compression), self.prefill_tflops)

    def dequant_rate(self, compression: Compression | None) -> float:
        """GB/s of stored weight bytes that a prefill matmul dequantizes (`dequant_gbps`)."""
        return self.dequant_gbps.get(format_name(compression), self.hbm_gbps)

    def prefill_attention_rate(self) -> float:
        return self.prefill_attention_tflops or self.prefill_tflops

    def attention_rate(self, compression: Compression | None) -> float:
        """GB/s of stored KV bytes that decode attention on the GPU reads."""
        return self.gpu_attention_gbps.get(format_name(compression), self.hbm_gbps)

    def attention_seconds(
        self, compression: Compression | None, nbytes: float, calls: int, pairs: int
    ) -> float:
        """GPU seconds of `calls` decode attentions reading `nbytes` of cache in all, over
        `pairs` (sequence, KV head) pairs in all."""
        name = format_name(compression)
        fixed = calls * self.attention_call_s.get(name, 0.0)
        fixed += pairs * self.attention_pair_s.get(name, 0.0)
        return fixed + nbytes / (self.attention_rate(compression) * GB)

    def cpu_attention_rate(self, group: int, compressed: bool) -> float:
        """GB/s of KV (at the compute dtype's size) that the CPU attention reads with
        `group` query heads a KV head. Between the measured groups the time a byte is
        linear in the group (the arithmetic a byte is); past the largest it grows with
        the last two points' slope, and never falls below the largest group's time."""
        one = self.cpu_quant_attention_gbps if compressed else self.cpu_attention_gbps
        grouped = (
            self.cpu_quant_attention_grouped_gbps if compressed else self.cpu_attention_grouped_gbps
        )
        points = {1: 1 / one} | {int(g): 1 / rate for g, rate in grouped.items()}
        return 1 / _linear_in_group(points, group)

    def cpu_attention_pair(self, group: int, compressed: bool) -> float:
        """Seconds of the CPU attention a (sequence, KV head) beyond its bytes, with
        `group` query heads a KV head (`cpu_attention_pair_s`), linear in the group as
        `cpu_attention_rate`'s time a byte; 0 where not measured."""
        pairs = self.cpu_quant_attention_pair_s if compressed else self.cpu_attention_pair_s
        if not pairs:
            return 0.0
        return _linear_in_group({int(g): s for g, s in pairs.items()}, group)

    def place_rate(self, compression: Compression | None, tier: str) -> float:
        """GB/s of stage bytes in this format that loading places in `tier` ("gpu" or
        "cpu"; a disk's bytes are assembled as a CPU home's are); 0: not measured."""
        return self.place_gbps.get(f"{format_name(compression)}/{tier}", 0.0)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_file(cls, path: Path) -> HardwareProfile:
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            raise UserError(
                f"hardware profile {path} does not exist; run offload-profile"
            ) from None
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            raise UserError(
                f"hardware profile {path} is not valid ({exc}); run offload-profile again"
            ) from None


def _linear_in_group(points: dict[int, float], group: int) -> float:
    """A figure measured at a few groups (query heads a KV head), at `group`: linear
    between the measured groups, the smallest's below them, and past the largest the
    last two points' slope, never below the largest's figure."""
    known = sorted(points.items())
    if group <= known[0][0] or len(known) == 1:
        return known[0][1] if group <= known[0][0] else known[-1][1]
    for (g0, y0), (g1, y1) in itertools.pairwise(known):
        if group <= g1:
            return y0 + (y1 - y0) * (group - g0) / (g1 - g0)
    (g0, y0), (g1, y1) = known[-2], known[-1]
    return max(y1, y1 + (y1 - y0) * (group - g1) / (g1 - g0))


@functools.cache
def code_version() -> str:
    """A digest of the code and libraries whose speed the profile measures."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    root = Path(__file__).resolve().parent.parent
    digest = xxhash.xxh3_64(f"torch {torch.__version__} triton {triton_version}".encode())
    for name in VERSIONED_SOURCES:
        path = root / name
        sources = [path]  # a folder's Python and C sources (the C kernels' too)
        if path.is_dir():
            sources = sorted(p for p in path.rglob("*") if p.suffix in (".py", ".c"))
        for source in sources:
            digest.update(source.relative_to(root).as_posix().encode())
            digest.update(source.read_bytes())
    return digest.hexdigest()


def profile_path() -> Path:
    return cache_dir() / f"hardware-{platform.node() or 'machine'}.json"


def save_profile(hw: HardwareProfile, path: Path | None = None) -> Path:
    """Write the profile atomically (a concurrent reader never sees half a file)."""
    path = path or profile_path()
    atomic_write(path, hw.to_json())
    return path


def load_profile(path: Path | None = None) -> HardwareProfile | None:
    """This machine's cached profile; None when there is none, or when it was measured
    with other code (a stale profile is measured again, not trusted)."""
    path = path or profile_path()
    if not path.is_file():
        return None
    try:
        hw = HardwareProfile.from_file(path)
    except UserError as exc:
        log.warning("%s; measuring again", exc)
        return None
    if hw.code_version != code_version():
        log.warning(
            "the hardware profile %s was measured with other code (version %s, now %s); "
            "measuring again",
            path,
            hw.code_version or "unrecorded",
            code_version(),
        )
        return None
    return hw
