"""Sampler: filters, seeds, validation."""

from __future__ import annotations

import pytest
import torch

from offload.sampling import SamplingParams, filter_logits, make_generators, sample


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    kept = filter_logits(logits, SamplingParams(temperature=1.0, top_k=2)).isfinite()
    assert kept.tolist() == [[False, True, False, True, False]]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = filter_logits(probs.log(), SamplingParams(temperature=1.0, top_p=0.8)).isfinite()
    assert kept.tolist() == [[True, True, False, False]]
    kept = filter_logits(probs.log(), SamplingParams(temperature=1.0, top_p=0.81)).isfinite()
    assert kept.tolist() == [[True, True, True, False]]


def test_seeded_sampling_is_reproducible_and_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(4000, 1)
    params = SamplingParams(temperature=1.0, seed=7)
    first = sample(logits, params, make_generators(params, 4000))
    second = sample(logits, params, make_generators(params, 4000))
    assert torch.equal(first, second)
    # same seed per sequence: every row draws the same first token
    assert first.unique().numel() == 1
    unseeded = SamplingParams(temperature=1.0)
    draws = sample(logits, unseeded, make_generators(unseeded, 4000))
    freq = torch.bincount(draws, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03), freq


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]])
    assert sample(logits, SamplingParams(), None).tolist() == [1, 0]


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_invalid_values_name_the_field(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)
