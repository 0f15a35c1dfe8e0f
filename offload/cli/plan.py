"""`offload-plan`: where a model will live on this machine, and how fast it will run."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import sys
from pathlib import Path

from offload.api.args import ENGINE_FIELDS, FlexibleArgumentParser, resolve_device
from offload.api.front import ModelFront
from offload.api.planning import VERIFY_TOP, Plan, PlanRequest, plan, rank_engine
from offload.api.vllm_args import add_vllm_flags
from offload.cli import plan_report, sizing, sources
from offload.cli.common import (
    add_engine_flags,
    add_input_flags,
    add_parallel_flags,
    add_sampling_flags,
    add_version_flag,
    engine_args,
    run_cli,
    sampling_params,
    setup_logging,
)
from offload.cli.run import PARALLEL_ALIASES
from offload.core.errors import UserError
from offload.executor.probe import PROBE_DEPTHS, verify
from offload.io.layout import store_bytes
from offload.io.store import find_store, free_bytes, space_problem
from offload.models.tokenizer import BYTE_TOKENS
from offload.policies.advice import FormatHint, format_hint
from offload.policies.caps import Caps, Machine
from offload.policies.cost import Estimate, estimate
from offload.policies.hardware import HardwareProfile
from offload.policies.job import Job, estimate_job
from offload.policies.node import Layout
from offload.policies.search import kv_formats, search

GB = 1e9
# The most requests --num-prompts plans for: a job holds each request's lengths (a list
# a request, as offload-run's job from a file does), and the search passes over them for
# every plan it times: 10^7 answered in 20 s and 0.8 GB on the 2-core CI machine (10^8
# not in 200 s, 10^12 ran out of memory; docs/log.md), and past the load a larger uniform
# job's time grows in proportion.
MAX_NUM_PROMPTS = 10**7


def build_parser() -> argparse.ArgumentParser:
    p = FlexibleArgumentParser(
        prog="offload-plan",
        description="Show the plan offload-run will use for the same flags and job: where "
        "the weights, KV cache and activations live, the batch shape, and the job's "
        "predicted time (only the model's config and tokenizer are read). Without -i, "
        "--prompt or --chat it plans --num-prompts requests of --prompt-len tokens.",
    )
    add_version_flag(p)
    add_engine_flags(p, ENGINE_FIELDS)
    add_vllm_flags(p.add_argument_group("vLLM's engine flags"), skip=PARALLEL_ALIASES)
    add_input_flags(p)
    add_sampling_flags(p)
    add_parallel_flags(p, PARALLEL_ALIASES)
    p.add_argument(
        "--num-prompts",
        type=int,
        help="without a job input: requests of --prompt-len tokens in the job (the plan "
        "with the least predicted time for all of them, and that time)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--explain", action="store_true", help="show the chosen plan beside its ranked neighbours (the next batch shapes, weight and KV splits, the other formats allowed), each with its predicted job time, its bottleneck and, where it does not fit, the cap it breaks")  # fmt: skip
    p.add_argument("--gpus", type=int, help="compare one GPU, tensor parallelism over N and N data-parallel groups on this node, and recommend one (docs/parallel.md)")  # fmt: skip
    p.add_argument(
        "--verify",
        action="store_true",
        help=f"time the best {VERIFY_TOP} plans of differing kinds on this machine ({PROBE_DEPTHS} "
        "layers each at the real shapes, extrapolated), keep the fastest measured, and show "
        "predicted against probed",
    )
    p.add_argument("--plot", type=Path, help="draw placement and throughput vs batch size to a PNG")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(quiet=False, verbose=args.verbose, default=logging.WARNING)
    return run_cli("offload-plan", lambda: _plan(args))


def _plan(args) -> int:
    engine = engine_args(args)  # every flag judged before the machine is measured
    flag_params = sampling_params(args, {})
    if args.num_prompts is not None and not 1 <= args.num_prompts <= MAX_NUM_PROMPTS:
        raise UserError(
            f"--num-prompts must be from 1 to {MAX_NUM_PROMPTS:,}, got {args.num_prompts:,}; "
            f"for a larger job plan {MAX_NUM_PROMPTS:,} and scale the predicted time (past the "
            "load it grows in proportion to the requests)"
        )
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # before any search
        raise UserError("--plot needs matplotlib: pip install 'offload[plot]' (or matplotlib)")
    layout = _layout(args)
    # the machine planned for: the one --profile describes, else this one
    machine = Machine.profiled(HardwareProfile.from_file(engine.profile)) if engine.profile else None  # fmt: skip
    device = machine.device if machine is not None else resolve_device(engine.device)
    if args.gpus is not None:  # one GPU, TP and DP side by side
        from offload.cli import layouts

        front = _front(engine, device)
        job = _uniform_job(args, engine, flag_params.max_tokens, front)
        return layouts.main(front, engine, args, job, machine)
    rank_args = engine if layout is None else rank_engine(engine, layout.ranks, 0)[0]
    front = _front(rank_args, device)
    sized_args, found = _sized(args, rank_args, front, flag_params.max_tokens, layout, machine)
    return _report(args, sized_args, front, found, layout)


def _layout(args) -> Layout | None:
    tp, dp = args.tp or 1, args.dp
    if tp < 1 or dp < 1:
        raise UserError(f"--tp and --dp must be positive, got {tp} and {dp}")
    return None if tp * dp == 1 else Layout(tp, dp)


def _front(engine, device) -> ModelFront:
    """The model's front as offload-run builds it; a hub model that is not downloaded is
    planned from its preset's config (the same shapes), said on stderr."""
    try:
        return ModelFront(engine, device)
    except UserError as exc:
        if engine.dummy or "--dummy" not in str(exc):
            raise
        print(f"offload-plan: {exc.args[0].split(', or pass')[0]}; planning from its preset's config", file=sys.stderr)  # fmt: skip
        return ModelFront(engine.replace(dummy=True), device)


def _uniform_job(args, engine, max_tokens, front: ModelFront) -> Job | None:
    """--num-prompts requests of --prompt-len tokens (None: a full block, no job)."""
    if args.num_prompts is None:
        return None
    gen_len = max_tokens or front.get_default_sampling_params().max_tokens or 256
    return Job.uniform(args.num_prompts, engine.planned_prompt_len, gen_len)


def _sized(args, engine, front, max_tokens, layout, machine) -> tuple:
    """The plan offload-run makes for the same flags: for the job's requests (-i,
    --prompt, --chat: measured with the model's tokenizer, `sizing`), else for
    --num-prompts requests of --prompt-len tokens."""
    if args.input is not None or args.prompt or args.chat:
        source = sources.open_source(args, None)
        try:
            params = sampling_params(args, front.default_sampling)
            shape = sizing.measure(front, source.requests(params), source.from_flags, args.skip_invalid)  # fmt: skip
            sized = sizing.plan_for_job(
                front, engine, shape, max_tokens, args.skip_invalid, layout, args.explain, machine
            )
        finally:
            if source.spooled is not None:
                source.spooled.unlink(missing_ok=True)
        return sized.engine, sized.plan
    job = _uniform_job(args, engine, max_tokens, front)
    request = PlanRequest.build(front, engine, None, max_tokens, layout, job, args.explain and job is not None, machine)  # fmt: skip
    return engine, plan(request)


def _report(args, engine, front: ModelFront, found: Plan, layout: Layout | None) -> int:
    """The plan as a table, or one JSON object."""
    tp = layout.tp if layout is not None else 1
    cfg = front.config if tp == 1 else _rank_cfg(front, tp)
    args.prompt_len, args.gen_len, args.tp = found.prompt_len, found.gen_len, tp
    args.dtype = str(front.dtype).removeprefix("torch.")
    args.token_note = f" ({BYTE_TOKENS})" if front.spec.byte_tokens else ""
    args.compressions = _formats(front, engine)
    args.kv_compressions = kv_formats(cfg, engine.kv_compressions())
    if found.policy is None or found.profile is None:
        return _whole(args, front, found)
    hw, caps, dtype = found.profile, found.caps, front.dtype
    best = estimate(cfg, found.policy, dtype, found.prompt_len, found.gen_len, hw, tp=tp)
    args.job = found.prediction and _job_of(found)
    probed = []
    if args.verify:
        probed = _verify(cfg, [best], dtype, engine, args, found)
        best = probed[0][0]
    store = _weight_store(front.config, dtype, engine.nvme, best.policy, tp)
    hint = format_hint(
        cfg, dtype, args.prompt_len, args.gen_len, hw, caps, best, args.compressions,
        args.kv_compressions, args.job, tp,
    )  # fmt: skip
    if store is not None and store["problem"]:  # said before the what-if searches
        also = f"; or {hint.text()}" if hint else ""
        print(f"offload-plan: problem: {store['problem']}{also}", file=sys.stderr)
    what_if = _what_if(cfg, dtype, args, hw, caps, best)
    if args.json:
        extra = {
            "weight_store": store,
            "job": found.prediction and found.prediction.to_dict(),
            "format_hint": _hint_json(hint),
            "caps": {"gpu_bytes": caps.gpu_bytes, "cpu_bytes": caps.cpu_bytes, "nvme": caps.nvme},
            "made": found.made,
        }
        if args.explain:
            extra["candidates"] = [c.to_dict() for c in found.candidates]
        print(json.dumps({**plan_report.as_json(best, what_if, probed), **extra}, indent=1))
    else:
        text = plan_report.table(cfg, args, hw, best, what_if, store, probed, hint, found.prediction)  # fmt: skip
        if args.explain:
            text += "\n" + plan_report.candidates_table(found.candidates)
        print(text)
    if args.plot:
        plan_report.plot(args.plot, cfg, dtype, args, hw, caps, best)
    return 0


def _rank_cfg(front: ModelFront, tp: int):
    from offload.parallel import rank_config

    return rank_config(front.config, tp, 0)


def _formats(front: ModelFront, engine):
    from offload.api.plan_formats import weight_formats

    return weight_formats(front.spec.weight_format(), engine.compress, engine.compressions())


def _job_of(found: Plan) -> Job | None:
    """The job the plan was predicted for, as its blocks (for the what-if comparisons)."""
    assert found.prediction is not None
    prompts, gens = [], []
    for block, count, _ in found.prediction.blocks:
        prompts += [block.prompt_len] * (block.rows * count)
        gens += [block.gen_len] * (block.rows * count)
    return Job(prompts, gens)


def _whole(args, front: ModelFront, found: Plan) -> int:
    """No offloading: the model runs whole on the device (or no profile prices it)."""
    where = "the GPU" if front.device.type == "cuda" else "the CPU"
    caps = found.caps
    out = {
        "policy": found.policy.to_dict() if found.policy else None,
        "made": found.made,
        "batch_size": found.batch_size,
        "caps": {"gpu_bytes": caps.gpu_bytes, "cpu_bytes": caps.cpu_bytes, "nvme": caps.nvme},
    }
    if args.json:
        print(json.dumps(out, indent=1))
    elif found.policy is None:
        print(
            f"{front.config.name}: runs whole on {where} in {args.dtype}, {found.batch_size} "
            f"sequences a batch; it fits this machine's memory ({caps.gpu_bytes / GB:.1f} GB), "
            "so nothing is offloaded (give --gpu-mem, --cpu-mem or --nvme to plan offloading)"
        )
    else:
        print(f"{front.config.name}: policy {found.policy.to_json()} (no hardware profile to price it: run offload-profile)")  # fmt: skip
    return 0


def _hint_json(hint: FormatHint | None) -> dict | None:
    return (
        None
        if hint is None
        else {"flags": hint.flags, "tok_s": hint.tok_s, "speedup": hint.speedup}
    )


def _verify(cfg, ranked: list[Estimate], dtype, engine, args, found: Plan) -> list:
    """Probe the plan on this machine; (estimate, probe), fastest measured first."""
    import torch

    if args.tp > 1:
        raise UserError("--verify probes one GPU's plan; drop --tp, or verify without it")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"offload-plan: probing {len(ranked)} plans ({PROBE_DEPTHS} layers each)", file=sys.stderr)  # fmt: skip
    probed = verify(cfg, ranked, dtype, device, found.prompt_len, found.gen_len, engine.nvme)
    spent = sum(probe.seconds_spent for _, probe in probed)
    print(f"offload-plan: probes took {spent:.1f} s", file=sys.stderr)
    return probed


def _weight_store(model_cfg, dtype, nvme: Path | None, policy, tp: int) -> dict | None:
    """The chosen policy's weight store under --nvme (each rank's under its own
    directory): the stage tails it puts on disk, what a run would write (nothing where a
    store there already holds them), the free space, and the problem when it is short."""
    if nvme is None:
        return None
    placement, compression = policy.weights, policy.weight_compression
    footprint = to_write = 0
    for rank in range(tp) if placement.disk > 0 else ():
        cfg, directory = model_cfg, nvme
        if tp > 1:
            from offload.parallel import rank_config
            from offload.parallel.rank import rank_dir

            cfg, directory = rank_config(model_cfg, tp, rank), rank_dir(nvme, rank)
        need = store_bytes(cfg, dtype, compression, placement)
        footprint += need
        if find_store(directory, cfg, dtype, compression, placement)[0] is None:
            to_write += need
    return {
        "nvme": str(nvme),
        "bytes": footprint,
        "write_bytes": to_write,
        "free_bytes": free_bytes(nvme),
        "problem": space_problem(nvme, to_write) if to_write else None,
    }


def _what_if(cfg, dtype, args, hw, caps: Caps, best: Estimate) -> list[tuple[str, float]]:
    """Speed-up of the best plan under a few larger budgets."""
    trials = [
        ("+16 GB CPU RAM", dataclasses.replace(caps, cpu_bytes=caps.cpu_bytes + 16 * 10**9)),
        ("+8 GB GPU memory", dataclasses.replace(caps, gpu_bytes=caps.gpu_bytes + 8 * 10**9)),
    ]
    if not caps.nvme:
        trials.append(("an --nvme directory", dataclasses.replace(caps, nvme=True)))
    out = []
    for label, trial in trials:
        try:
            est = search(
                cfg,
                dtype,
                args.prompt_len,
                args.gen_len,
                hw,
                trial,
                None,
                args.compressions,
                args.kv_compressions,
                args.tp,
                job=args.job,
            )
        except UserError:
            continue
        out.append((label, _speedup(cfg, dtype, args, hw, best, est)))
    return out


def _speedup(cfg, dtype, args, hw, best: Estimate, est: Estimate) -> float:
    """est's throughput over best's: a full block's, or with --num-prompts the job's."""
    if args.job is None:
        return est.total_tok_s / best.total_tok_s
    jobs = [estimate_job(cfg, e.policy, dtype, args.job, hw, args.tp).seconds for e in (best, est)]
    return jobs[0] / jobs[1]


if __name__ == "__main__":
    sys.exit(main())
