"""The cost model: per-layer lane times of the executor for a policy, and their overlap.

Lanes per layer (bytes over the profile's measured rates, `policies.hardware`):
    h2d      weights not on the GPU (+ off-GPU KV when attention runs on the GPU)
             (with attention on the CPU the weight copy shares DRAM with it: the rate
             measured beside it while the first micro-batch's attention runs)
    disk     weights on disk (+ disk-resident KV read back, and each disk home's
             measured chain: its read's and write-back's latency)
    compute  the larger of 2 x tokens x layer parameters / matmul rate and the kernels'
             time: every micro-batch reads the layer's weights as stored, at the rate
             measured for that format (int4 and int8 through the dequantizing matmul),
             and the KV it attends on the GPU at the rate measured for the KV's format,
             each call with its measured fixed time (and attention a measured time a
             sequence and KV head beyond its bytes), and runs the layer's other kernels
             (norms, activations, the KV's write: measured a layer and micro-batch);
             prefill at the format's measured prefill TFLOP/s; plus, under
             tensor parallelism, two all-reduces a layer and micro-batch; plus, for
             off-GPU KV attended on the GPU, its measured chain a micro-batch
    cpu_attn off-GPU KV / CPU attention rate (attention_on_cpu; over a compressed cache
             its K/V at the dtype's size / the rate measured over a compressed cache;
             each at the model's query heads a KV head, `cpu_attention_rate`), plus a
             measured time a (sequence, KV head) (`cpu_attention_pair`) and a
             measured fixed cost a micro-batch (its copies, waits and the call)
    d2h      new KV entries stored off the GPU (prefill)
    host     the executor's own time: a fixed cost per layer and per micro-batch of a
             layer (launches, Python, stream waits), measured by `executor.probe`; a
             step replayed from CUDA graphs pays the graph's cost instead
    rank_wait  under tensor parallelism, a rank's wait for the slowest of its group at
             the layer's all-reduces (`cost_parallel`); a rank's rates are its share of
             the node's (`policies.node.rank_profile`)
How the executor overlaps them (measured on OPT-30B, docs/executor.md): with attention
on the GPU a layer takes its busiest lane; with attention on the CPU the first micro-
batch's output waits for the layer's weight copy, so a layer takes
max(weights, one micro-batch's attention) + the other micro-batches' attention (each at
least its share of the compute, which runs beside the next one's attention), the last
micro-batch's compute, and the host's issue of each micro-batch's work after its
attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from offload.core.config import ModelConfig
from offload.io.layout import gathered, stage_cuts
from offload.kernels.kv_cache import kv_row_bytes
from offload.kernels.qmatmul import DENSE_ROWS
from offload.models.decoder import LAYER_MATMULS, mlp_chunks
from offload.policies.caps import Baseline, peak_bytes
from offload.policies.cost_moe import expert_steps, fetched_params, streamed_bytes
from offload.policies.cost_parallel import allreduce_s, rank_wait_s
from offload.policies.hardware import GB, HardwareProfile
from offload.policies.memory import MemoryPlan, micro_batch_sizes, plan_memory, row_splits
from offload.policies.policy import Policy


@dataclass(frozen=True)
class Estimate:
    policy: Policy
    prefill_s: float
    decode_step_s: float
    decode_s: float
    total_tok_s: float
    prefill_tok_s: float
    decode_tok_s: float
    bottleneck: str
    lanes_decode_s: dict[str, float]  # per step
    memory: MemoryPlan
    gpu_peak_bytes: int
    cpu_peak_bytes: int
    # a mixture of experts' (`cost_moe.ExpertSteps.facts`); empty for a dense model
    experts: dict[str, float] = field(default_factory=dict)


def _layer_bytes(
    cfg: ModelConfig, policy: Policy, dtype: torch.dtype
) -> tuple[float, float, float, float]:
    """Average per-layer off-GPU and on-disk bytes, the embed + head off-GPU bytes, and
    the average layer's bytes: of a mixture of experts' layer its dense part, which
    streams as a stage (its experts: `cost_moe`)."""
    sizes = streamed_bytes(cfg, dtype, policy.weight_compression)
    cuts = stage_cuts(cfg, dtype, policy.weight_compression, policy.weights)
    off = [max(0, size - g) for size, (g, _) in zip(sizes, cuts, strict=True)]
    if gathered("embed", policy.weights):  # only the block's rows cross, not the table
        off[0] = 0
    disk = [max(0, size - c) for size, (_, c) in zip(sizes, cuts, strict=True)]
    layers = slice(1, len(sizes) - 1)
    n = cfg.num_layers
    return sum(off[layers]) / n, sum(disk[layers]) / n, off[0] + off[-1], sum(sizes[layers]) / n


@dataclass(frozen=True)
class _Shape:
    """What a block of `n_seqs` sequences under a policy puts through each layer: its
    micro-batches and their KV rows by tier, the bytes a token of KV takes (as the GPU
    and CPU read it, and as a disk home writes it), and the layer's weight bytes."""

    n_seqs: int
    elt: int  # bytes an activation element
    sizes: list[int]  # sequences a micro-batch
    splits: list[tuple[int, int, int]]  # a micro-batch's KV rows on GPU, CPU, disk
    slots: int  # KV slots a sequence holds at the end (prompt + new tokens)
    ctx: float  # the average context over the generation
    kv_tok: float  # KV bytes a token and layer, as stored (compressed when compressed)
    write_tok: float  # bytes a decode step writes to a disk row's home
    cpu_attention_gbps: float  # the CPU attention's rate over this cache, in its bytes
    off_w: float  # a layer's weight bytes not on the GPU (average)
    disk_w: float  # a layer's weight bytes on disk (average)
    ends: float  # the embedding's and head's bytes not on the GPU
    layer_w: float  # a layer's weight bytes as stored (average)
    graphs: bool  # decode replays CUDA graphs (`Policy.decode_graphs`; no MoE routing)

    @property
    def micro(self) -> int:
        return max(1, len(self.splits))

    def rows(self, tier: int) -> int:
        """KV rows (sequences) on a tier: 0 GPU, 1 CPU, 2 disk."""
        return sum(split[tier] for split in self.splits)

    def kv_bytes(self, tier: int) -> float:
        """The decode's average KV bytes a layer on a tier."""
        return self.rows(tier) * self.ctx * self.kv_tok


def _shape(
    cfg: ModelConfig,
    policy: Policy,
    dtype: torch.dtype,
    prompt_len: int,
    gen_len: int,
    hw: HardwareProfile,
    batch: int | None,
) -> _Shape:
    n_seqs = batch or policy.block_size
    sizes = micro_batch_sizes(policy, n_seqs)
    slots = prompt_len + gen_len
    full_tok = cfg.kv_entry_width * dtype.itemsize  # one token, one layer (a latent row)
    group = cfg.num_heads // cfg.num_kv_heads  # query heads a KV head
    kv_tok, write_tok = float(full_tok), float(full_tok)
    cpu_attention_gbps = hw.cpu_attention_rate(group, compressed=False)
    if policy.kv_compression is not None:  # compressed bytes a token (the GPU reads)
        kv_tok = kv_row_bytes(cfg.num_kv_heads, cfg.head_dim, slots, dtype, policy.kv_compression)
        kv_tok /= slots
        cpu_attention_gbps = hw.cpu_attention_rate(group, compressed=True) * kv_tok / full_tok
        # a disk home's step writes its entry to the full-precision tail and, once a
        # group, the group's codes
        write_tok = full_tok + kv_tok
    off_w, disk_w, ends, layer_w = _layer_bytes(cfg, policy, dtype)
    return _Shape(
        n_seqs=n_seqs,
        elt=dtype.itemsize,
        sizes=sizes,
        splits=row_splits(policy.kv_cache, sizes),
        slots=slots,
        ctx=prompt_len + gen_len / 2,
        kv_tok=kv_tok,
        write_tok=write_tok,
        cpu_attention_gbps=cpu_attention_gbps,
        off_w=off_w,
        disk_w=disk_w,
        ends=ends,
        layer_w=layer_w,
        graphs=policy.decode_graphs and not cfg.num_experts,
    )


@dataclass(frozen=True)
class _DecodeLanes:
    """A decode step's lane times for one layer (seconds)."""

    h2d: float
    disk: float
    disk_kv: float  # the KV homes' part of `disk`
    compute: float
    host: float
    cpu_attn: float


def estimate(
    cfg: ModelConfig,
    policy: Policy,
    dtype: torch.dtype,
    prompt_len: int,
    gen_len: int,
    hw: HardwareProfile,
    batch: int | None = None,
    tp: int = 1,
    dense_experts: bool = False,
) -> Estimate:
    """The policy's predicted prefill, decode step and throughput for a block of `batch`
    sequences (default: the policy's block). tp: tensor-parallel ranks; cfg is then one
    rank's shard (`parallel.shard`). A mixture of experts' layers add their expert
    phase (`cost_moe`; dense_experts: under the dense schedule)."""
    shape = _shape(cfg, policy, dtype, prompt_len, gen_len, hw, batch)
    lanes = _decode_lanes(cfg, policy, hw, shape, tp)
    if lanes.cpu_attn:
        h2d, layer = _layer_with_cpu_attention_s(lanes, shape, hw)
    else:
        h2d, layer = lanes.h2d, _layer_with_gpu_attention_s(lanes)
    wait = rank_wait_s(lanes.cpu_attn + lanes.host, hw, tp)
    layer += wait
    head_flops = 2 * shape.n_seqs * cfg.vocab_size * cfg.embed_dim
    ends_h2d = shape.ends / (hw.h2d_gbps * GB)
    step = cfg.num_layers * layer + (ends_h2d + head_flops / (hw.decode_tflops * 1e12))
    step_lanes = {
        "h2d": cfg.num_layers * h2d + ends_h2d,
        "disk": cfg.num_layers * lanes.disk,
        "compute": cfg.num_layers * lanes.compute,
        "cpu_attn": cfg.num_layers * lanes.cpu_attn,
        "host": cfg.num_layers * lanes.host,
    }
    if wait:
        step_lanes["rank_wait"] = cfg.num_layers * wait
    prefill = _prefill_s(cfg, policy, hw, shape, prompt_len, tp)
    prefill += ends_h2d + head_flops / (hw.prefill_tflops * 1e12)
    experts = expert_steps(cfg, policy, dtype, hw, shape.sizes, prompt_len, dense_experts)
    if experts is not None:  # a mixture of experts' expert phases
        step, prefill = experts.added(step, prefill, step_lanes)
    decode = (gen_len - 1) * step
    total = prefill + decode
    n_seqs = shape.n_seqs
    plan = plan_memory(cfg, policy, dtype, prompt_len, gen_len)
    gpu_peak, cpu_peak = peak_bytes(plan, Baseline.from_profile(hw))
    return Estimate(
        policy=policy,
        prefill_s=prefill,
        decode_step_s=step,
        decode_s=decode,
        total_tok_s=n_seqs * gen_len / total,
        prefill_tok_s=n_seqs * prompt_len / prefill,
        decode_tok_s=n_seqs * max(gen_len - 1, 1) / max(decode, 1e-12),
        bottleneck=max(step_lanes, key=lambda k: step_lanes[k]),
        lanes_decode_s=step_lanes,
        memory=plan,
        gpu_peak_bytes=gpu_peak,
        cpu_peak_bytes=cpu_peak,
        experts={} if experts is None else experts.facts,
    )


def _decode_lanes(
    cfg: ModelConfig, policy: Policy, hw: HardwareProfile, shape: _Shape, tp: int
) -> _DecodeLanes:
    """A decode step's lanes for one layer, each on its own (overlap comes after)."""
    rows_cpu, rows_disk = shape.rows(1), shape.rows(2)
    kv_c, kv_d = shape.kv_bytes(1), shape.kv_bytes(2)
    h2d = shape.off_w / (hw.h2d_gbps * GB)
    if not policy.attention_on_cpu:  # CPU homes cross whole (all slots), disk pages as read
        h2d += (rows_cpu * shape.slots * shape.kv_tok + kv_d) / (hw.h2d_gbps * GB)
    # the KV homes' part of the disk lane: their reads, write-backs and each home's
    # chain, measured on the path the step takes (`_offgpu_chain_s`)
    disk_kv = kv_d / ((hw.disk_kv_read_gbps or hw.disk_read_gbps) * GB)
    disk_kv += rows_disk * shape.write_tok / (hw.disk_write_gbps * GB)
    homes = sum(1 for _, _, d in shape.splits if d)
    disk_kv += homes * _offgpu_chain_s(shape.graphs, hw, tp, disk=True)
    cpu_attn = 0.0
    if policy.attention_on_cpu:
        group = cfg.num_heads // cfg.num_kv_heads
        pair_s = hw.cpu_attention_pair(group, compressed=policy.kv_compression is not None)
        cpu_attn = (kv_c + kv_d) / (shape.cpu_attention_gbps * GB)
        cpu_attn += (rows_cpu + rows_disk) * cfg.num_kv_heads * pair_s
        cpu_attn += shape.micro * hw.cpu_attention_fixed_s
    return _DecodeLanes(
        h2d=h2d,
        disk=shape.disk_w / (hw.disk_read_gbps * GB) + disk_kv,
        disk_kv=disk_kv,
        compute=_decode_compute_s(cfg, policy, hw, shape, tp),
        host=_host_s(shape.graphs, hw, shape.micro, tp),
        cpu_attn=cpu_attn,
    )


def _decode_compute_s(
    cfg: ModelConfig, policy: Policy, hw: HardwareProfile, shape: _Shape, tp: int
) -> float:
    """A layer's GPU time in a decode step. Every micro-batch reads the layer's weights
    as stored (compressed when compressed) from GPU memory, whichever tier they came
    from, and the KV it attends on the GPU (off-GPU rows from the scratch they were
    loaded into)."""
    micro, n_seqs = shape.micro, shape.n_seqs
    kv_g = shape.kv_bytes(0)
    if policy.attention_on_cpu:
        kv_hbm = kv_g
        gpu_attended = sum(1 for g, _, _ in shape.splits if g)
        gpu_pairs = shape.rows(0) * cfg.num_kv_heads
    else:
        kv_hbm = kv_g + shape.kv_bytes(1) + shape.kv_bytes(2)
        gpu_attended, gpu_pairs = micro, n_seqs * cfg.num_kv_heads
    kernels = sum(
        hw.matmul_seconds(policy.weight_compression, shape.layer_w, size, len(LAYER_MATMULS))
        for size in shape.sizes
    )
    kernels += hw.attention_seconds(policy.kv_compression, kv_hbm, gpu_attended, gpu_pairs)
    # the layer's other kernels and the gaps between them, a micro-batch
    kernels += micro * _elementwise(hw.decode_elementwise_s, cfg)
    params, _ = fetched_params(cfg)
    compute = max(2 * n_seqs * params / (hw.decode_tflops * 1e12), kernels)
    compute += allreduce_s(cfg, hw, tp, n_seqs, micro, shape.elt)
    if shape.rows(1) + shape.rows(2) and not policy.attention_on_cpu:
        # the off-GPU KV's chain a micro-batch (its attention over the scratch, the
        # merge with the GPU rows' and the store of the new entries, and the host's
        # launches of them) runs between the micro-batch's matmuls, not beside them
        # (docs/cost_model.md, "Off-GPU KV attended on the GPU")
        compute += micro * _offgpu_chain_s(shape.graphs, hw, tp)
    return compute


def _layer_with_cpu_attention_s(
    lanes: _DecodeLanes, shape: _Shape, hw: HardwareProfile
) -> tuple[float, float]:
    """(the weight copy's time, the layer's time) with attention on the CPU. The weight
    copy reads DRAM beside the first micro-batch's attention. The host cannot run ahead
    across a CPU attention (it computes it, then issues the rest of the micro-batch's
    layer), so the GPU idles for that issue each micro-batch. The next micro-batch's GPU
    work runs while the CPU attends one (`Executor._one_behind`): a micro-batch after
    the first takes the longer of its attention and its share of the compute, and the
    last one's compute follows its attention (docs/cost_model.md, "CPU attention")."""
    micro = shape.micro
    per_micro = lanes.cpu_attn / micro
    h2d = _copy_beside_attention_s(shape.off_w, per_micro, hw)
    share = lanes.compute / micro
    layer = max(h2d, per_micro, lanes.disk) + (micro - 1) * max(per_micro, share) + share
    return h2d, max(layer + micro * hw.micro_fixed_s, lanes.host)


def _layer_with_gpu_attention_s(lanes: _DecodeLanes) -> float:
    """A layer's time with attention on the GPU: its busiest lane, except that a layer's
    disk KV homes are read, crossed, attended, stored and written back in a chain with
    its compute, not beside it (weights read from disk run ahead of the compute)
    (docs/cost_model.md, "KV on disk")."""
    return max(lanes.h2d, lanes.disk, lanes.compute + lanes.disk_kv, lanes.host)


def _prefill_s(
    cfg: ModelConfig,
    policy: Policy,
    hw: HardwareProfile,
    shape: _Shape,
    prompt_len: int,
    tp: int,
) -> float:
    """The prefill's layers: one step over the prompt, each layer its busiest lane."""
    n_seqs, micro = shape.n_seqs, shape.micro
    tokens = n_seqs * prompt_len
    attn_flops = 4 * n_seqs * prompt_len * prompt_len * cfg.num_heads * cfg.head_dim
    compute = (
        _prefill_matmul_s(cfg, policy, hw, shape.sizes, prompt_len, shape.layer_w)
        + attn_flops / (hw.prefill_attention_rate() * 1e12)
        + tokens * cfg.hidden_size * _elementwise(hw.prefill_elementwise_s, cfg)
        + allreduce_s(cfg, hw, tp, tokens, micro, shape.elt)
    )
    rows_off = shape.rows(1) + shape.rows(2)
    h2d = shape.off_w / (hw.h2d_gbps * GB)
    d2h = rows_off * prompt_len * shape.kv_tok / (hw.d2h_gbps * GB)
    disk = shape.disk_w / (hw.disk_read_gbps * GB)
    disk += shape.rows(2) * prompt_len * shape.kv_tok / (hw.disk_write_gbps * GB)
    host = _host_s(shape.graphs, hw, micro, tp, decode=False)
    return cfg.num_layers * max(compute, h2d, d2h, disk, host)


def _prefill_matmul_s(
    cfg: ModelConfig,
    policy: Policy,
    hw: HardwareProfile,
    sizes: list[int],
    prompt_len: int,
    stored: float,
) -> float:
    """A layer's prefill matmuls, micro-batch by micro-batch of `sizes` sequences, as the
    executor calls them: the attention's over the micro-batch's rows, the MLP's in
    `decoder.mlp_chunks`. A compressed weight multiplies in the fused
    kernel below `qmatmul.DENSE_ROWS` rows; from there each call dequantizes the
    weight into a scratch and cuBLAS multiplies at the dense rate (`kernels.qmatmul`),
    so the dequantization is a term of its own (docs/cost_model.md, "Prefill").
    stored: a layer's bytes as stored."""
    compression = policy.weight_compression
    params, mlp = fetched_params(cfg)
    dense = hw.prefill_rate(None) * 1e12

    def calls(share: float, rows: list[int]) -> float:
        seconds = 0.0
        for m in rows:
            flops = 2 * m * params * share
            if compression is None:
                seconds += flops / dense
            elif m >= DENSE_ROWS:
                seconds += flops / dense + stored * share / (hw.dequant_rate(compression) * GB)
            else:
                seconds += flops / (hw.prefill_rate(compression) * 1e12)
        return seconds

    total = 0.0
    for size in sizes:
        rows = size * prompt_len
        chunks = mlp_chunks(rows, compression is not None)
        total += calls(1 - mlp / params, [rows]) + calls(mlp / params, chunks)
    return total


def _copy_beside_attention_s(nbytes: float, attention_s: float, hw: HardwareProfile) -> float:
    """Seconds to copy nbytes host -> GPU while the CPU attention reads DRAM during the
    first attention_s of them: at the rate measured beside it while it runs, then at
    the copy's own (docs/cost_model.md, "CPU attention")."""
    alone = hw.h2d_gbps * GB
    shared = (hw.h2d_under_cpu_attention_gbps or hw.h2d_gbps) * GB
    if nbytes <= shared * attention_s:
        return nbytes / shared
    return attention_s + (nbytes - shared * attention_s) / alone


def _host_s(graphs: bool, hw: HardwareProfile, micro: int, tp: int, decode: bool = True) -> float:
    """The executor's host time a layer (0 where the profile has not measured it);
    graphs: decode replays CUDA graphs (`_Shape.graphs`)."""
    if decode and tp == 1 and hw.has_gpu and graphs and hw.graph_layer_s:
        return micro * hw.graph_layer_s
    return hw.layer_fixed_s + micro * hw.micro_fixed_s


def _offgpu_chain_s(graphs: bool, hw: HardwareProfile, tp: int, disk: bool = False) -> float:
    """The off-GPU KV's chain a layer and micro-batch (attention on the GPU), or with
    `disk` a disk home's beyond it: measured on the path the step takes, replayed from
    graphs or eager (`_host_s`'s choice)."""
    graphs = tp == 1 and hw.has_gpu and graphs
    if disk:  # (0: not measured, as in a profile from before the figure)
        return hw.disk_kv_graph_s if graphs and hw.disk_kv_graph_s else hw.disk_kv_s
    return hw.offgpu_kv_graph_s if graphs and hw.offgpu_kv_graph_s else hw.offgpu_kv_s


def _elementwise(figures: dict[str, float], cfg: ModelConfig) -> float:
    """A layer's measured elementwise time for the family's probe (`core.family`); a
    profile measured before that probe ran: the largest figure it has (an upper bound
    among the probed families), never a silent zero."""
    probe = cfg.record.elementwise_probe
    if probe in figures:
        return figures[probe]
    return max(figures.values(), default=0.0)
