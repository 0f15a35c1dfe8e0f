"""What generation returns, in vLLM's shape: a `RequestOutput` per prompt holding one
`CompletionOutput` per sample (`SamplingParams.n`)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One sample of a request. finish_reason: "stop" (EOS, a stop string or stop token
    id) or "length"; stop_reason: the stop string or token id that ended it, else None."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: str | int | None = None
    cumulative_logprob: float | None = None
    logprobs: None = None

    def finished(self) -> bool:
        """Whether this sample has ended (vLLM's; every returned sample has)."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When a request went through the engine, in vLLM's field names: seconds since the
    epoch (`time.time()`), each read on the host where the loop learns of it (a token's
    time is when the host has its id: no device sync is added for it). arrival: the call
    that brought it; first_scheduled: its block's start; first_token: the prefill's
    token; last_token and finished: its last sample's last token."""

    arrival_time: float
    last_token_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    time_in_queue: float | None = None
    finished_time: float | None = None
    scheduler_time: float | None = None
    model_forward_time: float | None = None
    model_execute_time: float | None = None


@dataclass
class RequestOutput:
    """A finished request: its prompt (text where it had one) and token ids, and its
    samples in `outputs`. `.text`, `.token_ids` and `.finish_reason` are shortcuts to
    `outputs[0]` (not vLLM API)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: None = None
    metrics: RequestMetrics | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


@dataclass
class GenerationStats:
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    batches: int = 0
    # each batch as it ran: rows, longest prompt, decode steps, prefill and decode
    # seconds, and when it started (seconds on the host's monotonic clock), so a job's
    # time between its blocks shows beside the blocks' own (`--stats`)
    timeline: list[dict[str, float]] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0
