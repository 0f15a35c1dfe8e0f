"""`offload-plan`: where a model will live on this machine, and how fast it will run."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import sys
from pathlib import Path

from offload.api.planning import VERIFY_TOP, weight_formats
from offload.cli import plan_report
from offload.cli.common import (
    add_engine_flags,
    add_sampling_flags,
    add_version_flag,
    engine_args,
    run_cli,
    sampling_params,
    setup_logging,
)
from offload.core.errors import UserError
from offload.executor.probe import PROBE_DEPTHS, measure_profile, verify
from offload.io.layout import store_bytes
from offload.io.store import find_store, free_bytes, space_problem
from offload.models.resolve import resolve_model
from offload.models.tokenizer import BYTE_TOKENS
from offload.policies.advice import FormatHint, format_hint
from offload.policies.caps import Caps
from offload.policies.choose import choose_policy
from offload.policies.cost import Estimate
from offload.policies.job import Job, JobEstimate, estimate_job, predict_job
from offload.policies.search import search

GB = 1e9
FLAGS = (
    "model",
    "revision",
    "dummy",  # (a plan reads only the config: accepted so a run's flags plan as they are)
    "dtype",
    "gpu_mem",
    "cpu_mem",
    "nvme",
    "profile",
    "compress",
    "kv_compress",
    "prompt_len",
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="offload-plan",
        description="Find the placement and batch shape with the highest predicted throughput "
        "that fits the memory caps, and explain it (only the model's config is read).",
    )
    add_version_flag(p)
    add_engine_flags(p, FLAGS, required=("gpu_mem",))
    add_sampling_flags(p, ("max_tokens",))
    p.add_argument(
        "--num-prompts",
        type=int,
        help="requests in the job: the plan with the least predicted time for all of them "
        "(the load and every block, a last partial block at its own size), and that time",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks: plan one rank's shard, --gpu-mem per GPU, --cpu-mem "
        "for the node shared by the ranks (the all-reduce as offload-profile measured it)",
    )
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
    args.prompt_len = engine.planned_prompt_len  # no job here: --prompt-len, else 512
    args.gen_len = sampling_params(args, {}).max_tokens
    if args.num_prompts is not None and args.num_prompts < 1:
        raise UserError(f"--num-prompts must be positive, got {args.num_prompts}")
    args.job = _job(args)
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # before any search
        raise UserError("--plot needs matplotlib: pip install 'offload[plot]' (or matplotlib)")
    spec = resolve_model(engine.model, dummy=True, revision=engine.revision)
    model_cfg = cfg = spec.config
    # (a hub id without --dummy plans from its preset's config, but runs its own tokenizer)
    hub_run = spec.path is None and "/" in engine.model and not engine.dummy
    args.token_note = f" ({BYTE_TOKENS})" if spec.byte_tokens and not hub_run else ""
    args.checkpoint_bytes = spec.checkpoint_bytes()
    if args.gpus is not None:  # one GPU, TP and DP side by side (a pre-quantized: no TP)
        from offload.cli import layouts

        formats = weight_formats(spec.checkpoint_format(), engine.compress, engine.compressions())
        return layouts.main(cfg, engine, args, formats, spec.checkpoint_format() is not None)
    cpu_bytes = engine.cpu_bytes
    if args.tp > 1:  # tensor parallelism: the per-rank plan (offload.parallel)
        from offload.parallel import rank_config
        from offload.policies.memory_limit import node_memory_limit

        cfg = rank_config(cfg, args.tp, 0)
        cpu_bytes = (cpu_bytes or int(0.9 * node_memory_limit()[0])) // args.tp
    # a pre-quantized checkpoint is planned in its own format
    args.compressions = weight_formats(
        spec.checkpoint_format(), engine.compress, engine.compressions()
    )
    args.kv_compressions = engine.kv_compressions()
    choice = choose_policy(
        cfg,
        engine.dtype,
        engine.gpu_bytes,
        cpu_bytes,
        engine.nvme,
        args.prompt_len,
        args.gen_len,
        engine.profile,
        args.num_prompts,
        args.compressions,
        args.kv_compressions,
        announce=lambda msg: print(f"offload-plan: {msg}", file=sys.stderr),
        tp=args.tp,
        measure_machine=measure_profile,
        top=VERIFY_TOP if args.verify else 1,
        job=args.job,
    )
    best, hw, caps, dtype = choice.best, choice.profile, choice.caps, choice.dtype
    probed = []
    if args.verify:
        probed = _verify(cfg, choice, engine, args)
        best = probed[0][0]
    args.dtype = str(dtype).removeprefix("torch.")
    store = _weight_store(model_cfg, dtype, engine.nvme, best.policy, args.tp)
    hint = format_hint(
        cfg, dtype, args.prompt_len, args.gen_len, hw, caps, best, args.compressions,
        args.kv_compressions, args.job, args.tp,
    )  # fmt: skip
    if store is not None and store["problem"]:  # said before the what-if searches
        also = f"; or {hint.text()}" if hint else ""
        print(f"offload-plan: problem: {store['problem']}{also}", file=sys.stderr)
    what_if = _what_if(cfg, dtype, args, hw, caps, best)
    job = _job_prediction(cfg, dtype, args, hw, best, engine)
    if args.json:
        extra = {
            "weight_store": store,
            "job": job and job.to_dict(),
            "format_hint": _hint_json(hint),
        }
        print(json.dumps({**plan_report.as_json(best, what_if, probed), **extra}, indent=1))
    else:
        print(plan_report.table(cfg, args, hw, best, what_if, store, probed, hint, job))
    if args.plot:
        plan_report.plot(args.plot, cfg, dtype, args, hw, caps, best)
    return 0


def _job(args) -> Job | None:
    """--num-prompts: a job of that many requests at the planned lengths."""
    if args.num_prompts is None:
        return None
    return Job.uniform(args.num_prompts, args.prompt_len, args.gen_len)


def _job_prediction(cfg, dtype, args, hw, best: Estimate, engine) -> JobEstimate | None:
    """--num-prompts: the job's predicted time under the plan, its load included."""
    if args.job is None:
        return None
    checkpoint = 0 if engine.dummy else args.checkpoint_bytes // args.tp
    return predict_job(cfg, best.policy, dtype, args.job, hw, engine.nvme, checkpoint, args.tp)


def _hint_json(hint: FormatHint | None) -> dict | None:
    return (
        None
        if hint is None
        else {"flags": hint.flags, "tok_s": hint.tok_s, "speedup": hint.speedup}
    )


def _verify(cfg, choice, engine, args) -> list:
    """Probe the searched plans on this machine; (estimate, probe), fastest measured first."""
    import torch

    if args.tp > 1:
        raise UserError("--verify probes one GPU's plan; drop --tp, or verify without it")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(
        f"offload-plan: probing {len(choice.ranked)} plans ({PROBE_DEPTHS} layers each)",
        file=sys.stderr,
    )
    probed = verify(
        cfg, choice.ranked, choice.dtype, device, args.prompt_len, args.gen_len, engine.nvme
    )
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
                args.num_prompts,
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
