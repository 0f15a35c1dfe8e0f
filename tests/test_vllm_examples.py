"""vLLM's offline-inference examples (docs: basic generate, chat, sampling params), run
unchanged apart from the import and the model name, on the built-in demo model."""

from __future__ import annotations

import pytest
import torch

from offload import LLM, SamplingParams
from offload.core.errors import UserError


@pytest.fixture(scope="module")
def llm():
    return LLM(model="demo")


def test_basic_generate_example(llm):
    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    outputs = llm.generate(prompts, sampling_params)
    assert [output.prompt for output in outputs] == prompts
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
        assert isinstance(generated_text, str) and generated_text
        assert 1 <= len(output.outputs[0].token_ids) <= 16  # vLLM's default max_tokens
        assert output.outputs[0].finish_reason in ("stop", "length")
        # a raw prompt is never templated: its ids are the tokenizer's encoding of the text
        assert output.prompt_token_ids == llm.get_tokenizer().encode(prompt)


def test_one_string_is_one_prompt_and_token_prompts_match_text(llm):
    outputs = llm.generate("The capital of France is", SamplingParams(max_tokens=6))
    assert len(outputs) == 1 and len(outputs[0].outputs) == 1
    ids = outputs[0].prompt_token_ids
    again = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=6))
    assert again[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    assert again[0].prompt is None


def test_one_sampling_params_per_prompt(llm):
    prompts = ["The capital of France is", "The capital of Italy is"]
    params = [SamplingParams(max_tokens=2), SamplingParams(max_tokens=5, ignore_eos=True)]
    outputs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 5]
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(prompts, params[:1] * 3)


def test_chat_example(llm):
    sampling_params = SamplingParams(temperature=0.5, seed=0, max_tokens=24)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    outputs = llm.chat(conversation, sampling_params=sampling_params, use_tqdm=False)
    assert len(outputs) == 1
    assert "Paris" in outputs[0].outputs[0].text, outputs[0].outputs[0].text
    assert "<|im_start|>assistant" in outputs[0].prompt  # the model's own template
    conversations = [conversation for _ in range(3)]
    outputs = llm.chat(messages=conversations, sampling_params=sampling_params, use_tqdm=True)
    assert len(outputs) == 3
    # the same seed, the same conversation: the same sample
    assert len({o.outputs[0].text for o in outputs}) == 1


def test_chat_with_a_custom_template(llm):
    chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    outputs = llm.chat(
        [{"role": "user", "content": "Hi"}],
        SamplingParams(max_tokens=2),
        use_tqdm=False,
        chat_template=chat_template,
    )
    assert outputs[0].prompt == "user: Hi\nassistant:"


def test_sampling_params_fields(llm):
    prompt = "The capital of France is"
    base = llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))[0].outputs[0]
    # n samples, each with its own seeded generator
    samples = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8))
    assert [c.index for c in samples[0].outputs] == [0, 1, 2]
    # a stop string cuts the text before it and is named
    word = base.text.split()[0]
    cut = llm.generate(prompt, SamplingParams(max_tokens=8, stop=[word]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == word and word not in cut.text
    # a stop token id ends the sequence at that token
    token = base.token_ids[2]
    stopped = llm.generate(prompt, SamplingParams(max_tokens=8, stop_token_ids=[token]))[0]
    assert stopped.outputs[0].token_ids == base.token_ids[:3]
    assert stopped.outputs[0].stop_reason == token
    # min_tokens: no stop before it
    late = llm.generate(prompt, SamplingParams(max_tokens=8, min_tokens=5, stop_token_ids=[token]))
    assert len(late[0].outputs[0].token_ids) >= 5


def test_max_memory_that_cannot_take_effect_is_an_error():
    with pytest.raises(UserError, match="disk"):
        LLM("demo", max_memory={"cpu": "8GB", "disk": "100GB"})
    with pytest.raises(UserError, match="GPU budget"):
        LLM("demo", max_memory={"cpu": "8GB"}, profile=None, device="cpu")
    with pytest.raises(UserError, match="not a device"):
        LLM("demo", max_memory={"mps": "8GB"})


def test_vllm_constructor_arguments_map_or_are_refused_naming_the_fix():
    """A vLLM script's `LLM(...)` arguments: those with a meaning here are mapped, those at
    vLLM's defaults pass, the rest are refused before anything loads, each naming what to
    do instead (`docs/compat.md`); an argument neither knows is Python's TypeError."""
    from offload.api.args import from_vllm_arguments

    cpu = torch.device("cpu")
    mapped, gpu = from_vllm_arguments(
        {"max_num_seqs": 3, "quantization": "int4", "dtype": "float32",
         "tensor_parallel_size": 1, "trust_remote_code": False, "enforce_eager": False},
        cpu, None,
    )  # fmt: skip
    assert mapped == {"batch_size": 3, "compress": "int4", "dtype": "float32"} and gpu is None
    refused = {
        "quantization": ("awq", "quantization='int4'"),
        "gpu_memory_utilization": (0.9, "has none"),
        "cpu_offload_gb": (4, "max_memory"),
        "swap_space": (4, "max_memory"),
        "tensor_parallel_size": (2, "--tp N"),
        "trust_remote_code": (True, "no remote code"),
        "enforce_eager": (True, "CUDA graphs"),
        "max_model_len": (2048, "longest prompt"),
        "tokenizer": ("other", "own tokenizer"),
    }
    for name, (value, fix) in refused.items():
        with pytest.raises(UserError, match=fix):
            LLM("demo", device="cpu", **{name: value})
    with pytest.raises(UserError, match="not a share"):
        from_vllm_arguments({"gpu_memory_utilization": 1.5}, cpu, None)
    with pytest.raises(UserError, match="give one"):
        from_vllm_arguments({"gpu_memory_utilization": 0.5}, cpu, "24GB")
    with pytest.raises(UserError, match="not both"):
        LLM("demo", max_num_seqs=4, batch_size=4)
    with pytest.raises(TypeError, match="download_dir"):
        LLM("demo", download_dir="/tmp")


def test_an_llms_seed_makes_its_sampled_requests_repeat(tmp_path):
    """vLLM's `LLM(seed=...)`: sampled requests without a seed of their own draw one from
    it in order, so the same calls sample the same text again; another seed samples other
    text; a request's own seed and greedy requests are left as they are."""
    from tests import tiny_models

    directory, _ = tiny_models.save("llama-gqa", tmp_path / "m")
    prompts = [[5, 6, 7, 8], [20, 21, 22], [300, 1, 2]]
    hot = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    def sampled(seed, params=hot):
        with LLM(str(directory), device="cpu", dtype="float32", seed=seed) as llm:
            first = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            second = llm.generate([{"prompt_token_ids": prompts[0]}], params)
        return [o.outputs[0].token_ids for o in (*first, *second)]

    seven = sampled(7)
    assert sampled(7) == seven
    assert sampled(8) != seven
    assert seven[0] != seven[3], "a later call draws new seeds"
    own = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3)
    assert sampled(7, own) == sampled(None, own)
    with pytest.raises(UserError, match="not an integer"):
        LLM("demo", seed="7")
