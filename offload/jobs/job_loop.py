"""A job's loop: every request not yet in the sink generated, a window of whole blocks
at a time (each window sorted by prompt length, cut into blocks of the engine's batch
size: `policies.job.window_requests`, as the plan predicted them), and the results
written block by block; the stop flag a signal raises; a request's result row."""

from __future__ import annotations

import collections
import logging
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from offload.core.errors import UserError
from offload.jobs import openai_batch
from offload.jobs.job import JobRequest
from offload.policies.job import window_requests

log = logging.getLogger(__name__)

# the characters of a prompt that its error result copies: enough to find it, and a
# prompt refused for its size (megabytes) is not written back whole
ERROR_PROMPT_CHARS = 200


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
    """SIGINT (Ctrl-C) or SIGTERM once: finish the current block and stop; twice: abandon it.

    It takes over the signals that interrupt the process now (Python's Ctrl-C handler:
    SIGINT, and SIGTERM under `cli.common.run_cli`); a rank leaves SIGTERM to its
    launcher, which stops ranks with it."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopFlag:
        def handler(signum, frame):
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True
            name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            log.warning("%s: stopping after the current block (a second one abandons it)", name)

        self._previous = {
            sig: signal.signal(sig, handler)
            for sig in self.SIGNALS
            if signal.getsignal(sig) is signal.default_int_handler
        }
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def result_row(req: JobRequest, out=None, error: str | None = None, model: str = "") -> dict:
    """The output line of a request (with "_index" for ordering): our flat shape, or the
    Batch API's for OpenAI lines."""
    error = error if error is not None else (req.error if out is None else None)
    if req.kind != "flat":
        if error is not None:
            row = openai_batch.error_line(req.id, error)
        else:
            row = openai_batch.result_line(req.id, req.kind, model, out)
        return {"_index": req.index, **row}
    row: dict[str, Any] = {"_index": req.index, "id": req.id}
    if req.prompt is not None:  # an error's row names its prompt by a prefix only
        cut = error is not None and len(req.prompt) > ERROR_PROMPT_CHARS
        row["prompt"] = req.prompt[:ERROR_PROMPT_CHARS] + "..." if cut else req.prompt
    if error is not None:
        return {**row, "text": "", "prompt_tokens": 0, "completion_tokens": 0,
                "finish_reason": "error", "error": error}  # fmt: skip
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
    sink,
    stats: JobStats,
    stop: StopFlag,
    on_block: Callable[[], None] | None = None,
    prompt_limit: int | None = None,
) -> None:
    """Generate every request not yet in the sink; results land block by block.

    prompt_limit: the longest prompt the plan fits in the memory caps (offload-run with
    --skip-invalid, `cli.sizing`); a longer one is an error result."""
    window = window_requests(llm.batch_size)  # whole blocks, as the plan predicted them
    pending: list[tuple[JobRequest, list[int]]] = []
    errors: list[dict[str, Any]] = []
    model = llm.model_name

    def record(rows: list[dict[str, Any]], reasons: list[str], tokens: int) -> None:
        sink.append(rows)
        stats.reasons.update(reasons)
        stats.generated_tokens += tokens
        stats.done += len(rows)

    def flush_window() -> None:
        nonlocal errors
        pending.sort(key=lambda item: len(item[1]))
        for start in range(0, len(pending), llm.batch_size):
            block = pending[start : start + llm.batch_size]
            outs = llm.generate_ids([(ids, req.params) for req, ids in block])
            for (req, _), out in zip(block, outs, strict=True):
                out.prompt = req.prompt
            rows = [
                result_row(req, out, model=model) for (req, _), out in zip(block, outs, strict=True)
            ]
            reasons = [out.finish_reason for out in outs] + ["error"] * len(errors)
            record(rows + errors, reasons, sum(out.completion_tokens for out in outs))
            errors = []
            if on_block:
                on_block()
            if stop.requested:
                stats.interrupted = True
                return
        pending.clear()
        if errors:  # a window of nothing but errors
            record(errors, ["error"] * len(errors), 0)
            errors = []

    for req in requests:
        if sink.done(req.index):
            continue
        if req.error is None:
            try:
                ids = encode_request(llm, req)
                llm.check_prompt(ids)
                _check_planned(ids, prompt_limit)
                pending.append((req, ids))
            except UserError as exc:
                errors.append(result_row(req, error=str(exc)))
        else:
            errors.append(result_row(req))
        if len(pending) >= window or len(errors) >= window:
            flush_window()
            if stats.interrupted:
                return
    flush_window()


def _check_planned(ids: list[int], prompt_limit: int | None) -> None:
    if prompt_limit is not None and len(ids) > prompt_limit:
        raise UserError(
            f"a prompt has {len(ids)} tokens but the plan fits at most {prompt_limit} in the "
            "memory caps; shorten it or raise the caps"
        )


def encode_request(llm, req: JobRequest) -> list[int]:
    """Token ids of a request: raw text or token ids as given, a chat templated. llm:
    an `LLM` or its `ModelFront` (offload-run measures the job before the load)."""
    if req.messages is not None:
        return llm.encode_chat(req.messages)
    if req.prompt_ids is not None:
        return list(req.prompt_ids)
    assert req.prompt is not None
    return llm.encode_prompt(req.prompt)
