"""The built-in demo model (SmolLM2-135M-Instruct GGUF) against transformers' GGUF loader."""

from __future__ import annotations

import pytest
import torch

from offload.api.llm import LLM
from offload.core.sampling import SamplingParams
from offload.models.demo import demo_model_path

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 2 + 3?",
    "Write one sentence about the moon.",
]


@pytest.fixture(scope="module")
def ours():
    return LLM("demo", device="cpu", dtype="float32", batch_size=4)


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = demo_model_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    return tok, model


def test_france_gives_paris(ours):
    out = ours.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=24),
    )
    assert "Paris" in out[0].outputs[0].text, out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"


def test_greedy_equals_transformers_on_the_same_gguf(ours, reference):
    tok, model = reference
    params = SamplingParams(max_new_tokens=24)
    outs = ours.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)
    for question, out in zip(QUESTIONS, outs, strict=True):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt"
        )
        ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
        with torch.no_grad():
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False
            )
        ref_ids = gen[0, ids.shape[1] :].tolist()
        got = out.outputs[0]
        assert out.prompt_token_ids == ids[0].tolist()
        assert got.token_ids == ref_ids[: len(got.token_ids)], (
            f"{question!r}: ours {got.text!r} vs transformers {tok.decode(ref_ids)!r}"
        )
