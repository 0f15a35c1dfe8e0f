"""Timed probes of the executor on this machine.

- `measure_profile`: this machine's hardware profile, `measure.measure`'s device rates
  plus the executor's own fixed costs and elementwise time (`executor.fixed_costs`).
- `probe_plan`: a candidate plan run for real at its shapes (the block, the prompt, the
  weight and KV split, the formats), cut to a few layers: `offload-plan --verify`
  times the search's best few this way and keeps the fastest measured. Two depths
  separate a layer's time from the embedding's and the head's, and the full model's
  prefill and decode step are extrapolated from them.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from offload.core.config import ModelConfig
from offload.executor.executor import Executor
from offload.executor.fixed_costs import CHAIN_STEPS, PROBE_DEPTHS, elementwise, overheads
from offload.executor.load_rates import place_rates
from offload.executor.timing import sync, synced_seconds
from offload.models.batch import PaddedBatch
from offload.models.weights import DummySource
from offload.policies.hardware import HardwareProfile
from offload.policies.measure import measure, said
from offload.policies.policy import Policy

# a plan probe's timed prefills a cut (a 70B-class plan's 4-layer prefill takes seconds)
# and decode steps a cut (milliseconds each: their spread is what the probe multiplies)
PREFILL_TURNS, DECODE_TURNS = 3, 9


def measure_profile(nvme: Path | None, quick: bool = True) -> HardwareProfile:
    """This machine's profile: the device's rates and the executor's own costs."""
    hw = measure(nvme, quick=quick)
    device = torch.device("cuda" if hw.has_gpu else "cpu")
    spill = nvme or Path(tempfile.gettempdir())
    chain_steps = CHAIN_STEPS // 4 if quick else CHAIN_STEPS
    started = time.perf_counter()
    fixed = overheads(device, spill, 4 if quick else 8, chain_steps)
    said("the executor's fixed costs", started, **fixed)
    started = time.perf_counter()
    hw = dataclasses.replace(hw, **fixed, place_gbps=place_rates(device))
    said("placing weights", started, **hw.place_gbps)
    started = time.perf_counter()
    rest = elementwise(hw, device)
    said("the elementwise work", started, **rest)
    return dataclasses.replace(hw, **rest)


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
    read 0.115 ms a layer at gen 256 against 0.295 at gen 32 (H100; docs/cost_model.md).
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
            synced_seconds(device, functools.partial(prefill, ex, batch))
            ex.kv.settle()
        prefills = _turns(device, cuts, [prefill] * PREFILL_TURNS)
        for ex, batch in cuts:
            decode(ex, batch, 0)
            decode(ex, batch, 1)
            sync(device)
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
            seconds.append(synced_seconds(device, functools.partial(run, ex, batch)))
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
