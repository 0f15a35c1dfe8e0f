"""What `LLM.generate` takes as prompts and sampling, turned into what the decode loop
runs: each prompt's text (None for token ids given) and token ids through the model's
front, and one validated `SamplingParams` a prompt (vLLM's forms: one for all, one a
prompt, or None for the model's defaults)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from offload.api.front import ModelFront
from offload.core.errors import UserError
from offload.core.sampling import SamplingParams

Prompt = str | dict[str, Any] | list[int]


def encode_prompts(
    front: ModelFront, prompts: Prompt | Sequence[Prompt] | None
) -> list[tuple[str | None, list[int]]]:
    """(text, token ids) of one prompt or of each of a list of them."""
    if prompts is None:
        raise UserError(
            "generate() got no prompts (None); pass a prompt, a list of prompts or "
            '{"prompt_token_ids": [...]}'
        )
    # one prompt, or what is no list of them (its type is refused by `prompt_ids`)
    if (
        isinstance(prompts, (str, dict))
        or not hasattr(prompts, "__iter__")
        or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
    ):
        prompts = [prompts]
    return [prompt_ids(front, p) for p in prompts]


def prompt_ids(front: ModelFront, prompt: Prompt) -> tuple[str | None, list[int]]:
    """Text (never templated), {"prompt_token_ids": [...]}, {"prompt": text} or a list
    of token ids: its text (None where ids were given) and token ids."""
    if isinstance(prompt, str):
        return prompt, front.encode_prompt(prompt)
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
                raise UserError(f'"prompt_token_ids" must be a list of token ids, got {ids!r:.40}')
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], front.encode_prompt(prompt["prompt"])
        raise UserError('a prompt dict needs "prompt" (text) or "prompt_token_ids"')
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
        return None, list(prompt)
    raise UserError(
        f'a prompt must be text, a token-id list, {{"prompt": text}} or '
        f'{{"prompt_token_ids": [...]}} (or a list of these), got {type(prompt).__name__}'
    )


def params_for(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    count: int,
    defaults: SamplingParams,
) -> list[SamplingParams]:
    """One SamplingParams a prompt: the one given for all, one a prompt, or None for
    the model's defaults."""
    if sampling_params is None or isinstance(sampling_params, SamplingParams):
        return [sampling_params or defaults] * count
    params = list(sampling_params)
    if len(params) != count:
        raise ValueError(
            f"{len(params)} sampling params for {count} prompts; give one, or one per prompt"
        )
    return params


def checked(params: list[SamplingParams]) -> list[SamplingParams]:
    """A validated copy of each distinct params object as it is now (`checked`)."""
    copies: dict[int, SamplingParams] = {}
    for p in params:
        if id(p) not in copies:
            copies[id(p)] = p.checked()
    return [copies[id(p)] for p in params]
