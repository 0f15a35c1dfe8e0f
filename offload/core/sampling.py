"""`SamplingParams` (vLLM's names and meanings) and the per-sequence sampler.

The logits of each sequence go through, in vLLM's order: the repetition, presence and
frequency penalties; `min_tokens` (EOS and stop ids masked until then); temperature;
top-k, top-p and min-p. Where transformers has a LogitsProcessor with exactly the
meaning (repetition penalty, min new tokens, temperature, top-k, top-p, min-p) it is
used as is; presence and frequency penalties (OpenAI's) are two lines of ours.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

# vLLM fields we take but whose only accepted value is "off" (docs/compat.md)
_REFUSED = ("best_of", "logprobs", "prompt_logprobs", "logit_bias", "allowed_token_ids")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    """How to pick tokens, with vLLM's field names. temperature 0 is greedy.

    Differences from vLLM's defaults: temperature is 0 (greedy) where vLLM's is 1.0, so
    runs are reproducible unless asked otherwise. `max_new_tokens` is an alias of
    `max_tokens`; `max_tokens=None` generates up to the model's context. top_k -1 (or 0),
    top_p 1 and min_p 0 switch those filters off. With a seed, sample i of n draws from
    its own generator seeded `seed + i`, whatever else shares its batch.

    Mutable, as vLLM's: its examples edit what `LLM.get_default_sampling_params()`
    returns. Values are judged when made and again when used: the engine runs on
    `checked()`, a validated copy, never on the caller's object, so an edit after the
    call changes nothing in flight and a bad edit fails before any work. (Being mutable,
    it is not hashable.)
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    skip_special_tokens: bool = True
    max_new_tokens: int | None = None  # alias: sets max_tokens (transformers' name), then None
    best_of: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict | None = None
    allowed_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        self.stop_token_ids = tuple(self.stop_token_ids or ())
        if self.max_new_tokens is not None:  # the alias sets max_tokens, then clears itself
            self.max_tokens, self.max_new_tokens = self.max_new_tokens, None
        self._validate()

    def checked(self) -> SamplingParams:
        """A validated copy of these params as they are now (fields may have been edited
        since they were made): what the engine generates with. ValueError names a bad
        value."""
        return replace(self)

    def _validate(self) -> None:
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        def integer(name: str, low: int) -> None:
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool), name, "an integer")
            need(value >= low, name, f"an integer >= {low}")

        integer("n", 1)
        if self.max_tokens is not None:
            integer("max_tokens", 1)
        integer("min_tokens", 0)
        integer("top_k", -1)
        need(_number(self.temperature) and self.temperature >= 0, "temperature", ">= 0")
        need(_number(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]")
        need(_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]")
        need(_number(self.repetition_penalty) and self.repetition_penalty > 0,
             "repetition_penalty", "> 0")  # fmt: skip
        for name in ("presence_penalty", "frequency_penalty"):
            need(_number(getattr(self, name)) and -2 <= getattr(self, name) <= 2, name,
                 "in [-2, 2]")  # fmt: skip
        need(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
             "seed", "an integer")  # fmt: skip
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "token ids (integers >= 0)")  # fmt: skip
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens {self.min_tokens} is more than max_tokens {self.max_tokens}"
            )
        for name in _REFUSED:
            if getattr(self, name) not in (None, 1 if name == "best_of" else None):
                raise ValueError(f"{name} is not supported by offload (docs/compat.md); drop it")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that changes the logits: the argmax of the raw logits."""
        return (
            self.greedy
            and self.repetition_penalty == 1.0
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
            and self.min_tokens == 0
        )

    def budget(self, prompt_tokens: int, context: int) -> int:
        """New tokens a sequence of this prompt length may get: max_tokens (None: up to
        the context), never past the context."""
        return min(self.max_tokens or context, context - prompt_tokens)

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "max_new_tokens"}
        out = {k: v for k, v in out.items() if k not in _REFUSED}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


def from_generation_config(config: dict[str, Any]) -> dict[str, Any]:
    """The sampling defaults a `generation_config.json` sets (vLLM's generation_config
    "auto": these five fields, as vLLM reads them)."""
    names = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"}
    out = {k: config[k] for k in names if config.get(k) is not None}
    if config.get("max_new_tokens") is not None:
        out["max_tokens"] = config["max_new_tokens"]
    return out


def make_generator(params: SamplingParams, sample_index: int = 0) -> torch.Generator | None:
    """A CPU generator for one sequence (seed + sample index), or None for greedy."""
    if params.greedy:
        return None
    gen = torch.Generator()
    if params.seed is None:
        gen.seed()
    else:
        gen.manual_seed(params.seed + sample_index)
    return gen


class SequenceSampler:
    """Picks the next token of one sequence from its logits and its tokens so far."""

    def __init__(
        self, params: SamplingParams, eos_ids: set[int], prompt_len: int, sample_index: int = 0
    ) -> None:
        self.params = params
        self.prompt_len = prompt_len
        self.generator = make_generator(params, sample_index)
        procs = LogitsProcessorList()
        if params.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
        ends = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids)
        if params.min_tokens and ends:
            procs.append(
                MinNewTokensLengthLogitsProcessor(prompt_len, params.min_tokens, sorted(ends))
            )
        self.processors = procs
        warpers = LogitsProcessorList()
        if not params.greedy:
            warpers.append(TemperatureLogitsWarper(float(params.temperature)))
            if params.top_k > 0:
                warpers.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                warpers.append(TopPLogitsWarper(float(params.top_p)))
            if params.min_p > 0.0:
                warpers.append(MinPLogitsWarper(float(params.min_p)))
        self.warpers = warpers

    def adjusted(self, logits: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
        """Penalties and min_tokens on fp32 logits [1, V]; token_ids: prompt + generated."""
        context = torch.tensor([token_ids], dtype=torch.long)
        logits = self.processors(context, logits)
        p = self.params
        if p.presence_penalty or p.frequency_penalty:
            generated = context[0, self.prompt_len :]
            counts = torch.bincount(generated, minlength=logits.shape[-1])[: logits.shape[-1]]
            counts = counts.to(logits.dtype)[None]
            logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)
        return logits

    def filtered(self, logits: torch.Tensor, token_ids: list[int]) -> torch.Tensor:
        """The logits the draw is made from: adjusted, then temperature/top-k/top-p/min-p."""
        context = torch.tensor([token_ids], dtype=torch.long)
        return self.warpers(context, self.adjusted(logits, token_ids))

    def __call__(self, logits: torch.Tensor, token_ids: list[int]) -> int:
        logits = logits.float().cpu()
        if self.params.greedy:
            return int(self.adjusted(logits, token_ids).argmax(dim=-1))
        probs = self.filtered(logits, token_ids).softmax(dim=-1)
        return int(torch.multinomial(probs[0], 1, generator=self.generator))


def sample_rows(
    logits: torch.Tensor, samplers: list[SequenceSampler], contexts: list[list[int]]
) -> torch.Tensor:
    """One token per row of logits [B, V], each row with its own sampler; ids [B] (CPU).

    contexts[i] is row i's prompt and generated tokens."""
    out = logits.argmax(dim=-1).cpu()
    for row, (sampler, context) in enumerate(zip(samplers, contexts, strict=True)):
        if not sampler.params.plain_greedy:
            out[row] = sampler(logits[row : row + 1], context)
    return out


def with_defaults(params: SamplingParams | None, defaults: dict[str, Any]) -> SamplingParams:
    """The caller's params, or SamplingParams built from the model's defaults."""
    return params if params is not None else replace(SamplingParams(), **defaults)


def sample(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One token per row of logits [B, V], every row with the same params and no history
    (penalties see no tokens); ids [B] on the CPU. Scripts' shortcut for `sample_rows`."""
    samplers = [SequenceSampler(params, set(), 0, row) for row in range(logits.shape[0])]
    return sample_rows(logits, samplers, [[] for _ in samplers])
