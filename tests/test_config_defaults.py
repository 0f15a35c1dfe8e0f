"""A config.json is read with the defaults its transformers config class fills
(`core.hf_config`): a Gemma 2 config without its soft-capping keys gets 50.0 and 30.0
and matches transformers reading the same directory; sizes are never defaulted, and a
model type we do not run gets our one-line refusal. Soft-capped attention on every
path (`models.attention.softcap_attend`), and the compressed cache it rules out."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import Gemma2ForCausalLM

from offload.api.llm import LLM
from offload.core.config import ModelConfig
from offload.core.errors import UserError
from offload.core.presets import PRESETS
from offload.core.sampling import SamplingParams
from offload.kernels.formats import Compression
from offload.kernels.kv_cache import QuantKV
from offload.models import attention
from offload.policies.policy import Policy
from offload.policies.search import kv_formats
from tests import tiny_models
from tests.tiny_models import assert_prefill_logits_match

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21, 22], [300, 1, 2, 250, 7]]
KV4 = Compression(bits=4, group_size=16)
_SIZES = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}


@pytest.fixture(scope="module")
def default_caps(tmp_path_factory):
    """The tiny Gemma 2 checkpoint with both soft-capping keys removed from config.json,
    and transformers' model read from that directory (its class's defaults)."""
    root = tmp_path_factory.mktemp("gemma2")
    source, _ = tiny_models.save("gemma2", root / "explicit")
    directory = shutil.copytree(source, root / "defaults")
    config = json.loads((directory / "config.json").read_text())
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        config.pop(key)
    (directory / "config.json").write_text(json.dumps(config))
    model = Gemma2ForCausalLM.from_pretrained(directory).eval()
    return directory, model


def test_a_gemma2_config_without_its_caps_matches_transformers_defaults(default_caps):
    directory, model = default_caps
    assert (model.config.attn_logit_softcapping, model.config.final_logit_softcapping) == (
        50.0,
        30.0,
    )
    llm = LLM(str(directory), device="cpu", dtype="float32", batch_size=4)
    assert (llm.config.attn_softcap, llm.config.final_softcap) == (50.0, 30.0)
    assert_prefill_logits_match(llm, model, PROMPTS, "gemma2 without its caps")
    outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=12, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
            )[0, len(prompt) :].tolist()
        assert out.token_ids == ref[: len(out.token_ids)], f"{prompt}: {out.token_ids} vs {ref}"


def test_the_default_caps_change_the_logits(default_caps):
    """The check above can fail: without the defaults the logits are off by more than
    its tolerance (1e-4) many times over."""
    _, model = default_caps
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        capped = model(input_ids=ids).logits
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = model(input_ids=ids).logits
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = 50.0
    assert (capped - uncapped).norm() / capped.norm() > 1e-3


@pytest.mark.parametrize(
    ("model_type", "key", "value", "field", "want"),
    [
        ("llama", "rms_norm_eps", None, "norm_eps", 1e-6),
        ("llama", "eos_token_id", None, "eos_token_ids", (2,)),
        ("gemma2", "head_dim", None, "head_dim", 256),  # not hidden / heads
        ("gemma2", "attn_logit_softcapping", None, "attn_softcap", 50.0),
        ("gemma2", "attn_logit_softcapping", 20.0, "attn_softcap", 20.0),
        ("gemma2", "attn_logit_softcapping", "null", "attn_softcap", None),  # off
        ("gemma3_text", "attn_logit_softcapping", None, "attn_softcap", None),
        ("qwen2", "max_position_embeddings", None, "max_position_embeddings", 32768),
    ],
)
def test_a_key_left_out_gets_the_class_default(model_type, key, value, field, want):
    """value None: the key is left out; "null": set to null."""
    hf = {"model_type": model_type, **_SIZES, "intermediate_size": 64, "num_key_value_heads": 2}
    if value is not None:
        hf[key] = None if value == "null" else value
    assert getattr(ModelConfig.from_hf(hf), field) == want


def test_presets_take_the_same_path():
    """A preset is a config.json's dict: it gets the class's defaults too."""
    preset = dict(PRESETS["gemma-3-12b"])
    preset.pop("rms_norm_eps")
    assert ModelConfig.from_hf(preset).norm_eps == 1e-6
    assert ModelConfig.from_hf(PRESETS["gemma-3-12b"]).attn_softcap is None


@pytest.mark.parametrize("size", list(_SIZES))
def test_a_size_left_out_is_refused_by_name(size):
    """The class's default size is another model's (Llama-7B's 4096): never taken."""
    hf = {"model_type": "llama", **_SIZES, "intermediate_size": 64}
    del hf[size]
    with pytest.raises(UserError, match=f"config.json has no {size}"):
        ModelConfig.from_hf(hf)


@pytest.mark.parametrize("model_type", ["no_such_model", "gpt2", None])
def test_a_model_type_we_do_not_run_gets_the_one_line_refusal(model_type):
    """gpt2: transformers knows it, we do not run it; no transformers traceback."""
    with pytest.raises(UserError, match=f"model type {model_type!r} in config.json is not"):
        ModelConfig.from_hf({"model_type": model_type, **_SIZES})


@pytest.mark.parametrize(
    ("model_type", "change", "named"),
    [
        ("gemma2", {"layer_types": ["bogus", "full_attention"]}, "layer_types"),
        ("llama", {"num_key_value_heads": "two"}, "num_key_value_heads"),
    ],
)
def test_a_value_the_class_refuses_is_a_one_line_user_error(model_type, change, named):
    with pytest.raises(UserError, match=f"transformers' .*Config: .*{named}") as caught:
        ModelConfig.from_hf({"model_type": model_type, **_SIZES, **change})
    assert "\n" not in str(caught.value)


def _qkv(batch: int, heads: int, kv_heads: int, new: int, slots: int, dim: int = 16):
    q = torch.randn(batch, heads, new, dim) * 6
    keys, values = torch.randn(2, batch, kv_heads, slots, dim).unbind(0)
    bias = torch.zeros(batch, 1, new, slots)
    bias[0, ..., :2] = torch.finfo(torch.float32).min  # a padded row
    return q, keys * 6, values, bias


def _eager(q, keys, values, bias, cap):
    """transformers' eager attention with soft-capping, K/V repeated per query head."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = q @ keys.transpose(-1, -2) * q.shape[-1] ** -0.5
    scores = torch.tanh(scores / cap) * cap + bias
    out = torch.softmax(scores, dim=-1) @ values
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


@pytest.mark.parametrize("chunk", [1 << 22, 40, 7])
@pytest.mark.parametrize("shape", [(3, 4, 2, 5, 9), (2, 4, 4, 1, 11), (2, 6, 2, 1, 3)])
def test_softcapped_attention_in_any_chunks_is_transformers_eager(chunk, shape, monkeypatch):
    """Whole, by rows, and by tokens of a row (chunks smaller than a row's scores)."""
    monkeypatch.setattr(attention, "SOFTCAP_CHUNK_SCORES", chunk)
    q, keys, values, bias = _qkv(*shape)
    want = _eager(q, keys, values, bias, 2.0)
    for causal in (False, True):  # the cap takes the bias path even where causal
        got = attention.attend(q, keys, values, bias, causal, softcap=2.0)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(attention.attend(q, keys, values, bias), want, atol=1e-3)


def test_a_compressed_cache_with_soft_capping_attends_its_dequantized_entries():
    """The decode kernels cannot cap the scores: a soft-capped decode step over a
    compressed cache attends the dequantized entries instead, capped."""
    q, keys, values, bias = _qkv(2, 4, 2, 1, 20)
    cache = QuantKV(2, 2, 16, 20, KV4, torch.float32, torch.device("cpu"))
    cache.write(keys[:, :, :19], values[:, :, :19], 0)
    got = attention.quant_attention(
        cache, q, keys[:, :, 19:], values[:, :, 19:], bias, 19, softcap=2.0
    )
    want = _eager(q, *cache.dequantized(20), bias, 2.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_compressed_kv_cache_is_refused_for_a_soft_capped_model(default_caps, tmp_path):
    directory, _ = default_caps
    cfg = LLM(str(directory), device="cpu", dtype="float32").config
    assert kv_formats(cfg, (None, KV4)) == (None,)  # --kv-compress auto: full precision
    with pytest.raises(UserError, match="attention soft-capping"):
        kv_formats(cfg, (KV4,))
    policy = Policy(gpu_batch_size=2, num_gpu_batches=1, kv_compression=KV4)
    with pytest.raises(UserError, match="attention soft-capping"):  # before the load
        LLM(str(directory), device="cpu", dtype="float32", policy=policy, nvme=tmp_path)
