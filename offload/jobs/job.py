"""Batch generation jobs: streaming requests in, durable and resumable results out.

A job reads requests lazily, a window at a time, from one of three formats: our flat
JSONL (`prompt` raw text or `messages` a chat, with sampling fields), OpenAI Batch API
lines (spotted by `custom_id`; `offload.jobs.openai_batch`), or plain text, one prompt a
line. Every line is checked against its format's schema by `scan` before the model
loads: duplicate ids are refused, and a file of nothing but bad lines is an error.
Each window (whole blocks: `policies.job.window_requests`) is sorted by prompt length
and cut into blocks of the engine's batch size; finished blocks go to a `ResultLog`
(`offload.jobs.resultlog`), durable and resumable.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from offload.core.errors import UserError
from offload.core.sampling import SAMPLING_FIELDS, SamplingParams
from offload.io.atomic import NO_SPACE, disk_full
from offload.jobs import openai_batch

log = logging.getLogger(__name__)

KNOWN_FIELDS = {"id", "prompt", "messages", *SAMPLING_FIELDS}
FORMATS = ("text", "jsonl", "openai")
FORMAT_NAMES = {
    "text": "plain text, one prompt a line",
    "jsonl": "JSON lines in offload's format",
    "openai": "OpenAI Batch lines",
}
# a JSON escape of a surrogate (paired or lone: `text_problem` tells them apart)
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
# a request's id as the input line gives it: a JSON scalar, written back unchanged
RequestId = str | int | float | bool | None


@dataclass(frozen=True)
class JobRequest:
    """One input line: a prompt (text or token ids) or chat messages with sampling, or
    the error it makes. kind: "flat" (ours), "completions" or "chat" (OpenAI)."""

    index: int
    id: RequestId
    kind: str = "flat"
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    params: SamplingParams | None = None
    error: str | None = None


# -- input ------------------------------------------------------------------------------
def spool(source: Path | None, directory: Path) -> Path:
    """Copy standard input (source None), or a pipe, to a file in `directory` so it can be
    checked and fingerprinted first; the caller removes it when the run ends."""
    import sys

    fd, name = tempfile.mkstemp(prefix="offload-stdin-", suffix=".input", dir=directory)
    copied = 0
    try:
        with (
            os.fdopen(fd, "wb") as f,
            nullcontext(sys.stdin.buffer) if source is None else source.open("rb") as stream,
        ):
            while chunk := stream.read(1 << 20):
                copied += len(chunk)
                f.write(chunk)
    except OSError as exc:
        Path(name).unlink(missing_ok=True)
        if exc.errno in NO_SPACE:
            fix = "free space there, or give -i a file instead of a pipe"
            raise disk_full(Path(name), copied, fix, at_least=True) from None
        raise
    return Path(name)


def check_input(path: Path) -> None:
    """The input exists and is a file that can be read (a pipe is spooled first)."""
    if not path.exists():
        raise UserError(f"prompts file {path} does not exist; check the path")
    if path.is_dir():
        raise UserError(f"prompts file {path} is a directory; give a file of prompts")
    if not os.access(path, os.R_OK):
        raise UserError(f"cannot read prompts file {path}: permission denied")


# a byte-order mark is read as whitespace: editors on Windows begin UTF-8 files with one
BOM = "\ufeff"


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of the non-blank lines (a byte-order mark is blank)."""
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                line = line.rstrip("\n").strip(BOM)
                if line.strip():
                    yield lineno, line
    except FileNotFoundError:
        raise UserError(f"prompts file {path} does not exist; check the path") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"prompts file {path} is not UTF-8 text ({exc.reason})") from None


def file_format(path: Path) -> str:
    """The format of a file, from its first non-blank line: a JSON object with custom_id
    is "openai", any other JSON object (or a line that opens one) "jsonl", anything else
    "text", one prompt a line, but for a .jsonl/.json name, which is "jsonl" (its bad
    first line is then named)."""
    for _, line in _lines(path):
        if line.lstrip().startswith("{"):
            try:
                first = json.loads(line)
            except json.JSONDecodeError:
                return "jsonl"
            return "openai" if openai_batch.is_openai_line(first) else "jsonl"
        return "jsonl" if path.suffix in (".jsonl", ".json") else "text"
    return "jsonl"


@dataclass(frozen=True)
class Scan:
    count: int
    sha256: str
    format: str
    invalid: int


def scan(path: Path, skip_invalid: bool) -> Scan:
    """Check every line against its format's schema, before any model loading.

    Unparsable JSON is a `UserError` naming the line unless skip_invalid (then an error
    result); schema errors become error results; duplicate ids and a file without one
    good line are `UserError`s."""
    check_input(path)
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    fmt = file_format(path)
    log.info("input %s: %s, detected from its content", path, FORMAT_NAMES[fmt])
    seen: dict[str, int] = {}
    duplicates: list[str] = []
    bad: list[str] = []
    count = 0
    for req, lineno in _requests(path, SamplingParams(), fmt, strict=not skip_invalid):
        count += 1
        if req.error is not None:
            bad.append(f"line {lineno}: {req.error}")
        key = json.dumps(req.id)  # 7 and "7" are different ids, as true and 1 are
        if key in seen:
            duplicates.append(f"{req.id!r} on lines {seen[key]} and {lineno}")
        seen.setdefault(key, lineno)
    if count == 0:
        raise UserError(f"prompts file {path} holds no prompts")
    name = "custom_id" if fmt == "openai" else "id"
    if duplicates:
        raise UserError(
            f"{path}: duplicate {name}s: {'; '.join(duplicates[:5])}"
            f"{' ...' if len(duplicates) > 5 else ''}; give every request its own {name}"
        )
    if len(bad) == count and fmt != "openai":  # (a Batch file gets an error line each)
        raise UserError(f"{path}: no valid request in {count} line(s); {bad[0]}")
    for problem in bad[:20]:
        log.warning("%s: %s (recorded as an error result)", path, problem)
    return Scan(count, digest.hexdigest(), fmt, len(bad))


def make_request(
    index: int, obj: Any, defaults: SamplingParams, lineno: int | None = None
) -> JobRequest:
    """Validate one flat request object; problems become the request's error.

    Without an "id" the request is named by its line number (its position otherwise); an
    id is kept as the line gives it (a number stays a number), and must be a scalar."""
    default_id = str(lineno if lineno is not None else index + 1)
    if not isinstance(obj, dict):
        return JobRequest(index, default_id, error="a line must be a JSON object")
    rid = obj.get("id", default_id)
    if isinstance(rid, (dict, list)):
        return JobRequest(
            index,
            default_id,
            error=f'"id" must be a string or a number, got {json.dumps(rid)[:40]}; give a scalar id',
        )
    unknown = sorted(set(obj) - KNOWN_FIELDS)
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if prompt is None and messages is None:
        found = f" (found {', '.join(unknown)})" if unknown else ""
        return JobRequest(
            index, rid, error=f'no prompt: give "prompt" (raw text) or "messages" (a chat){found}'
        )
    if unknown:
        return JobRequest(index, rid, error=f"unknown field(s): {', '.join(unknown)}")
    if prompt is not None and messages is not None:
        return JobRequest(index, rid, error='give exactly one of "prompt" or "messages"')
    if prompt is not None and not isinstance(prompt, str):
        return JobRequest(index, rid, error='"prompt" must be a string')
    if messages is not None:
        try:
            messages = openai_batch.chat_messages(messages)
        except ValueError as exc:
            return JobRequest(index, rid, error=str(exc))
    if prompt is not None and not prompt.strip():
        return JobRequest(index, rid, error="empty prompt")
    params = _params(defaults, {k: obj[k] for k in SAMPLING_FIELDS if k in obj})
    if isinstance(params, str):
        return JobRequest(index, rid, error=params)
    if params.n > 1:
        return JobRequest(index, rid, error="n > 1 needs the OpenAI batch format (choices)")
    return JobRequest(index, rid, "flat", prompt, None, messages, params)


def _params(defaults: SamplingParams, overrides: dict[str, Any]) -> SamplingParams | str:
    """Defaults with a line's overrides, or the error message."""
    for name in ("stop", "stop_token_ids"):
        if isinstance(overrides.get(name), list):
            overrides[name] = tuple(overrides[name])
    try:
        values = defaults.to_dict() | overrides
        return SamplingParams(**values)
    except (ValueError, TypeError) as exc:
        return f"invalid sampling value: {exc}"


def make_openai_request(index: int, obj: Any, defaults: SamplingParams, lineno: int) -> JobRequest:
    """Validate one OpenAI Batch line; problems become the request's error."""
    custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
    rid = custom_id if isinstance(custom_id, str) and custom_id else f"line-{lineno}"
    try:
        rid, kind, body = openai_batch.parse_line(obj)
        prompt, overrides = openai_batch.body_request(kind, body)
    except ValueError as exc:
        return JobRequest(index, rid, "chat", error=str(exc))
    params = _params(defaults, overrides)
    if isinstance(params, str):
        return JobRequest(index, rid, kind, error=params)
    text = prompt.get("prompt")
    if text is not None and not text.strip():
        return JobRequest(index, rid, kind, error="empty prompt")
    return JobRequest(
        index, rid, kind, text, prompt.get("prompt_token_ids"), prompt.get("messages"), params
    )


def _requests(
    path: Path, defaults: SamplingParams, fmt: str, strict: bool = False
) -> Iterator[tuple[JobRequest, int]]:
    for index, (lineno, line) in enumerate(_lines(path)):
        if fmt == "text":
            yield make_request(index, {"prompt": line}, defaults, lineno), lineno
            continue
        try:
            obj = json.loads(line)
            # (only a \ud800-\udfff escape makes a surrogate: the others skip the check)
            problem = text_problem(obj) if SURROGATE_ESCAPE.search(line) else None
        except json.JSONDecodeError as exc:
            obj, problem = None, f"not valid JSON ({exc.msg})"
        if problem is not None:
            if strict:
                raise UserError(
                    f"{path}:{lineno}: {problem}; fix the line, or pass --skip-invalid to "
                    "record it as an error and go on"
                )
            kind = "chat" if fmt == "openai" else "flat"
            yield JobRequest(index, _line_id(obj, fmt, lineno), kind, error=problem), lineno
            continue
        if fmt == "openai":
            yield make_openai_request(index, obj, defaults, lineno), lineno
        else:
            yield make_request(index, obj, defaults, lineno), lineno


def _line_id(obj: Any, fmt: str, lineno: int) -> RequestId:
    """The id of a line refused whole: its own where it is a scalar of text, else one
    made of its line number."""
    name, made = ("custom_id", f"line-{lineno}") if fmt == "openai" else ("id", str(lineno))
    rid = obj.get(name) if isinstance(obj, dict) else None
    if isinstance(rid, (str, int, float)) and text_problem(rid) is None:
        return rid
    return made


def text_problem(obj: Any) -> str | None:
    """Why a request's strings are not Unicode text, or None: a lone surrogate (a JSON
    `\\ud800` escape without its pair, or a command-line byte that is not UTF-8), which no
    tokenizer encodes and no UTF-8 result file can hold."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(exc.object[exc.start])
        return f"the request holds a lone surrogate (\\u{code:04x}), which is not Unicode text"
    return None


def iter_requests(path: Path, defaults: SamplingParams, fmt: str) -> Iterator[JobRequest]:
    """Requests in input order, parsed one line at a time."""
    return (req for req, _ in _requests(path, defaults, fmt))
