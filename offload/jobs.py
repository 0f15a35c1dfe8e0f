"""Batch generation jobs: streaming requests in, durable and resumable results out.

A job reads requests (JSONL or plain text) lazily, a window at a time; sorts each
window by prompt length and cuts it into blocks of the engine's batch size (less
padding); appends each finished block's results to `<output>.partial` and fsyncs it;
and at the end writes the results in input order to `<output>` (temporary file, fsync,
rename). Killed at any moment and started again with the same command, it skips what
`<output>.partial` holds: nothing lost, nothing twice. The partial file's first line
records a fingerprint of the input bytes and the generation settings; a run whose
input or settings differ is refused (`--restart` starts over).
"""

from __future__ import annotations

import array
import collections
import hashlib
import json
import logging
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from offload.errors import UserError
from offload.sampling import SamplingParams

log = logging.getLogger(__name__)

SAMPLING_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop")
KNOWN_FIELDS = {"id", "prompt", "messages", *SAMPLING_FIELDS}


@dataclass(frozen=True)
class JobRequest:
    """One input line: a prompt or chat messages with sampling, or the error it makes."""

    index: int
    id: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    params: SamplingParams | None = None
    error: str | None = None


# -- input ------------------------------------------------------------------------------
def spool_stdin(directory: Path) -> Path:
    """Copy standard input to a file so it can be checked and fingerprinted first."""
    import sys

    fd, name = tempfile.mkstemp(prefix="offload-stdin-", suffix=".input", dir=directory)
    with os.fdopen(fd, "wb") as f:
        while chunk := sys.stdin.buffer.read(1 << 20):
            f.write(chunk)
    return Path(name)


def _is_jsonl(path: Path) -> bool:
    if path.suffix in (".jsonl", ".json"):
        return True
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                return line.lstrip().startswith("{")
    return False


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of the non-blank lines."""
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield lineno, line.rstrip("\n")
    except FileNotFoundError:
        raise UserError(f"prompts file {path} does not exist; check the path") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"prompts file {path} is not UTF-8 text ({exc.reason})") from None


def scan(path: Path, skip_invalid: bool) -> tuple[int, str]:
    """Check every line parses (before any generation) and count the requests.

    Returns (count, sha256 of the file). A malformed JSON line is a `UserError` with its
    line number unless skip_invalid, which lets it through as an error result.
    """
    digest = hashlib.sha256()
    try:
        with path.open("rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except FileNotFoundError:
        raise UserError(f"prompts file {path} does not exist; check the path") from None
    jsonl = _is_jsonl(path)
    count = 0
    for lineno, line in _lines(path):
        count += 1
        if jsonl and not skip_invalid:
            try:
                json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(
                    f"{path}:{lineno}: not valid JSON ({exc.msg}); fix the line, or pass "
                    "--skip-invalid to record it as an error and go on"
                ) from None
    if count == 0:
        raise UserError(f"prompts file {path} holds no prompts")
    return count, digest.hexdigest()


def make_request(
    index: int, obj: Any, defaults: SamplingParams, lineno: int | None = None
) -> JobRequest:
    """Validate one request object; problems become the request's error, not a crash.

    Without an "id" the request is named by its line number (its position otherwise)."""
    default_id = str(lineno if lineno is not None else index + 1)
    if not isinstance(obj, dict):
        return JobRequest(index, default_id, error="a line must be a JSON object")
    rid = str(obj.get("id", default_id))
    unknown = sorted(set(obj) - KNOWN_FIELDS)
    if unknown:
        return JobRequest(index, rid, error=f"unknown field(s): {', '.join(unknown)}")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if (prompt is None) == (messages is None):
        return JobRequest(index, rid, error='give exactly one of "prompt" or "messages"')
    if prompt is not None and not isinstance(prompt, str):
        return JobRequest(index, rid, error='"prompt" must be a string')
    if messages is not None and (
        not isinstance(messages, list)
        or not messages
        or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and m.get("role")
            for m in messages
        )
    ):
        return JobRequest(index, rid, error='"messages" must be a list of {"role", "content"}')
    if prompt is not None and not prompt.strip():
        return JobRequest(index, rid, error="empty prompt")
    overrides = {k: obj[k] for k in SAMPLING_FIELDS if k in obj}
    if isinstance(overrides.get("stop"), list):
        overrides["stop"] = tuple(overrides["stop"])
    try:
        params = SamplingParams(**{**_as_dict(defaults), **overrides})
    except (ValueError, TypeError) as exc:
        return JobRequest(index, rid, error=f"invalid sampling value: {exc}")
    return JobRequest(index, rid, prompt, messages, params)


def _as_dict(params: SamplingParams) -> dict[str, Any]:
    return {f.name: getattr(params, f.name) for f in fields(params)}


def iter_requests(path: Path, defaults: SamplingParams) -> Iterator[JobRequest]:
    """Requests in input order, parsed one line at a time."""
    jsonl = _is_jsonl(path)
    for index, (lineno, line) in enumerate(_lines(path)):
        if not jsonl:
            yield make_request(index, {"prompt": line}, defaults, lineno)
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            yield JobRequest(index, str(lineno), error=f"line {lineno}: not valid JSON ({exc.msg})")
            continue
        yield make_request(index, obj, defaults, lineno)


# -- durable output ------------------------------------------------------------------------
class ResultLog:
    """`<output>.partial`: a header with the job fingerprint, then one result a line."""

    def __init__(self, output: Path, fingerprint: dict[str, Any], restart: bool) -> None:
        self.output = output
        self.partial = output.with_name(output.name + ".partial")
        self.fingerprint = fingerprint
        self._done = bytearray()
        self.done_count = 0
        if restart and self.partial.exists():
            self.partial.unlink()
        if self.partial.exists():
            self._load()
        else:
            with self.partial.open("w", encoding="utf-8") as f:
                f.write(json.dumps({"_job": fingerprint}) + "\n")
                f.flush()
                os.fsync(f.fileno())
        self._file = self.partial.open("a", encoding="utf-8")

    def _load(self) -> None:
        with self.partial.open("rb") as f:
            data = f.read()
        lines = data.split(b"\n")
        torn = lines.pop()  # after the last newline: empty, or a line cut by a crash
        try:
            header = json.loads(lines[0])["_job"] if lines else None
        except (json.JSONDecodeError, KeyError, TypeError):
            header = None
        if header != self.fingerprint:
            changed = sorted(
                k for k in self.fingerprint if not header or header.get(k) != self.fingerprint[k]
            )
            raise UserError(
                f"{self.partial} belongs to a job with a different {', '.join(changed) or 'header'}; "
                "run the same command as before to resume it, or add --restart to start over"
            )
        for line in lines[1:]:
            self._mark(json.loads(line)["_index"])
        if torn:
            with self.partial.open("r+b") as f:
                f.truncate(len(data) - len(torn))
            log.info("dropped a partly written result line from the interrupted run")

    def _mark(self, index: int) -> None:
        if index >= len(self._done):
            self._done.extend(bytes(index + 1 - len(self._done) + 1024))
        if not self._done[index]:
            self._done[index] = 1
            self.done_count += 1

    def done(self, index: int) -> bool:
        return index < len(self._done) and bool(self._done[index])

    def append(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        self._file.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        self._file.flush()
        os.fsync(self._file.fileno())
        for row in rows:
            self._mark(row["_index"])

    def finalize(self, total: int) -> None:
        """Write the results in input order to the output file, atomically."""
        self._file.close()
        offsets = array.array("q", [-1]) * total
        with self.partial.open("rb") as f:
            f.readline()
            while True:
                pos = f.tell()
                line = f.readline()
                if not line:
                    break
                offsets[json.loads(line)["_index"]] = pos
        missing = offsets.count(-1)
        assert missing == 0, f"{missing} results missing at finalize"
        tmp = self.output.with_name(self.output.name + ".tmp")
        with self.partial.open("rb") as src, tmp.open("w", encoding="utf-8") as dst:
            for pos in offsets:
                src.seek(pos)
                row = json.loads(src.readline())
                del row["_index"]
                dst.write(json.dumps(row, ensure_ascii=False) + "\n")
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, self.output)
        self.partial.unlink()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


# -- the job loop ----------------------------------------------------------------------------
@dataclass
class JobStats:
    total: int = 0
    done: int = 0
    skipped: int = 0  # done by an earlier run
    generated_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    reasons: collections.Counter = field(default_factory=collections.Counter)
    phase: str = "loading"
    interrupted: bool = False


class StopFlag:
    """SIGINT once: finish the current block and stop; twice: abandon it."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> StopFlag:
        def handler(signum, frame):
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True
            log.warning("stopping after the current block (Ctrl-C again to abandon it)")

        self._previous = signal.signal(signal.SIGINT, handler)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)


def result_row(req: JobRequest, out=None, error: str | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {"_index": req.index, "id": req.id}
    if req.prompt is not None:
        row["prompt"] = req.prompt
    if error is not None or out is None:
        return {
            **row,
            "text": "",
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "finish_reason": "error",
            "error": error or req.error,
        }
    return {
        **row,
        "text": out.text,
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "finish_reason": out.finish_reason,
    }


def run_job(
    llm,
    requests: Iterator[JobRequest],
    sink: ResultLog,
    stats: JobStats,
    chat: bool,
    stop: StopFlag,
    on_block=None,
) -> None:
    """Generate every request not yet in the sink; results land block by block."""
    window = max(llm.batch_size * 8, 64)
    pending: list[tuple[JobRequest, list[int]]] = []
    errors: list[dict[str, Any]] = []

    def flush_window() -> None:
        nonlocal errors
        pending.sort(key=lambda item: len(item[1]))
        for start in range(0, len(pending), llm.batch_size):
            block = pending[start : start + llm.batch_size]
            outs = llm.generate_ids([(ids, req.params) for req, ids in block])
            rows = [result_row(req, out) for (req, _), out in zip(block, outs, strict=True)]
            sink.append(rows + errors)
            for row in rows + errors:
                stats.reasons[row["finish_reason"]] += 1
                stats.generated_tokens += row["completion_tokens"]
            stats.done += len(rows) + len(errors)
            errors = []
            if on_block:
                on_block()
            if stop.requested:
                stats.interrupted = True
                return
        pending.clear()
        if errors:  # a window of nothing but errors
            sink.append(errors)
            stats.reasons["error"] += len(errors)
            stats.done += len(errors)
            errors = []

    for req in requests:
        if sink.done(req.index):
            continue
        row = None
        if req.error is None:
            try:
                ids = encode_request(llm, req, chat)
                llm.check_prompt(ids)
                pending.append((req, ids))
            except UserError as exc:
                row = result_row(req, error=str(exc))
        else:
            row = result_row(req)
        if row is not None:
            errors.append(row)
        if len(pending) >= window or len(errors) >= window:
            flush_window()
            if stats.interrupted:
                return
    flush_window()


def encode_request(llm, req: JobRequest, chat: bool) -> list[int]:
    """Token ids of a request's prompt (chat template applied where asked)."""
    tok = llm.tokenizer
    if req.messages is not None:
        if not tok.has_chat_template:
            raise UserError('this model\'s tokenizer has no chat template for "messages"')
        return tok.encode(tok.render_chat(req.messages), add_special_tokens=False)
    assert req.prompt is not None
    return llm.encode_prompt(req.prompt, chat=chat and tok.has_chat_template)
