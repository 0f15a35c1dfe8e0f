"""Our decoder stack against transformers' own model classes, family by family."""

from __future__ import annotations

import pytest
import torch

from offload.api.llm import LLM
from offload.core.sampling import SamplingParams
from tests import tiny_models
from tests.tiny_models import assert_prefill_logits_match

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    [20, 21, 22],
    [30, 31, 32, 33, 34, 35, 36],
    [300, 1, 2, 250],
]


@pytest.mark.parametrize("case", list(tiny_models.CASES))
def test_logits_match_transformers(case, tiny_checkpoints):
    directory, model = tiny_checkpoints[case]
    llm = LLM(str(directory), device="cpu", dtype="float32")
    assert_prefill_logits_match(llm, model, PROMPTS, case)


# prompts of one length: no padding
EQUAL = [[5, 6, 7, 8, 9, 10, 11], [30, 31, 32, 33, 34, 35, 36], [300, 1, 2, 250, 3, 4, 5]]


@pytest.mark.parametrize("case", list(tiny_models.CASES))
def test_unpadded_prefill_runs_causal_and_matches_transformers(case, tiny_checkpoints):
    """Without padding the prefill step is flagged causal (but for ALiBi, and a sliding
    window shorter than the prompts), and attention runs SDPA's causal kernel without
    the bias: the logits still match transformers'."""
    from offload.models.batch import PaddedBatch

    directory, model = tiny_checkpoints[case]
    llm = LLM(str(directory), device="cpu", dtype="float32")
    batch = PaddedBatch(llm.config, EQUAL, max_new_tokens=4, pad_id=0)
    expected = not case.startswith("bloom") and case != "mistral-window"  # window 6 < 7
    assert llm.runner.step_inputs(batch, 0, batch.prompt_len).causal == expected
    padded = PaddedBatch(llm.config, PROMPTS, max_new_tokens=4, pad_id=0)
    assert not llm.runner.step_inputs(padded, 0, padded.prompt_len).causal
    assert_prefill_logits_match(llm, model, EQUAL, case)


@pytest.mark.parametrize("case", ["llama-gqa", "bloom", "mistral-window", "opt"])
def test_a_decode_steps_bias_is_the_one_built_for_its_slot(case, tiny_checkpoints):
    """A decode step's bias is a prefix of the last slot's, built once for the block:
    at every slot of a padded batch (ALiBi's included) it is what `attention_bias`
    builds for that slot alone."""
    from offload.models import ops
    from offload.models.batch import PaddedBatch

    directory, _ = tiny_checkpoints[case]
    cfg = LLM(str(directory), device="cpu", dtype="float32").config
    batch = PaddedBatch(cfg, PROMPTS, max_new_tokens=6, pad_id=0)
    cpu = torch.device("cpu")
    for slot in range(batch.prompt_len, batch.max_slots):
        step = batch.step_inputs(slot, 1, torch.float32, cpu, None)
        valid, pos = batch.key_valid[:, : slot + 1], batch.key_pos[:, : slot + 1]
        fresh = ops.attention_bias(cfg, valid, pos, pos[:, slot:], slot, torch.float32)
        assert torch.equal(step.bias, fresh), f"{case}: slot {slot}"


@pytest.mark.parametrize("case", ["llama-gqa", "bloom", "opt-350m-like"])
def test_mlp_in_row_slices_matches_transformers(case, tiny_checkpoints, monkeypatch):
    """Prefill runs the MLP in slices of MLP_CHUNK_ROWS token rows; with slices of 5
    rows (uneven against 4 x 11 rows) the logits still match transformers'."""
    from offload.models import decoder

    monkeypatch.setattr(decoder, "MLP_CHUNK_ROWS", 5)
    directory, model = tiny_checkpoints[case]
    llm = LLM(str(directory), device="cpu", dtype="float32")
    assert_prefill_logits_match(llm, model, PROMPTS, case)


@pytest.mark.parametrize("case", list(tiny_models.CASES))
def test_greedy_tokens_match_transformers(case, tiny_checkpoints):
    directory, model = tiny_checkpoints[case]
    llm = LLM(str(directory), device="cpu", dtype="float32", batch_size=4)
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=16))  # one padded batch
    eos = model.generation_config.eos_token_id
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False
            )[0, len(prompt) :].tolist()
        if out.finish_reason == "length":
            assert out.completion_tokens == 16
        else:
            assert out.token_ids[-1] == eos
        assert out.token_ids == ref[: len(out.token_ids)], (
            f"{case}: prompt {prompt}: ours {out.token_ids} vs transformers {ref}"
        )


def test_batch_composition_does_not_change_greedy_output(tiny_checkpoints):
    directory, _ = tiny_checkpoints["llama-gqa"]
    llm = LLM(str(directory), device="cpu", dtype="float32", batch_size=4)
    together = [o.token_ids for o in llm.generate(PROMPTS)]
    alone = [llm.generate([p])[0].token_ids for p in PROMPTS]
    assert together == alone
