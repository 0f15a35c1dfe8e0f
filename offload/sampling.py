"""`SamplingParams` and the sampler: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. temperature 0 (the default) is greedy decoding.

    top_k 0 and top_p 1.0 switch those filters off. A seed makes each sequence's
    draws reproducible on its own, whatever else shares its batch.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(
                f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}"
            )
        if (
            not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature))
            or self.temperature < 0
        ):
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generators(params: SamplingParams, count: int) -> list[torch.Generator] | None:
    """One CPU generator per sequence (seeded from params.seed), or None for greedy."""
    if params.greedy:
        return None
    gens = []
    for _ in range(count):
        gen = torch.Generator()
        if params.seed is None:
            gen.seed()
        else:
            gen.manual_seed(params.seed)
        gens.append(gen)
    return gens


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) on fp32 logits [B, V]."""
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator] | None
) -> torch.Tensor:
    """Pick one token per row of logits [B, V]; returns ids [B] on the CPU."""
    if params.greedy:
        return logits.argmax(dim=-1).cpu()
    probs = filter_logits(logits.float(), params).softmax(dim=-1).cpu()
    assert generators is not None and len(generators) == probs.shape[0]
    return torch.cat(
        [torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators, strict=True)]
    )


def sample_rows(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """One token per row, each row with its own sampling settings; ids [B] on the CPU."""
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1).cpu()
    out = logits.argmax(dim=-1).cpu()
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if not p.greedy:
            out[row] = sample(logits[row : row + 1], p, [gen])[0]
    return out
