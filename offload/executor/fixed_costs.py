"""The executor's own fixed costs and a layer's time beyond its matmuls and attention,
measured on this machine for the hardware profile (`probe.measure_profile`).

`overheads`: the host time a layer and a micro-batch of a layer cost, eager and replayed
from CUDA graphs, and the chains of KV homes off the GPU and on disk. They are measured
on a narrow model whose transfers and kernels take next to nothing, so what is left is
launches, Python and stream waits. `elementwise`: a prefill layer's and a decode step's
time beyond their matmuls and attention, per model family, measured on a full-width
layer.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from pathlib import Path

import torch

from offload.core.config import ModelConfig
from offload.core.presets import PRESETS
from offload.executor.executor import Executor
from offload.executor.timing import decode_kernels, decode_seconds, profiled_kernels, synced_seconds
from offload.kernels.formats import Compression
from offload.models.batch import PaddedBatch
from offload.models.decoder import LAYER_MATMULS
from offload.models.weights import DummySource
from offload.policies.hardware import HardwareProfile
from offload.policies.policy import Placement, Policy

# the narrow model the fixed costs are measured on (OPT's layer: its launches are the
# executor's typical; 128 wide, so a layer's copies and kernels are microseconds)
OVERHEAD_LAYERS = 12
OVERHEAD_CONFIG = {
    **PRESETS["opt-6.7b"],
    "hidden_size": 128,
    "num_attention_heads": 2,
    "ffn_dim": 512,
    "word_embed_proj_dim": 128,
    "num_hidden_layers": OVERHEAD_LAYERS,
    "vocab_size": 512,
}
PROBE_DEPTHS = (2, 4)  # layers of a two-depth probe's runs (their difference is a layer's)
# the layers a prefill's non-matmul time is measured on, one a model family (their
# norms, activations, position encodings and residuals differ: Llama-3.1-8B's cost 9x
# OPT's a token and hidden unit on the H100; docs/cost_model.md):
# 4096 wide on the GPU (its matmuls at a realistic width), 256 where the CPU computes;
# (rows, prompt tokens) of the block
_CPU_WIDTH = {"hidden_size": 256, "num_attention_heads": 4, "vocab_size": 512}
ELEMENTWISE_CONFIGS = {
    "opt": {**PRESETS["opt-6.7b"], "vocab_size": 512},
    "bloom": {**PRESETS["bloom"], "hidden_size": 4096, "n_head": 32, "vocab_size": 512},
    "llama": {**PRESETS["llama-3.1-8b"], "vocab_size": 512},
}
_CPU_NARROW = {
    "opt": {"ffn_dim": 1024, "word_embed_proj_dim": 256},
    "bloom": {"n_head": 4},
    "llama": {"num_key_value_heads": 2, "intermediate_size": 768},
}
ELEMENTWISE_SHAPE = {"cuda": (8, 512), "cpu": (2, 64)}


def _narrow_executor(
    policy: Policy, device: torch.device, rows: int, steps: int, nvme: Path | None = None
) -> tuple[Executor, PaddedBatch]:
    """An executor of the narrow model under `policy` (disk homes in `nvme`), its batch
    of `rows` started and prefilled, with room for `steps` decode steps after two that
    compile and capture graphs."""
    cfg = ModelConfig.from_hf(OVERHEAD_CONFIG, "overhead-probe")
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    ex = Executor(DummySource(cfg), policy, dtype, device, nvme_dir=nvme)
    try:
        batch = PaddedBatch(cfg, [[5] * 8] * rows, 2 + steps + 2, pad_id=1)
        ex.start(batch)
        ex.forward(batch.prompt_ids, ex.step_inputs(batch, 0, 8))
    except BaseException:
        ex.close()
        raise
    return ex, batch


def _stage_seconds(
    policy: Policy, device: torch.device, rows: int, steps: int, nvme: Path | None = None
) -> float:
    """A decode step's wall time a stage (the layers, the embedding and the head), on
    the narrow model under `policy` (disk homes in `nvme`)."""
    ex, batch = _narrow_executor(policy, device, rows, steps, nvme)
    try:
        return decode_seconds(ex, batch, 8, steps) / (ex.cfg.num_layers + 2)
    finally:
        ex.close()


# decode steps of each policy in a chain probe (`_chains`). Its figures are differences
# between decode steps of a few ms. Timed apart (each policy's median over 8 steps in an
# executor of its own, the median of three rounds) they spread 9-46% between processes
# on one machine; paired step by step, 8-30% (H100, three processes each;
# docs/cost_model.md). What is left is the host's own speed
# from process to process: the graph replay's fixed cost, timed alike in both, spread
# 40-45%
CHAIN_STEPS = 32


def _chains(policies: list[Policy], device: torch.device, steps: int, nvme: Path) -> list[float]:
    """A decode step's time a stage of each policy beyond the one before it (4 micro-
    batches of one row). The policies' executors live side by side and take their
    steps in turn, each synchronized: a step's difference pairs steps taken a few ms
    apart, so a drift of the machine (clocks, the host's other work) falls on both
    alike. The median over `steps` such pairs."""
    executors: list[tuple[Executor, PaddedBatch]] = []
    try:
        for policy in policies:
            executors.append(_narrow_executor(policy, device, 4, steps, nvme))
        ids = torch.ones(4, 1, dtype=torch.long)

        def step(ex: Executor, batch: PaddedBatch, slot: int) -> float:
            inputs = ex.step_inputs(batch, slot, 1)
            return synced_seconds(device, lambda: ex.forward(ids, inputs))

        for slot in (8, 9):  # compiles, captures graphs
            for ex, batch in executors:
                step(ex, batch, slot)
        beyond: list[list[float]] = [[] for _ in policies[1:]]
        for slot in range(10, 10 + steps):
            times = [step(ex, batch, slot) for ex, batch in executors]
            for into, (before, after) in zip(beyond, itertools.pairwise(times), strict=True):
                into.append(after - before)
        stages = executors[0][0].cfg.num_layers + 2
        return [statistics.median(b) / stages for b in beyond]
    finally:
        for ex, _ in executors:
            ex.close()


def overheads(
    device: torch.device, nvme: Path, steps: int = 8, chain_steps: int = CHAIN_STEPS
) -> dict[str, float]:
    """The executor's fixed costs: per stage, per micro-batch of a stage, per layer and
    micro-batch whose KV lives off the GPU and is attended there (its load, store and
    the handoffs between them), the same whose KV lives on disk in `nvme` beyond a CPU
    home's (the read's and the write-back's latency and their turns through the
    staging blocks), per layer and micro-batch attended on the CPU (the copies of q, k,
    v and the output, their waits, the call; 0 without CUDA, where all attention is
    the CPU's), per stage of a step replayed from CUDA graphs, and the off-GPU KV's
    and the disk's chains on that path, the weights on the GPU (all 0 without CUDA).
    The chains are medians of `chain_steps` paired steps (`_chains`)."""
    streamed = Placement(0.0, 1.0, 0.0)  # every stage crosses: the eager path's work
    one = _stage_seconds(Policy(1, 1, weights=streamed), device, 1, steps)
    four = _stage_seconds(Policy(1, 4, weights=streamed), device, 4, steps)
    int4 = Compression(4, 64, False)
    on_cpu = Policy(1, 4, weights=streamed, kv_cache=streamed, attention_on_cpu=True)
    four_cpu = _stage_seconds(on_cpu, device, 4, steps) if device.type == "cuda" else four
    stages_per_layer = (OVERHEAD_LAYERS + 2) / OVERHEAD_LAYERS  # KV lives in layers only
    per_block = stages_per_layer / 4  # a stage's time over 4 micro-batches, a layer's

    def kv_chains(weights: Placement) -> list[float]:
        """(off-GPU chain, disk chain beyond it) with the weights in `weights`."""
        plain = Policy(1, 4, weights=weights)
        off_gpu = Policy(1, 4, weights=weights, kv_cache=streamed, kv_compression=int4)
        on_disk = dataclasses.replace(off_gpu, kv_cache=Placement(0, 0, 1))
        return [
            max(0.0, t * per_block)
            for t in _chains([plain, off_gpu, on_disk], device, chain_steps, nvme)
        ]

    offgpu, disk = kv_chains(streamed)
    micro = max(0.0, (four - one) / 3)
    graph = graph_kv = graph_disk = 0.0
    if device.type == "cuda":
        graph = _stage_seconds(Policy(1, 1), device, 1, steps)
        # the same chains where the weights stay on the GPU and the work between
        # attentions replays from graphs: there no weight copy's wait hides them
        graph_kv, graph_disk = kv_chains(Placement(1.0, 0.0, 0.0))
    return {
        "layer_fixed_s": max(0.0, one - micro),
        "micro_fixed_s": micro,
        "offgpu_kv_s": offgpu,
        "offgpu_kv_graph_s": graph_kv,
        "disk_kv_s": disk,
        "disk_kv_graph_s": graph_disk,
        "cpu_attention_fixed_s": max(0.0, (four_cpu - four) / 4 * stages_per_layer),
        "graph_layer_s": graph,
    }


def _full_width_seconds(
    cfg: ModelConfig, device: torch.device, rows: int, tokens: int, steps: int = 8
) -> tuple[tuple[float, float | None], tuple[float, float]]:
    """Prefill and decode of `rows` x `tokens`, every weight on the device (decode
    replayed from CUDA graphs there). Prefill: the fastest of three after one that
    compiles, and on CUDA the GPU time of its matmul and attention kernels
    (`profiled_kernels`; None on the CPU). Decode: on CUDA a step's unmodeled kernels
    and gaps (`decode_kernels`), on the CPU its median wall time (`decode_seconds`)
    and no gaps."""
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    ex = Executor(DummySource(cfg), Policy(rows, 1), dtype, device)
    try:
        batch = PaddedBatch(cfg, [[5] * tokens] * rows, 2 * steps + 4, pad_id=1)
        ex.start(batch)

        def prefill() -> None:
            ex.forward(batch.prompt_ids, ex.step_inputs(batch, 0, tokens))

        times = [synced_seconds(device, prefill) for _ in range(4)]
        modeled = profiled_kernels(device, prefill)[0] if device.type == "cuda" else None
        step = decode_seconds(ex, batch, tokens, steps)
        if device.type == "cuda":
            decode = decode_kernels(ex, batch, tokens + steps + 2, steps)
            return (min(times[1:]), modeled), decode
        return (min(times[1:]), modeled), (step, 0.0)
    finally:
        ex.close()


def _elementwise_config(family: str, device: torch.device) -> ModelConfig:
    config = ELEMENTWISE_CONFIGS[family]
    if device.type != "cuda":
        config = {**config, **_CPU_WIDTH, **_CPU_NARROW[family]}
    return ModelConfig.from_hf(config, f"elementwise-probe-{family}")


def elementwise(hw: HardwareProfile, device: torch.device) -> dict[str, dict[str, float]]:
    """Per model family (`ModelConfig.family`), a full-width layer's time beyond its
    matmuls and attention, from the difference of a 4- and a 2-layer model: in prefill
    per token and hidden unit (norms, activations, position encodings, residuals, the
    KV's store and the gaps between kernels: `prefill_elementwise_s`), the wall time
    beyond the matmul and attention kernels' GPU time on CUDA, beyond the matmuls and
    attention as `hw` rates them on the CPU; in a decode step a layer and micro-batch
    (`decode_elementwise_s`): on CUDA the GPU time of the kernels other than the
    matmuls and the attention and the short gaps between kernels (`decode_kernels`),
    so that the figure holds none of those kernels' own errors; on the CPU the step's
    time beyond its matmuls and attention as `hw` rates them."""
    rows, tokens = ELEMENTWISE_SHAPE[device.type]
    prefill, decode = {}, {}
    for family in ELEMENTWISE_CONFIGS:
        cfg = _elementwise_config(family, device)
        ((p_lo, m_lo), (d_lo, gaps_lo)), ((p_hi, m_hi), (d_hi, gaps_hi)) = (
            _full_width_seconds(dataclasses.replace(cfg, num_layers=depth), device, rows, tokens)
            for depth in PROBE_DEPTHS
        )
        layers = PROBE_DEPTHS[1] - PROBE_DEPTHS[0]
        if m_lo is not None:  # the matmul and attention kernels as they ran
            residual = max(0.0, (p_hi - m_hi - p_lo + m_lo) / layers)
        else:
            params = cfg.layer_param_count()
            matmuls = 2 * rows * tokens * params / (hw.prefill_rate(None) * 1e12)
            attention = 4 * rows * tokens**2 * cfg.num_heads * cfg.head_dim
            attention /= hw.prefill_attention_rate() * 1e12
            residual = max(0.0, (p_hi - p_lo) / layers - matmuls - attention)
        prefill[family] = residual / (rows * tokens * cfg.hidden_size)
        per_layer = (d_hi - d_lo + gaps_hi - gaps_lo) / layers
        if device.type != "cuda":  # the CPU's step: its matmuls and attention as rated
            weights = cfg.layer_param_count() * 4
            cache = rows * tokens * 2 * cfg.num_kv_heads * cfg.head_dim * 4
            per_layer -= hw.matmul_seconds(None, weights, rows, len(LAYER_MATMULS))
            per_layer -= hw.attention_seconds(None, cache, 1, rows * cfg.num_kv_heads)
        decode[family] = max(0.0, per_layer)
    return {"prefill_elementwise_s": prefill, "decode_elementwise_s": decode}
