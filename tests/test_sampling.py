"""Sampler: vLLM's fields and meanings, transformers' processors as the reference, seeds."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from offload.core.sampling import SamplingParams, SequenceSampler, from_generation_config, sample


def _kept(params: SamplingParams, logits: torch.Tensor) -> list[bool]:
    return SequenceSampler(params, set(), 0).filtered(logits, []).isfinite()[0].tolist()


def test_top_k_keeps_the_k_largest_and_minus_one_is_off():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    assert _kept(SamplingParams(temperature=1.0, top_k=2), logits) == [
        False,
        True,
        False,
        True,
        False,
    ]
    assert all(_kept(SamplingParams(temperature=1.0, top_k=-1), logits))
    assert all(_kept(SamplingParams(temperature=1.0, top_k=0), logits))


def test_top_p_and_min_p_keep_the_expected_sets():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert _kept(SamplingParams(temperature=1.0, top_p=0.7), probs.log()) == [
        True,
        True,
        False,
        False,
    ]
    assert _kept(SamplingParams(temperature=1.0, top_p=0.85), probs.log()) == [
        True,
        True,
        True,
        False,
    ]
    # min_p 0.2: tokens below 0.2 * 0.5 = 0.1 go
    assert _kept(SamplingParams(temperature=1.0, min_p=0.2), probs.log()) == [
        True,
        True,
        True,
        False,
    ]


def test_filters_equal_transformers_processors():
    torch.manual_seed(0)
    logits = torch.randn(1, 50)
    context = [3, 7, 7, 9]
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.9, repetition_penalty=1.3)
    ours = SequenceSampler(params, set(), 2).filtered(logits.clone(), context)
    ids = torch.tensor([context])
    want = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone()) / 0.7
    want = TopKLogitsWarper(10)(ids, want)
    want = TopPLogitsWarper(0.9)(ids, want)
    assert torch.equal(ours.isfinite(), want.isfinite())
    assert torch.allclose(ours[ours.isfinite()], want[want.isfinite()])


def test_presence_and_frequency_penalties_count_only_the_output():
    logits = torch.zeros(1, 6)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    got = SequenceSampler(params, set(), 2).adjusted(logits, [1, 1, 2, 2, 2, 4])
    # prompt [1, 1] does not count; output 2 x3, 4 x1
    assert got[0].tolist() == [0, 0, -(0.5 + 0.75), 0, -(0.5 + 0.25), 0]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0]])  # EOS (2) would win, then stop id 3
    params = SamplingParams(min_tokens=2, stop_token_ids=[3])
    sampler = SequenceSampler(params, {2}, prompt_len=1)
    assert sampler(logits, [0]) == 0  # 0 generated: EOS and 3 masked
    assert sampler(logits, [0, 1]) == 0  # 1 generated
    assert sampler(logits, [0, 1, 1]) == 2  # 2 generated: free
    assert SequenceSampler(dataclasses.replace(params, ignore_eos=True), {2}, 1)(logits, [0]) == 2


def test_seeded_sampling_is_reproducible_and_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(4000, 1)
    seeded = SamplingParams(temperature=1.0, seed=7)
    first = sample(logits, seeded)
    assert torch.equal(first, sample(logits, seeded))
    # row i draws with seed + i: the rows differ, and follow the distribution
    freq = torch.bincount(first, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03), freq
    unseeded = sample(logits, SamplingParams(temperature=1.0))
    freq = torch.bincount(unseeded, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03), freq


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
    assert sample(logits, SamplingParams()).tolist() == [1, 0]


def test_max_new_tokens_is_an_alias_of_max_tokens():
    assert SamplingParams(max_new_tokens=7).max_tokens == 7
    assert SamplingParams().max_tokens == 16  # vLLM's default
    assert dataclasses.replace(SamplingParams(max_new_tokens=7), max_tokens=9).max_tokens == 9
    assert SamplingParams(max_tokens=None).max_tokens is None  # up to the context


def test_generation_config_defaults_as_vllm_reads_them():
    config = {
        "temperature": 0.6,
        "top_p": 0.9,
        "do_sample": True,
        "max_new_tokens": 40,
        "eos_token_id": 2,
    }
    assert from_generation_config(config) == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 40}


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_new_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"n": 0}, "n"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": 5}, "logprobs is not supported"),
        ({"best_of": 3}, "best_of is not supported"),
    ],
)
def test_invalid_values_name_the_field(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": "5"}, "top_k"),
        ({"stop": [""]}, "stop"),
        ({"logprobs": 5}, "logprobs is not supported"),
    ],
)
def test_an_edit_is_judged_when_the_params_are_used(kwargs, word):
    """SamplingParams is mutable, as vLLM's (its examples edit them); `checked()`, the copy
    the engine runs with, judges the values as they are then, as the constructor does."""
    params = SamplingParams()
    for name, value in kwargs.items():
        setattr(params, name, value)
    with pytest.raises(ValueError, match=word):
        params.checked()


def test_checked_is_a_normalized_copy_of_the_edited_params():
    params = SamplingParams()
    params.temperature, params.stop, params.stop_token_ids = 0.5, "end", [3]
    copy = params.checked()
    assert copy is not params
    assert copy == SamplingParams(temperature=0.5, stop=("end",), stop_token_ids=(3,))
    params.max_new_tokens = 5  # the alias, set after construction, still sets max_tokens
    assert params.checked().max_tokens == 5
