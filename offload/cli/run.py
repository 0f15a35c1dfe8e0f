"""`offload-run`: generate text for prompts with a model, print or write JSONL.

The story: parse the flags (`EngineArgs` and sampling, checked at once) -> open the
source (every input line checked) -> the model's front (config and tokenizer, no
weights) -> measure the job (every prompt encoded: its longest prompt and budget) ->
plan for it (search, fit checks) -> open the sink (locked) -> load -> run the job ->
report. Every check that can fail runs before the load (`cli.sizing`).

Exit codes: 0 every request succeeded; 1 every request failed (an OpenAI Batch file of
refused lines gets an error line each, as vLLM's run-batch, and loads no model); 2 a
usage or input error (bad flag, unreadable file, a file of ours with no valid line,
duplicate ids), nothing generated; 3 finished, some requests failed (their result lines
carry the error); 130 interrupted. SIGTERM is taken as Ctrl-C: the run stops after the
block in flight, keeps its results and says how to resume (a second signal abandons the
block).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from offload.api.args import ENGINE_FIELDS, FlexibleArgumentParser, resolve_device
from offload.api.front import ModelFront
from offload.api.llm import LLM
from offload.api.vllm_args import add_vllm_flags
from offload.cli import common, report, sizing, sources
from offload.cli.common import (
    EXIT_INTERRUPTED,
    add_engine_flags,
    add_sampling_flags,
    add_version_flag,
    engine_args,
    run_cli,
    sampling_params,
    setup_logging,
)
from offload.jobs import job_loop
from offload.jobs.resultlog import ResultLog

log = logging.getLogger("offload")

# vLLM's names for --tp and --dp (its other engine flags: `vllm_args`)
PARALLEL_ALIASES = {
    "tensor_parallel_size": ("--tensor-parallel-size", "-tp"),
    "data_parallel_size": ("--data-parallel-size", "-dp"),
}


def build_parser() -> argparse.ArgumentParser:
    p = FlexibleArgumentParser(
        prog="offload-run",
        description="Generate completions for prompts. --model takes 'demo' (the built-in "
        "SmolLM2-135M-Instruct), a preset name (dummy weights), a hub repo id or a local "
        "path (Hugging Face directory or .gguf file). Exit codes: 0 all requests succeeded, "
        "1 all failed, 2 usage or input error, 3 some failed, 130 interrupted.",
    )
    add_version_flag(p)
    add_engine_flags(p, ENGINE_FIELDS)
    add_vllm_flags(p.add_argument_group("vLLM's engine flags"), skip=PARALLEL_ALIASES)
    common.add_input_flags(p)
    p.add_argument(
        "-o", "--output", "--output-file", help="write results as JSONL here ('-' for stdout)"
    )
    add_sampling_flags(p)
    p.add_argument("--trace", type=Path, help="write a Chrome/Perfetto trace of the last traced step here (and of the last traced prefill beside it, <name>_prefill.json); with --tp/--dp one file a rank, <name>.rank<i>.json")  # fmt: skip
    p.add_argument("--trace-every", type=int, default=1, help="with --trace: trace one forward step in N (the others run untraced, with CUDA graphs where the plan has them)")  # fmt: skip
    p.add_argument("--restart", action="store_true", help="discard an unfinished job's results and start over")  # fmt: skip
    p.add_argument("--stats", type=Path, help="write the run's summary as JSON here")  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no progress bar; errors and results only")  # fmt: skip
    common.add_parallel_flags(p, PARALLEL_ALIASES)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.quiet, args.verbose)
    from offload.cli import parallel as parallel_job

    if parallel_job.wanted(args):  # several ranks: start them, or run as one
        argv = sys.argv[1:] if argv is None else argv
        return run_cli("offload-run", lambda: parallel_job.main(args, argv, main))
    return run_cli("offload-run", lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    engine = engine_args(args)
    flag_params = sampling_params(args, {})  # sampling flags judged before any long work
    output = sources.check_output(args.output, args.restart)
    sources.check_reports(args)
    source = sources.open_source(args, output)
    try:
        return _run_job(args, engine, flag_params, output, source)
    finally:  # a copy of standard input is the run's own: never left behind
        if source.spooled is not None:
            source.spooled.unlink(missing_ok=True)


def _run_job(args, engine, flag_params, output, source: sources.Source) -> int:
    if source.invalid == source.total:  # a Batch file of refused lines: nothing to load
        return _refused_only(args, engine, source, output, flag_params)
    front = ModelFront(engine, resolve_device(engine.device))  # config and tokenizer only
    params = sampling_params(args, front.default_sampling)
    log.info("%s", common.describe_sampling(args, front.default_sampling))
    shape = sizing.measure(front, source.requests(params), source.from_flags, args.skip_invalid)
    sized = sizing.plan_for_job(
        front, engine, shape, flag_params.max_tokens, args.skip_invalid,
        explain=args.stats is not None,
    )  # fmt: skip
    fingerprint = common.fingerprint(args, engine, params, source.sha256, sized.plan.policy)
    sink = sources.open_sink(output, fingerprint, args.restart, source.total)
    started = time.perf_counter()
    try:
        llm = LLM.from_plan(
            sized.engine,
            front,
            sized.plan,
            progress=not args.quiet,
            trace=common.trace_sampling(args),
        )
    except BaseException:
        _close(sink)
        raise
    load_seconds = time.perf_counter() - started  # (the LLM logs its model and load)
    if llm.policy is not None:
        log.info("policy %s", llm.policy.to_json())
    stats = job_loop.JobStats(total=source.total, skipped=sink.done_count)
    if stats.skipped:
        log.info("resuming: %d of %d requests already done", stats.skipped, source.total)
    try:
        common.generate(args, llm, source.requests(params), sink, stats, sized.prompt_limit)
    except BaseException:
        llm.close()
        _close(sink)
        raise
    if stats.interrupted:
        llm.close()
        if isinstance(sink, ResultLog):
            sink.close()
            print(
                f"offload-run: interrupted with {stats.done + stats.skipped} of {source.total} "
                f"requests done (kept in {sink.partial}); run the same command again to resume",
                file=sys.stderr,
            )
        return EXIT_INTERRUPTED
    try:
        sources.write_results(sink, source.total, args.output == "-")
        report.report(llm, stats, load_seconds, args.stats)
    finally:  # (a full disk at the end leaves the results for the same command)
        llm.close()
        _close(sink)
    return common.exit_code(sink.error_count, source.total)


def _refused_only(args, engine, source, output, params) -> int:
    """An OpenAI Batch file whose every line is refused: one error line per request, as
    vLLM's run-batch writes them, and exit 1 (all failed); no model is loaded."""
    fingerprint = common.fingerprint(args, engine, params, source.sha256, None)
    sink = sources.open_sink(output, fingerprint, args.restart)
    try:
        sink.append(
            [job_loop.result_row(r) for r in source.requests(params) if not sink.done(r.index)]
        )
        sources.write_results(sink, source.total, args.output == "-")
    finally:
        _close(sink)
    return common.exit_code(sink.error_count, source.total)


def _close(sink) -> None:
    if isinstance(sink, ResultLog):
        sink.close()


if __name__ == "__main__":
    sys.exit(main())
