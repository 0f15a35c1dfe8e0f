"""Qwen3, Gemma, Phi-3 and Falcon (`tiny_models.FAMILY_CASES`) beyond the plain run that
`test_model_math` checks against transformers: the executor's weight split, KV in CPU
homes attended by the CPU (the C kernel, sliding windows in its bias) and by the
device, a compressed cache, LongRoPE's switch to its long factors, multimodal Gemma 3
checkpoints, and the settings refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from offload.api.llm import LLM
from offload.core.config import ModelConfig
from offload.core.errors import UserError
from offload.core.presets import PRESETS
from offload.core.sampling import SamplingParams
from offload.executor.runner import PlainRunner
from offload.kernels.formats import Compression
from offload.policies.policy import Placement, Policy
from tests import tiny_models
from tests.tiny_models import assert_prefill_logits_match

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34], [7, 8], [9] * 9]
PARAMS = SamplingParams(max_new_tokens=8)
W3 = Placement(0.3, 0.4, 0.3)
POLICIES = {
    "weights-3-ways": Policy(gpu_batch_size=2, num_gpu_batches=3, weights=W3),
    "kv-cpu-cpu-attention": Policy(
        gpu_batch_size=2, num_gpu_batches=3, kv_cache=Placement(0, 1, 0), attention_on_cpu=True
    ),
    "kv-cpu-device-attention": Policy(
        gpu_batch_size=2, num_gpu_batches=3, weights=W3, kv_cache=Placement(0, 1, 0)
    ),
}
KV4 = Compression(bits=4, group_size=16)
FAMILIES = list(tiny_models.FAMILY_CASES)


def _tokens(llm: LLM, prompts=PROMPTS, params=PARAMS) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def plain(tiny_checkpoints):
    """The plain run's tokens per case (transformers' own: `test_model_math`)."""
    out = {}
    for case in FAMILIES:
        directory, _ = tiny_checkpoints[case]
        out[case] = _tokens(LLM(str(directory), device="cpu", dtype="float32", batch_size=8))
    return out


@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("case", FAMILIES)
def test_policy_gives_the_plain_tokens(case, policy_name, tiny_checkpoints, plain, tmp_path):
    directory, _ = tiny_checkpoints[case]
    policy = POLICIES[policy_name]
    with LLM(str(directory), device="cpu", dtype="float32", policy=policy, nvme=tmp_path) as llm:
        assert _tokens(llm) == plain[case], f"{case} under {policy_name}"


@pytest.mark.parametrize("case", ["gemma3", "falcon-40b-like"])
def test_a_compressed_cache_attended_by_the_cpu_gives_the_plain_compressed_tokens(
    case, tiny_checkpoints, tmp_path
):
    """Gemma 3's local layers read a window of the compressed cache through their own
    bias in the CPU's kernel; the plain run with the same cache format agrees."""
    directory, _ = tiny_checkpoints[case]
    reference = LLM(str(directory), device="cpu", dtype="float32", batch_size=8)
    with reference.spec.open_weights() as source:
        reference.runner = PlainRunner(
            source, torch.float32, torch.device("cpu"), kv_compression=KV4
        )
    reference.loop.runner = reference.runner  # the decode loop holds the runner it was built with
    want = _tokens(reference)
    policy = Policy.from_dict(
        {**POLICIES["kv-cpu-cpu-attention"].to_dict(), "kv_compression": KV4.__dict__}
    )
    with LLM(str(directory), device="cpu", dtype="float32", policy=policy, nvme=tmp_path) as llm:
        assert _tokens(llm) == want


def test_longrope_takes_its_long_factors_past_the_original_length(tiny_checkpoints):
    """A step whose positions pass original_max_position_embeddings (32) takes the long
    factors, as transformers switches (per forward, on the largest position): 20 prompt
    tokens and 20 new ones cross it mid-generation."""
    directory, model = tiny_checkpoints["phi3-longrope"]
    prompt = list(range(40, 60))
    llm = LLM(str(directory), device="cpu", dtype="float32")
    ours = _tokens(llm, [prompt], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        ref = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False
        )[0, len(prompt) :].tolist()
    assert ours == ref[: len(ours)] and len(ours) == 20
    assert_prefill_logits_match(llm, model, [list(range(3, 40))], "past the original length")


def test_a_multimodal_gemma3_checkpoint_runs_its_language_model(tiny_checkpoints, tmp_path):
    """A `gemma3` config nests the text model's in `text_config`, and its checkpoint keeps
    the language model under model.language_model. (transformers 5) or
    language_model.model. (earlier): both read as the text model."""
    directory, model = tiny_checkpoints["gemma3"]
    text = json.loads((directory / "config.json").read_text())
    for prefix in ("model.language_model.", "language_model.model."):
        out = tmp_path / prefix.strip(".")
        out.mkdir()
        config = {"model_type": "gemma3", "text_config": text, "eos_token_id": [1, 106]}
        (out / "config.json").write_text(json.dumps(config))
        weights = {
            prefix + name.removeprefix("model."): t.contiguous()
            for name, t in model.state_dict().items()
            if name.startswith("model.")
        }
        save_file(weights, out / "model.safetensors")
        tiny_models.save_byte_tokenizer(out)
        llm = LLM(str(out), device="cpu", dtype="float32")
        assert llm.config.eos_token_ids == (1, 106)
        assert_prefill_logits_match(llm, model, PROMPTS, prefix)


@pytest.mark.parametrize(
    ("case", "change", "named"),
    [
        ("gemma2", {"attn_logit_softcapping": -1.0}, "soft-capping"),
        ("falcon-7b-like", {"alibi": True}, "ALiBi"),
        ("falcon-7b-like", {"activation": "relu"}, "activation"),
        ("gemma3", {"use_bidirectional_attention": True}, "bidirectional"),
    ],
)
def test_unsupported_settings_are_refused_by_name(case, change, named):
    _, config = tiny_models.CASES[case]
    hf = {**config.to_dict(), **change}
    with pytest.raises(UserError, match=named):
        ModelConfig.from_hf(hf)


# fingerprints of presets as the code before the variant fields named them
OLDER_FINGERPRINTS = {
    "llama-3.1-8b": "94487230b6316b8e",
    "bloom": "321bb9316dfb8836",
    "opt-30b": "46f08ddb7bc778a9",
    "qwen2-7b": "8934da5139eded7a",
    "mistral-7b": "4997a78e2c1d18ba",
}


@pytest.mark.parametrize("name", list(OLDER_FINGERPRINTS))
def test_new_fields_at_their_defaults_keep_older_fingerprints(name):
    """A weight store is named by its model's fingerprint: the variant fields at their
    defaults leave it as it was before they existed (no store is rebuilt)."""
    cfg = ModelConfig.from_hf(PRESETS[name], name)
    assert cfg.fingerprint() == OLDER_FINGERPRINTS[name]


@pytest.mark.gpu
@pytest.mark.parametrize("case", FAMILIES)
def test_cuda_fp32_logits_match_transformers(case, tiny_checkpoints):
    directory, model = tiny_checkpoints[case]
    llm = LLM(str(directory), device="cuda", dtype="float32")
    assert_prefill_logits_match(llm, model, PROMPTS, case)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["gemma3", "gemma2", "phi3-longrope", "falcon-7b-like"])
def test_cuda_graph_decode_gives_the_eager_tokens(case, tiny_checkpoints, tmp_path):
    """Decode replayed from CUDA graphs (Gemma 3's local layers with their own RoPE
    buffers) gives the eager steps' tokens, and those are the plain CPU run's; with the
    KV in CPU homes attended by the CPU too."""
    directory, _ = tiny_checkpoints[case]
    want = _tokens(LLM(str(directory), device="cpu", dtype="float32", batch_size=8))
    policies = {
        "all-on-gpu": Policy(gpu_batch_size=2, num_gpu_batches=3),
        "kv-cpu-cpu-attention": POLICIES["kv-cpu-cpu-attention"],
    }
    for name, policy in policies.items():
        for graphs in (True, False):
            with LLM(
                str(directory), device="cuda", dtype="float32", policy=policy, nvme=tmp_path
            ) as llm:
                if not graphs:
                    llm.runner.cuda_graphs = False
                    llm.runner._drop_graphs()
                assert _tokens(llm) == want, f"{case} under {name}, graphs {graphs}"
                assert bool(llm.runner._graphs) == graphs, name


def test_every_supported_model_type_is_priced_from_a_measured_figure():
    """Each supported model type has a family record (`core.family`) whose elementwise
    probe is one the profile measures (`executor.fixed_costs.ELEMENTWISE_CONFIGS`), and
    a profile without that figure prices it from the figures it has, never at zero."""
    from offload.core.config import SUPPORTED_MODEL_TYPES, family_name
    from offload.core.family import FAMILIES, PROBED
    from offload.executor.fixed_costs import ELEMENTWISE_CONFIGS
    from offload.policies.cost import _elementwise

    assert set(PROBED) == set(ELEMENTWISE_CONFIGS)
    for model_type in SUPPORTED_MODEL_TYPES:
        record = FAMILIES[family_name(model_type)]
        assert record.elementwise_probe in ELEMENTWISE_CONFIGS, model_type
    cfg = ModelConfig.from_hf(PRESETS["opt-6.7b"], "opt-6.7b")
    assert _elementwise({"opt": 2.0, "llama": 5.0}, cfg) == 2.0
    assert _elementwise({"llama": 5.0, "bloom": 3.0}, cfg) == 5.0  # an older profile
