"""Timed probes of the executor itself, on this machine.

Two uses:
- `measure_profile`: `measure.measure`'s device rates plus the executor's own fixed
  costs (`overheads`): the host time a layer and a micro-batch of a layer cost, eager and
  replayed from CUDA graphs. They are measured on a narrow model whose transfers and
  kernels take next to nothing, so what is left is launches, Python and stream waits.
  And a prefill layer's time beyond its matmuls and attention (`prefill_elementwise`),
  measured on a full-width layer.
- `probe_plan`: a candidate plan run for real at its shapes (the block, the prompt, the
  weight and KV split, the formats), cut to a few layers: `offload-plan --verify`
  times the search's best few this way and keeps the fastest measured. Two depths
  separate a layer's time from the embedding's and the head's, and the full model's
  prefill and decode step are extrapolated from them.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from offload.core.config import ModelConfig
from offload.core.presets import PRESETS
from offload.executor.executor import Executor
from offload.executor.load_rates import place_rates
from offload.kernels.formats import Compression
from offload.models.batch import PaddedBatch
from offload.models.decoder import LAYER_MATMULS
from offload.models.weights import DummySource
from offload.policies.hardware import HardwareProfile
from offload.policies.measure import measure
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
PROBE_DEPTHS = (2, 4)  # layers of a plan probe's two runs
# a plan probe's timed prefills a cut (a 70B-class plan's 4-layer prefill takes seconds)
# and decode steps a cut (milliseconds each: their spread is what the probe multiplies)
PREFILL_TURNS, DECODE_TURNS = 3, 9
# the layers a prefill's non-matmul time is measured on, one a model family (their
# norms, activations, position encodings and residuals differ: Llama-3.1-8B's cost 9x
# OPT's a token and hidden unit on the H100 machine, validate_cost_model 000155):
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _synced_seconds(device: torch.device, fn) -> float:
    """Wall time of fn(), from an idle device to the end of its work."""
    _sync(device)
    began = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - began


def _decode_seconds(ex: Executor, batch: PaddedBatch, start: int, steps: int) -> float:
    """The median wall time of `steps` decode steps from slot `start` (after two that
    compile and capture graphs), each step synchronized: one slow step (a page fault, a
    clock change) would otherwise be multiplied by the layers a probe extrapolates to."""
    ids = torch.ones(batch.size, 1, dtype=torch.long)
    ex.forward(ids, ex.step_inputs(batch, start, 1))  # compiles, captures graphs
    ex.forward(ids, ex.step_inputs(batch, start + 1, 1))
    times = [
        _synced_seconds(ex.device, lambda t=t: ex.forward(ids, ex.step_inputs(batch, start + t, 1)))
        for t in range(2, steps + 2)
    ]
    return statistics.median(times)


# kernels the cost model times itself, by name: the matmuls (ours and cuBLAS's) and the
# attention (ours and SDPA's); `_profiled_kernels` separates them from the others
MODELED_KERNELS = ("_qmatmul_kernel", "gemm", "gemv", "nvjet", "cutlass", "xmma", "attention",
                   "flash", "fmha")  # fmt: skip
# a gap between two kernels of a step: the GPU waiting on a launch the host has already
# issued (a graph's, an eager kernel's: 1-3 us on the H100). Longer ones are the host
# behind the GPU (the host lane's) or the work between two steps (the loop's)
STEP_GAP_S = 20e-6


def _profiled_kernels(device: torch.device, run) -> tuple[float, float, list[float]]:
    """One run() under the torch profiler (CUPTI sees the kernels of a graph's replay):
    the GPU seconds in kernels the cost model times itself (`MODELED_KERNELS`: the
    matmuls and the attention), in the others (norms, activations, residuals, the KV's
    write), and the gaps between kernels, each in seconds."""
    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        _sync(device)
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and e.device_time > 0]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    modeled = other = 0.0
    for e in kernels:
        seconds = (e.time_range.end - e.time_range.start) / 1e6
        if any(name in e.name.lower() for name in MODELED_KERNELS):
            modeled += seconds
        else:
            other += seconds
    return modeled, other, [(b[0] - a[1]) / 1e6 for a, b in itertools.pairwise(spans)]


def _decode_kernels(
    ex: Executor, batch: PaddedBatch, start: int, steps: int
) -> tuple[float, float]:
    """A decode step's GPU time in kernels that the cost model does not time itself,
    and in gaps between kernels of STEP_GAP_S or less (`_profiled_kernels`), after
    `_decode_seconds`' warm-up."""
    ids = torch.ones(batch.size, 1, dtype=torch.long)

    def run() -> None:
        for t in range(steps):
            ex.forward(ids, ex.step_inputs(batch, start + t, 1))

    _, other, gaps = _profiled_kernels(ex.device, run)
    waited = sum(gap for gap in gaps if 0 < gap <= STEP_GAP_S)
    return other / steps, waited / steps


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
        return _decode_seconds(ex, batch, 8, steps) / (ex.cfg.num_layers + 2)
    finally:
        ex.close()


# decode steps of each policy in a chain probe (`_chains`). Its figures are differences
# between decode steps of a few ms. Timed apart (each policy's median over 8 steps in an
# executor of its own, the median of three rounds) they spread 9-46% between processes
# on one machine; paired step by step, 8-30% (H100 call c91, three processes each,
# `overheads_paired_ab_h100_20261125-1620.json`). What is left is the host's own speed
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
            return _synced_seconds(device, lambda: ex.forward(ids, inputs))

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
    (`_profiled_kernels`; None on the CPU). Decode: on CUDA a step's unmodeled kernels
    and gaps (`_decode_kernels`), on the CPU its median wall time (`_decode_seconds`)
    and no gaps."""
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    ex = Executor(DummySource(cfg), Policy(rows, 1), dtype, device)
    try:
        batch = PaddedBatch(cfg, [[5] * tokens] * rows, 2 * steps + 4, pad_id=1)
        ex.start(batch)

        def prefill() -> None:
            ex.forward(batch.prompt_ids, ex.step_inputs(batch, 0, tokens))

        times = [_synced_seconds(device, prefill) for _ in range(4)]
        modeled = _profiled_kernels(device, prefill)[0] if device.type == "cuda" else None
        step = _decode_seconds(ex, batch, tokens, steps)
        if device.type == "cuda":
            decode = _decode_kernels(ex, batch, tokens + steps + 2, steps)
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
    matmuls and the attention and the short gaps between kernels (`_decode_kernels`),
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


def measure_profile(nvme: Path | None, quick: bool = True) -> HardwareProfile:
    """This machine's profile: the device's rates and the executor's own costs."""
    hw = measure(nvme, quick=quick)
    device = torch.device("cuda" if hw.has_gpu else "cpu")
    spill = nvme or Path(tempfile.gettempdir())
    chain_steps = CHAIN_STEPS // 4 if quick else CHAIN_STEPS
    hw = dataclasses.replace(hw, **overheads(device, spill, 4 if quick else 8, chain_steps))
    hw = dataclasses.replace(hw, place_gbps=place_rates(device))
    return dataclasses.replace(hw, **elementwise(hw, device))


@dataclass(frozen=True)
class Probe:
    """A plan's measured prefill and decode step, extrapolated to the whole model."""

    prefill_s: float
    decode_step_s: float
    total_tok_s: float
    seconds_spent: float  # what probing this plan cost, loading included


def _run_depths(
    cfg: ModelConfig,
    policy: Policy,
    dtype: torch.dtype,
    device: torch.device,
    prompt_len: int,
    gen_len: int,
    nvme: Path | None,
    steps: int,
) -> list[tuple[float, float]]:
    """(prefill s, decode step s) of the plan on cfg cut to each of PROBE_DEPTHS layers.

    Both cuts are loaded side by side and timed in turns, so a drift of the machine's
    speed during the probe (clocks, the host) falls on both alike: the probe takes
    their difference a layer and multiplies it by the model's layers. Run one after the
    other, a W1c plan's 4-layer step drifted between 1.73 and 2.20 ms, and the probe
    read 0.115 ms a layer at gen 256 against 0.295 at gen 32 (H100, 2026-11-25).
    Untimed first: a prefill (it compiles what the job's warm-up would) and two decode
    steps (they compile and capture graphs). Timed: the median of PREFILL_TURNS turns of
    the prefill, and of `steps` turns of decode steps at the middle of the generation,
    where the cost model averages the context."""
    cuts: list[tuple[Executor, PaddedBatch]] = []
    prompts = [[5 + row % 100] * prompt_len for row in range(policy.block_size)]
    try:
        for depth in PROBE_DEPTHS:
            cut = dataclasses.replace(cfg, num_layers=depth)
            ex = Executor(DummySource(cut), policy, dtype, device, nvme_dir=nvme)
            cuts.append((ex, PaddedBatch(cut, prompts, gen_len + steps + 2, pad_id=1)))
        ids = torch.ones(policy.block_size, 1, dtype=torch.long)
        middle = prompt_len + gen_len // 2

        def prefill(ex: Executor, batch: PaddedBatch) -> None:
            ex.forward(batch.prompt_ids, ex.step_inputs(batch, 0, prompt_len))

        def decode(ex: Executor, batch: PaddedBatch, t: int) -> None:
            ex.forward(ids, ex.step_inputs(batch, middle + t, 1))

        for ex, batch in cuts:
            ex.start(batch)
            _synced_seconds(device, functools.partial(prefill, ex, batch))
            ex.kv.settle()
        prefills = _turns(device, cuts, [prefill] * PREFILL_TURNS)
        for ex, batch in cuts:
            decode(ex, batch, 0)
            decode(ex, batch, 1)
            _sync(device)
            ex.kv.settle()  # no transfer thread's CUDA call inside the other's capture
        steps_at = [functools.partial(decode, t=t) for t in range(2, steps + 2)]
        return list(zip(prefills, _turns(device, cuts, steps_at), strict=True))
    finally:
        for ex, _ in cuts:
            ex.close()


def _turns(device: torch.device, cuts, runs: list) -> list[float]:
    """Per cut, the median synchronized time of run(ex, batch) over `runs`, the cuts
    taking turns at each."""
    times: list[list[float]] = [[] for _ in cuts]
    for run in runs:
        for seconds, (ex, batch) in zip(times, cuts, strict=True):
            seconds.append(_synced_seconds(device, functools.partial(run, ex, batch)))
            ex.kv.settle()
    return [statistics.median(seconds) for seconds in times]


def probe_plan(
    cfg: ModelConfig,
    policy: Policy,
    dtype: torch.dtype,
    device: torch.device,
    prompt_len: int,
    gen_len: int,
    nvme: Path | None = None,
    steps: int = DECODE_TURNS,
) -> Probe:
    """Run the plan at its shapes on PROBE_DEPTHS layers and extrapolate to cfg's."""
    began = time.perf_counter()
    (p_lo, d_lo), (p_hi, d_hi) = _run_depths(
        cfg, policy, dtype, device, prompt_len, gen_len, nvme, steps
    )
    shallow, deep = PROBE_DEPTHS
    layers = deep - shallow

    def whole(lo: float, hi: float) -> float:
        per_layer = max(0.0, (hi - lo) / layers)
        ends = max(0.0, lo - shallow * per_layer)  # the embedding and the head
        return ends + cfg.num_layers * per_layer

    prefill, step = whole(p_lo, p_hi), whole(d_lo, d_hi)
    total = prefill + (gen_len - 1) * step
    return Probe(
        prefill_s=prefill,
        decode_step_s=step,
        total_tok_s=policy.block_size * gen_len / total,
        seconds_spent=time.perf_counter() - began,
    )


def verify(
    cfg: ModelConfig,
    plans: list,
    dtype: torch.dtype,
    device: torch.device,
    prompt_len: int,
    gen_len: int,
    nvme: Path | None = None,
) -> list[tuple[object, Probe]]:
    """Probe each searched plan (`policies.cost.Estimate`); (estimate, probe) pairs,
    the fastest measured first."""
    probed = [
        (est, probe_plan(cfg, est.policy, dtype, device, prompt_len, gen_len, nvme))
        for est in plans
    ]
    return sorted(probed, key=lambda pair: -pair[1].total_tok_s)
