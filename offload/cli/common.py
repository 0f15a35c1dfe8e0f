"""What every CLI shares: flags built from `EngineArgs` and `SamplingParams`, user-error
handling, logging set-up, and what one rank and many ranks of offload-run share: the exit
codes, a job's fingerprint and the generation loop with its progress bar and trace.

A flag is defined once: `add_engine_flags(parser, names)` makes `--gpu-mem` and friends
from `EngineArgs`' fields (help and default from there), `add_sampling_flags` makes
`--max-tokens`, `--temperature`... from `SamplingParams`. Unset sampling flags stay
unset, so the model's own defaults (generation_config.json) apply, as in Python.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from offload.api.args import (  # re-exported: scripts and tests import them from here
    COMPRESS_HELP,
    KV_COMPRESS_HELP,
    EngineArgs,
    add_engine_flags,
    cli_engine_args,
    parse_compression,
    parse_kv_compression,
    parse_size,
)
from offload.cli import report
from offload.core.errors import UserError
from offload.core.logs import LEVEL_ENV, level_from_env
from offload.core.sampling import SamplingParams, with_defaults
from offload.jobs import job_loop

__all__ = [
    "COMPRESS_HELP",
    "EXIT_ALL_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_SOME_FAILED",
    "EXIT_USAGE",
    "KV_COMPRESS_HELP",
    "add_engine_flags",
    "add_sampling_flags",
    "add_version_flag",
    "engine_args",
    "exit_code",
    "fingerprint",
    "generate",
    "parse_compression",
    "parse_kv_compression",
    "parse_size",
    "positive_int",
    "run_cli",
    "sampling_params",
    "setup_logging",
]

log = logging.getLogger("offload")

EXIT_OK, EXIT_ALL_FAILED, EXIT_USAGE, EXIT_SOME_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

# SamplingParams fields offered as flags: (help, argparse options)
SAMPLING_FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "max_tokens": (
        "tokens to generate at most, a chat's too (unset: the model's generation_config.json "
        "max_new_tokens, else 16)",
        {"type": int},
    ),
    "min_tokens": ("tokens to generate before EOS or a stop id may end", {"type": int}),
    "temperature": (
        "0 is greedy (unset: the model's generation_config.json temperature, else 0: greedy; "
        "the run's log says which applies and why)",
        {"type": float},
    ),
    "top_p": ("nucleus sampling mass, 1 is off (unset: the model's, else 1)", {"type": float}),
    "top_k": ("-1 switches top-k off (unset: the model's, else -1)", {"type": int}),
    "min_p": (
        "drop tokens below this share of the top token's probability (unset: the model's, else 0)",
        {"type": float},
    ),
    "repetition_penalty": (
        "> 1 discourages tokens already in prompt or output (unset: the model's, else 1)",
        {"type": float},
    ),
    "presence_penalty": ("OpenAI's presence penalty, -2..2", {"type": float}),
    "frequency_penalty": ("OpenAI's frequency penalty, -2..2", {"type": float}),
    "seed": ("makes sampling reproducible", {"type": int}),
    "stop": ("a stop string (repeatable)", {"action": "append"}),
    "stop_token_ids": (
        "a token id that ends a sequence (repeatable)",
        {"action": "append", "type": int},
    ),
    "ignore_eos": ("keep generating past EOS", {"action": "store_true", "default": None}),
}
ALIASES = {"max_tokens": ("--max-new-tokens", "--gen-len")}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def engine_args(args: argparse.Namespace, **extra: Any) -> EngineArgs:
    """The `EngineArgs` of parsed flags (fields the CLI has no flag for keep defaults;
    vLLM's engine flags mapped or refused naming ours: `args.cli_engine_args`)."""
    return cli_engine_args(args, **extra)


def add_input_flags(parser: argparse.ArgumentParser) -> None:
    """A job's requests, the same for offload-run and offload-plan (which plans for them)."""
    src = parser.add_argument_group("input (one of)")
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
        "--input-file",
        dest="input",
        type=Path,
        help="JSONL of our format (id, prompt or messages, sampling fields), OpenAI Batch "
        "lines (custom_id, method, url, body), or plain text one prompt a line; '-' reads stdin",
    )
    parser.add_argument("--skip-invalid", action="store_true", help="record unparsable lines, prompts too long for the context or the memory caps, and token ids outside the vocabulary, as errors and go on")  # fmt: skip


def add_parallel_flags(
    parser: argparse.ArgumentParser, aliases: dict[str, tuple[str, ...]]
) -> None:
    """--tp and --dp (offload.parallel, docs/parallel.md), with vLLM's names."""
    parser.add_argument("--tp", *aliases["tensor_parallel_size"], type=positive_int, default=None, help="tensor-parallel ranks, one per GPU (started through torch.distributed's elastic launcher; under torchrun: its world size / --dp)")  # fmt: skip
    parser.add_argument("--dp", *aliases["data_parallel_size"], type=positive_int, default=1, help="data-parallel groups of --tp ranks (needs --output)")  # fmt: skip


def add_sampling_flags(parser: argparse.ArgumentParser, names: Sequence[str] = ()) -> None:
    group = parser.add_argument_group(
        "sampling (vLLM's SamplingParams; a flag left unset takes the model's "
        "generation_config.json value where it sets one, else offload's default)"
    )
    for name in names or SAMPLING_FLAGS:
        help_text, options = SAMPLING_FLAGS[name]
        options = {"default": None, **options}
        group.add_argument(
            _flag(name), *ALIASES.get(name, ()), dest=name, help=help_text, **options
        )


def given_sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags given on the command line."""
    return {k: getattr(args, k) for k in SAMPLING_FLAGS if getattr(args, k, None) is not None}


def sampling_params(args: argparse.Namespace, defaults: dict[str, Any]) -> SamplingParams:
    """SamplingParams from the sampling flags given, over the model's defaults."""
    try:
        return with_defaults(None, {**defaults, **given_sampling(args)})
    except ValueError as exc:
        raise UserError(str(exc)) from None


def describe_sampling(args: argparse.Namespace, model_defaults: dict[str, Any]) -> str:
    """Which sampling applies and where each setting came from: a flag, the model's
    generation_config.json, or offload's default (the run's log)."""
    given, params = given_sampling(args), sampling_params(args, model_defaults)

    def source(name: str) -> str:
        if name in given:
            return _flag(name)
        return "generation_config.json" if name in model_defaults else "offload's default"

    names = ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens"]
    names = [
        n for n in names if n in ("temperature", "max_tokens") or source(n) != "offload's default"
    ]
    settings = ", ".join(f"{n} {getattr(params, n)} ({source(n)})" for n in names)
    hint = "; --generation-config none ignores the model's" if model_defaults else ""
    mode = "greedy" if params.greedy else "sampled"
    return f"sampling: {mode}, {settings}{hint}; a request's own fields override these"


def positive_int(text: str) -> int:
    """argparse's type of a count (ranks, groups): a whole number, at least 1 (0 or -1
    would otherwise run as one process and exit 0 as if asked for)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    """The flags every CLI has: --version and -v/--verbose."""
    import offload

    parser.add_argument("--version", action="version", version=f"%(prog)s {offload.__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0,
        help=f"log offload's DEBUG lines (else {LEVEL_ENV}, as vLLM's VLLM_LOGGING_LEVEL, "
        "sets the level: DEBUG, INFO, WARNING, ERROR)",
    )  # fmt: skip


def setup_logging(quiet: bool, verbose: int = 0, default: int = logging.INFO) -> None:
    """The level of offload's lines: DEBUG with -v, WARNING with --quiet, else the level
    OFFLOAD_LOGGING_LEVEL names, else the CLI's `default`. A program that set up logging
    itself (a handler on the root logger: a CLI called from Python, pytest) keeps its own
    set-up, as `basicConfig` leaves it."""
    try:
        level = logging.DEBUG if verbose else logging.WARNING if quiet else level_from_env(default)
    except UserError as exc:  # (before run_cli: the one line here)
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    if not logging.getLogger().handlers:
        logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr)
        logging.getLogger("offload").setLevel(level)  # (`core.logs` gave it a level of its own)
    for noisy in ("transformers", "huggingface_hub", "httpx", "filelock"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def run_cli(prog: str, body: Callable[[], int]) -> int:
    """Run a CLI body; user mistakes print one line and exit 2, never a traceback.
    SIGTERM is taken as Ctrl-C (offload-run's job loop stops after its block)."""
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return body()
    except UserError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def trace_sampling(args: argparse.Namespace) -> int:
    """The engine's `trace` for --trace and --trace-every: 0 (off), else one forward step
    traced in N."""
    if args.trace is None:
        return 0
    if args.trace_every < 1:
        raise UserError(f"--trace-every must be at least 1, got {args.trace_every}")
    return args.trace_every


def exit_code(errors: int, total: int) -> int:
    """offload-run's exit code for a job that ran to its end with this many error results."""
    if errors == 0:
        return EXIT_OK
    return EXIT_ALL_FAILED if errors == total else EXIT_SOME_FAILED


def fingerprint(args: argparse.Namespace, engine, params, input_sha: str, policy) -> dict:
    """What must match for a job to resume: the input bytes and the generation settings,
    the formats the plan computes with among them (a job's results are never a mix of
    int4 and full-precision ones; every placement gives the same tokens, so the rest of
    the policy may change)."""
    from offload.api.args import compression_text

    return {
        "input_sha256": input_sha,
        "model": engine.model,
        "revision": engine.revision,
        "dummy": engine.dummy,
        "dtype": engine.dtype,
        "sampling": params.to_dict(),
        "chat_template": engine.chat_template,
        "skip_invalid": args.skip_invalid,
        "compress": compression_text(policy.weight_compression if policy else None),
        "kv_compress": compression_text(policy.kv_compression if policy else None),
    }


def generate(
    args: argparse.Namespace,
    llm,
    todo,
    sink,
    stats: job_loop.JobStats,
    prompt_limit: int | None = None,
    *,
    show_bar: bool = True,
    agree_to_stop: Callable[[bool], bool] | None = None,
    trace_path: Path | None = None,
) -> None:
    """Run the job's requests through `job_loop.run_job` with a progress bar (unless --quiet or
    not `show_bar`); Ctrl-C stops after the block in flight. `agree_to_stop(requested)`
    (the ranks of a group) returns whether every rank stops after this block. The trace
    is written at the end (to `trace_path`, default --trace), also after an interruption."""
    trace_path = trace_path or args.trace
    bar = report.Progress(stats, llm) if show_bar and not args.quiet else None
    stats_path = getattr(args, "stats", None)  # rewritten while the job runs (the leader's)
    live = report.LiveStats(stats_path, llm, stats) if show_bar and stats_path else None

    def on_step() -> None:  # (each decode step: counted on the host, no device sync)
        if bar:
            bar.on_step()
        if live:
            live.tick()

    llm.loop.on_step = on_step
    try:
        with job_loop.StopFlag() as stop:

            def on_block() -> None:
                if bar:
                    bar.update()
                if live:
                    live.tick()
                if agree_to_stop is not None:
                    stop.requested = agree_to_stop(stop.requested)

            job_loop.run_job(llm, todo, sink, stats, stop, on_block, prompt_limit)
    except KeyboardInterrupt:
        stats.interrupted = True
    finally:
        llm.loop.on_step = None
        if bar:
            bar.close()
        if live and stats.interrupted:
            live.write("interrupted")  # (a finished job's is written with its report)
        if trace_path is not None:
            _write_trace(llm, trace_path)


def _write_trace(llm, path) -> None:
    """The trace, or one line saying why there is none: a trace that cannot be written
    never costs the job's results (they are written after it)."""
    try:
        written = llm.runner.write_trace(path)
    except OSError as exc:
        log.error("offload-run: could not write --trace %s (%s); the results are kept", path, exc)
        return
    if not written:
        log.warning("--trace %s: only the offloading executor traces (give a policy or caps)", path)
