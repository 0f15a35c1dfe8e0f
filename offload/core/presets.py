"""Bundled model presets: config facts only (no weights), in Hugging Face `config.json` form.

A preset runs with dummy weights, so a 176B model can be planned, profiled and
benchmarked without downloading it. Hub repo ids of these models map to their preset
when only the configuration is needed (or `--dummy` is given).
"""

from __future__ import annotations

from typing import Any

from offload.core import gpt_oss_config
from offload.core.family_presets import FAMILY_HUB_IDS, FAMILY_PRESETS
from offload.core.mla_presets import MLA_HUB_IDS, MLA_PRESETS

DEMO_NAME = "smollm2-135m-instruct"


def _opt(hidden: int, layers: int, heads: int) -> dict[str, Any]:
    return {
        "model_type": "opt",
        "vocab_size": 50272,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "ffn_dim": 4 * hidden,
        "max_position_embeddings": 2048,
        "do_layer_norm_before": True,
        "word_embed_proj_dim": hidden,
        "bos_token_id": 2,
        "eos_token_id": 2,
        "pad_token_id": 1,
        "torch_dtype": "float16",
        "tie_word_embeddings": True,
    }


def _llama(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    inter: int,
    vocab: int,
    ctx: int,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": inter,
        "max_position_embeddings": ctx,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        **extra,
    }


_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, dict[str, Any]] = {
    "bloom": {
        "model_type": "bloom",
        "vocab_size": 250880,
        "hidden_size": 14336,
        "n_layer": 70,
        "n_head": 112,
        "layer_norm_epsilon": 1e-5,
        "seq_length": 2048,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "torch_dtype": "bfloat16",
    },
    "opt-6.7b": _opt(4096, 32, 32),
    "opt-30b": _opt(7168, 48, 56),
    "opt-66b": _opt(9216, 64, 72),
    "opt-175b": _opt(12288, 96, 96),
    "llama-2-7b": _llama(4096, 32, 32, 32, 11008, 32000, 4096, torch_dtype="float16"),
    "llama-2-13b": _llama(5120, 40, 40, 40, 13824, 32000, 4096, torch_dtype="float16"),
    "llama-2-70b": _llama(8192, 80, 64, 8, 28672, 32000, 4096, torch_dtype="float16"),
    "llama-3.1-8b": _llama(
        4096,
        32,
        32,
        8,
        14336,
        128256,
        131072,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
    ),
    "llama-3.1-70b": _llama(
        8192,
        80,
        64,
        8,
        28672,
        128256,
        131072,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        bos_token_id=128000,
        eos_token_id=[128001, 128008, 128009],
    ),
    "mistral-7b": {
        **_llama(4096, 32, 32, 8, 14336, 32768, 32768, rope_theta=1000000.0),
        "model_type": "mistral",
        "sliding_window": None,
    },
    "qwen2-7b": {
        **_llama(
            3584,
            28,
            28,
            4,
            18944,
            152064,
            32768,
            rope_theta=1000000.0,
            bos_token_id=151643,
            eos_token_id=151643,
        ),
        "model_type": "qwen2",
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
    },
    DEMO_NAME: _llama(
        576,
        30,
        9,
        3,
        1536,
        49152,
        8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        eos_token_id=2,
        bos_token_id=1,
    ),
}

# Hub repo ids whose configuration equals a preset's.
HUB_IDS: dict[str, str] = {
    "bigscience/bloom": "bloom",
    "facebook/opt-6.7b": "opt-6.7b",
    "facebook/opt-30b": "opt-30b",
    "facebook/opt-66b": "opt-66b",
    "facebook/opt-175b": "opt-175b",
    "meta-llama/Llama-2-7b-hf": "llama-2-7b",
    "meta-llama/Llama-2-13b-hf": "llama-2-13b",
    "meta-llama/Llama-2-70b-hf": "llama-2-70b",
    "meta-llama/Llama-3.1-8B": "llama-3.1-8b",
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "meta-llama/Llama-3.1-70B": "llama-3.1-70b",
    "meta-llama/Llama-3.1-70B-Instruct": "llama-3.1-70b",
    "mistralai/Mistral-7B-v0.3": "mistral-7b",
    "mistralai/Mistral-7B-Instruct-v0.3": "mistral-7b",
    "Qwen/Qwen2-7B": "qwen2-7b",
    "Qwen/Qwen2-7B-Instruct": "qwen2-7b",
    "HuggingFaceTB/SmolLM2-135M-Instruct": DEMO_NAME,
}

PRESETS.update(FAMILY_PRESETS)
HUB_IDS.update(FAMILY_HUB_IDS)
PRESETS.update(gpt_oss_config.PRESETS)  # MXFP4 experts, as shipped
HUB_IDS.update(gpt_oss_config.HUB_IDS)


def _mixtral(hidden: int, layers: int, heads: int, inter: int, vocab: int, ctx: int):
    return {
        **_llama(hidden, layers, heads, 8, inter, vocab, ctx, rope_theta=1000000.0),
        "model_type": "mixtral",
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "sliding_window": None,
    }


def _qwen3_moe(hidden: int, layers: int, heads: int, inter: int, moe_inter: int):
    return {
        **_llama(hidden, layers, heads, 4, inter, 151936, 40960, rope_theta=1000000.0),
        "model_type": "qwen3_moe",
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": moe_inter,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    }


# mixtures of experts (`models.moe`): dummy weights route with a skew (`DummySource`)
PRESETS.update(
    {
        "mixtral-8x7b": _mixtral(4096, 32, 32, 14336, 32000, 32768),
        "mixtral-8x22b": _mixtral(6144, 56, 48, 16384, 32768, 65536),
        "qwen3-30b-a3b": _qwen3_moe(2048, 48, 32, 6144, 768),
        "qwen3-235b-a22b": _qwen3_moe(4096, 94, 64, 12288, 1536),
        "glm-4.5-air": {
            **_llama(4096, 46, 96, 8, 10944, 151552, 131072, rope_theta=1000000.0),
            "model_type": "glm4_moe",
            "head_dim": 128,
            "attention_bias": True,
            "partial_rotary_factor": 0.5,
            "n_routed_experts": 128,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 1408,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.0,
            "norm_topk_prob": True,
            "use_qk_norm": False,
            "bos_token_id": None,
            "eos_token_id": [151329, 151336, 151338],
            "pad_token_id": 151329,
        },
    }
)
HUB_IDS.update(
    {
        "mistralai/Mixtral-8x7B-v0.1": "mixtral-8x7b",
        "mistralai/Mixtral-8x7B-Instruct-v0.1": "mixtral-8x7b",
        "mistralai/Mixtral-8x22B-Instruct-v0.1": "mixtral-8x22b",
        "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b",
        "Qwen/Qwen3-235B-A22B": "qwen3-235b-a22b",
        "zai-org/GLM-4.5-Air": "glm-4.5-air",
    }
)


# the latent-attention mixtures of experts (`models.mla`): their published configs
PRESETS.update(MLA_PRESETS)
HUB_IDS.update(MLA_HUB_IDS)


def preset_for(name: str) -> str | None:
    """The preset a name or hub repo id stands for, or None. Case-insensitive."""
    lowered = name.lower()
    for key in PRESETS:
        if key == lowered:
            return key
    for repo, key in HUB_IDS.items():
        if repo.lower() == lowered:
            return key
    return None
