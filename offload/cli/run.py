"""`offload-run`: generate text for prompts with a model, print or write JSONL.

The story: parse the flags (`EngineArgs` and sampling, checked at once) -> open the
source (every input line checked) and the sink (locked) -> build the engine (plan
search, load) -> run the job -> report. Nothing long runs before the inputs are judged.

Exit codes: 0 every request succeeded; 1 every request failed; 2 a usage or input
error (bad flag, unreadable or all-invalid file, duplicate ids), nothing generated;
3 finished, some requests failed (their result lines carry the error); 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from offload import jobs
from offload.args import ENGINE_FIELDS
from offload.cli import report, sources
from offload.cli.common import (
    add_engine_flags,
    add_sampling_flags,
    engine_args,
    run_cli,
    sampling_params,
    setup_logging,
)
from offload.engine import LLM
from offload.resultlog import ResultLog

log = logging.getLogger("offload")

EXIT_OK, EXIT_ALL_FAILED, EXIT_USAGE, EXIT_SOME_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="offload-run",
        description="Generate completions for prompts. --model takes 'demo' (the built-in "
        "SmolLM2-135M-Instruct), a preset name (dummy weights), a hub repo id or a local "
        "path (Hugging Face directory or .gguf file). Exit codes: 0 all requests succeeded, "
        "1 all failed, 2 usage or input error, 3 some failed, 130 interrupted.",
    )
    add_engine_flags(p, ENGINE_FIELDS)
    src = p.add_argument_group("input (one of)")
    src.add_argument(
        "--prompt", action="append", help="raw prompt text, never templated (repeatable)"
    )
    src.add_argument(
        "--chat", action="append", help="a one-turn chat: the user's message (repeatable)"
    )
    src.add_argument(
        "-i",
        "--input",
        "--prompts",
        dest="input",
        type=Path,
        help="JSONL of our format (id, prompt or messages, sampling fields), OpenAI Batch "
        "lines (custom_id, method, url, body), or plain text one prompt a line; '-' reads stdin",
    )
    p.add_argument("-o", "--output", help="write results as JSONL here ('-' for stdout)")
    add_sampling_flags(p)
    p.add_argument("--trace", type=Path, help="write a Chrome/Perfetto trace of the last step here")  # fmt: skip
    p.add_argument("--restart", action="store_true", help="discard an unfinished job's results and start over")  # fmt: skip
    p.add_argument("--skip-invalid", action="store_true", help="record unparsable lines as errors and go on")  # fmt: skip
    p.add_argument("--stats", type=Path, help="write the run's summary as JSON here")  # fmt: skip
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar; errors and results only")  # fmt: skip
    # tensor / data parallelism (offload.parallel, docs/parallel.md)
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks, one per GPU (started through torch.distributed's elastic launcher; under torchrun: its world size / --dp)")  # fmt: skip
    p.add_argument("--dp", type=int, default=1, help="data-parallel groups of --tp ranks (needs --output)")  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.quiet)
    from offload.cli import parallel as parallel_job

    if parallel_job.wanted(args):  # several ranks: start them, or run as one
        argv = sys.argv[1:] if argv is None else argv
        return run_cli("offload-run", lambda: parallel_job.main(args, argv))
    return run_cli("offload-run", lambda: _run(args))


def _fingerprint(args: argparse.Namespace, engine, params, input_sha: str) -> dict:
    """What must match for a job to resume: the input bytes and the generation settings."""
    return {
        "input_sha256": input_sha,
        "model": engine.model,
        "revision": engine.revision,
        "dummy": engine.dummy,
        "dtype": engine.dtype,
        "sampling": params.to_dict(),
        "chat_template": engine.chat_template,
        "skip_invalid": args.skip_invalid,
    }


def _run(args: argparse.Namespace) -> int:
    engine = engine_args(args)
    flag_params = sampling_params(args, {})  # sampling flags judged before any long work
    output = sources.check_output(args.output)
    source = sources.open_source(args, output)
    started = time.perf_counter()
    llm = LLM.from_engine_args(
        engine,
        gen_len=flag_params.max_tokens,
        progress=not args.quiet,
        trace=args.trace is not None,
    )
    load_seconds = time.perf_counter() - started
    try:
        params = sampling_params(args, llm.default_sampling)
        sink = sources.open_sink(
            output, _fingerprint(args, engine, params, source.sha256), args.restart
        )
    except BaseException:
        llm.close()
        raise
    log.info(
        "model %s (%s, %.0fM parameters) on %s in %s; loaded in %.1f s",
        llm.spec.name,
        llm.spec.kind,
        llm.config.param_count() / 1e6,
        llm.device,
        str(llm.dtype).removeprefix("torch."),
        load_seconds,
    )
    if llm.policy is not None:
        log.info("policy %s", llm.policy.to_json())
    stats = jobs.JobStats(total=source.total, skipped=sink.done_count)
    if stats.skipped:
        log.info("resuming: %d of %d requests already done", stats.skipped, source.total)
    requests = source.requests(params)
    try:
        if source.from_flags:  # command-line prompts: a bad one fails the run
            requests = list(requests)
            for req in requests:
                llm.check_prompt(jobs.encode_request(llm, req))
        _generate(args, llm, requests, sink, stats)
    except BaseException:
        llm.close()
        if isinstance(sink, ResultLog):
            sink.close()
        raise
    if source.spooled is not None and not stats.interrupted:
        source.spooled.unlink(missing_ok=True)
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
    sources.write_results(sink, source.total, args.output == "-")
    report.report(llm, stats, load_seconds, args.stats)
    llm.close()
    if sink.error_count == 0:
        return EXIT_OK
    return EXIT_ALL_FAILED if sink.error_count == source.total else EXIT_SOME_FAILED


def _generate(args, llm: LLM, requests, sink, stats: jobs.JobStats) -> None:
    bar = None if args.quiet else report.Progress(stats, llm)
    try:
        with jobs.StopFlag() as stop:
            jobs.run_job(llm, requests, sink, stats, stop, on_block=bar.update if bar else None)
    except KeyboardInterrupt:
        stats.interrupted = True
    finally:
        if bar:
            bar.close()
        if args.trace is not None and not llm.runner.write_trace(args.trace):
            log.warning(
                "--trace %s: only the offloading executor traces (give a policy or caps)",
                args.trace,
            )


if __name__ == "__main__":
    sys.exit(main())
