"""offload-run's inputs and outputs: where requests come from (--prompt, --chat, or a
file: ours, OpenAI Batch or plain text) and where results go (a locked, resumable
JSONL file, standard output, or the terminal), and the reports written at the end.
All checked before the model loads."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from offload.core.errors import UserError
from offload.core.sampling import SamplingParams
from offload.executor.runner import prefill_trace_path
from offload.io.atomic import check_writable
from offload.jobs import job
from offload.jobs.resultlog import MemorySink, ResultLog


@dataclass
class Source:
    """The job's requests, counted and fingerprinted; `requests(defaults)` parses them."""

    total: int
    sha256: str
    requests: Callable[[SamplingParams], Iterator[job.JobRequest]]
    from_flags: bool  # --prompt / --chat: a bad one fails the run
    spooled: Path | None = None
    invalid: int = 0  # lines refused by their schema (error results)


def check_output(output: str | None, restart: bool = False) -> Path | None:
    """Fail before any model loading when the output cannot be written, or holds a
    finished job's results that the run would replace (without --restart)."""
    if output in (None, "-"):
        return None
    path = Path(output)
    partial = path.with_name(path.name + ".partial")
    if path.is_file() and not partial.exists() and not restart:
        raise UserError(
            f"--output {path} already holds a finished job's results; add --restart to run "
            "the job again and replace them, or give another --output"
        )
    if path.is_dir():
        raise UserError(f"--output {path} is a directory; give a file path")
    if not path.parent.is_dir():
        raise UserError(f"cannot write --output {path}: directory {path.parent} is missing")
    check_writable(path, "--output")
    return path


def check_reports(args: argparse.Namespace) -> None:
    """The files written at the end of a run (--stats, --trace and the prefill trace
    beside it) can be written: refused before the load, not after the job."""
    if args.stats is not None:
        check_writable(args.stats, "--stats")
    if args.trace is not None:
        check_writable(args.trace, "--trace")
        check_writable(prefill_trace_path(args.trace), "--trace")


def open_source(args: argparse.Namespace, output: Path | None) -> Source:
    """Every input line checked against its schema (duplicates and all-bad refused)."""
    flags = [{"prompt": t} for t in args.prompt or []]
    flags += [{"messages": [{"role": "user", "content": t}]} for t in args.chat or []]
    if args.input is not None and flags:
        raise UserError("give --prompt/--chat or -i FILE, not both")
    if args.input is None:
        if not flags:
            raise UserError("nothing to generate: give --prompt TEXT, --chat TEXT or -i FILE")
        sha = hashlib.sha256(json.dumps(flags).encode()).hexdigest()

        def from_flags(defaults: SamplingParams) -> Iterator[job.JobRequest]:
            return (job.make_request(i, obj, defaults) for i, obj in enumerate(flags))

        for req in from_flags(SamplingParams()):
            error = req.error or job.text_problem(flags[req.index])
            if error:  # (a byte that is not UTF-8 comes in as a lone surrogate)
                raise UserError(f"prompt {req.id}: {error}")
        return Source(len(flags), sha, from_flags, from_flags=True)
    path, spooled = args.input, None
    if str(path) == "-" or _is_stream(path):  # read once: copied first, removed at the end
        path = spooled = job.spool(
            None if str(path) == "-" else path,
            output.parent if output else Path(tempfile.gettempdir()),
        )
    try:
        scan = job.scan(path, args.skip_invalid)
    except BaseException:
        if spooled is not None:
            spooled.unlink(missing_ok=True)
        raise
    return Source(
        scan.count,
        scan.sha256,
        lambda defaults: job.iter_requests(path, defaults, scan.format),
        from_flags=False,
        spooled=spooled,
        invalid=scan.invalid,
    )


def _is_stream(path: Path) -> bool:
    """A pipe or a device (`-i <(cmd)`, /dev/stdin): its lines can be read only once."""
    return path.exists() and not path.is_file() and not path.is_dir()


def open_sink(
    output: Path | None, fingerprint: dict, restart: bool, total: int | None = None
) -> ResultLog | MemorySink:
    """A locked, resumable result file, or memory (printed at the end)."""
    return ResultLog(output, fingerprint, restart, total) if output else MemorySink()


def write_results(sink: ResultLog | MemorySink, total: int, to_stdout: bool) -> None:
    if isinstance(sink, ResultLog):
        sink.finalize(total)
    elif to_stdout:
        sys.stdout.write(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in sink.sorted_rows())
        )
    else:
        for row in sink.sorted_rows():
            if "custom_id" in row:
                print(json.dumps(row, ensure_ascii=False))
                continue
            text = row["text"] if row["finish_reason"] != "error" else f"error: {row['error']}"
            prompt = row.get("prompt")  # (a chat's row has none)
            print(f"[{row['id']}] {prompt}\n{text}\n" if prompt else f"[{row['id']}]\n{text}\n")
