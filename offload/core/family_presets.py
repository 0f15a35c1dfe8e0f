"""Presets of the Qwen3, Gemma 3, Phi-4 and Falcon families (merged into
`presets.PRESETS`): the sizes people run offloaded, in Hugging Face `config.json` form,
run with dummy weights. Gemma 3's are its language model's config (`gemma3_text`): the
multimodal checkpoints' `text_config`."""

from __future__ import annotations

from typing import Any


def _qwen3(hidden: int, layers: int, heads: int, inter: int) -> dict[str, Any]:
    return {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": inter,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }


def _gemma3(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, inter: int,
            query_scalar: int) -> dict[str, Any]:  # fmt: skip
    return {
        "model_type": "gemma3_text",
        "vocab_size": 262208,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": inter,
        "query_pre_attn_scalar": query_scalar,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "eos_token_id": [1, 106],
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": True,
    }


def _falcon(hidden: int, layers: int, heads: int, kv_heads: int | None) -> dict[str, Any]:
    """kv_heads None: Falcon-7B's multi-query layout; else the new decoder architecture."""
    return {
        "model_type": "falcon",
        "vocab_size": 65024,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_kv_heads": kv_heads or 1,
        "new_decoder_architecture": kv_heads is not None,
        "multi_query": True,
        "parallel_attn": True,
        "alibi": False,
        "bias": False,
        "layer_norm_epsilon": 1e-5,
        "max_position_embeddings": 2048,
        "bos_token_id": 11,
        "eos_token_id": 11,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }


FAMILY_PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-8b": _qwen3(4096, 36, 32, 12288),
    "qwen3-14b": _qwen3(5120, 40, 40, 17408),
    "qwen3-32b": _qwen3(5120, 64, 64, 25600),
    "gemma-3-12b": _gemma3(3840, 48, 16, 8, 256, 15360, 256),
    "gemma-3-27b": _gemma3(5376, 62, 32, 16, 128, 21504, 168),
    "phi-4": {
        "model_type": "phi3",
        "vocab_size": 100352,
        "hidden_size": 5120,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 10,
        "intermediate_size": 17920,
        "max_position_embeddings": 16384,
        "rms_norm_eps": 1e-5,
        "rope_theta": 250000.0,
        "bos_token_id": 100257,
        "eos_token_id": 100265,
        "pad_token_id": 100349,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    },
    "falcon-7b": _falcon(4544, 32, 71, None),
    "falcon-40b": _falcon(8192, 60, 128, 8),
    "falcon-180b": _falcon(14848, 80, 232, 8),
}

FAMILY_HUB_IDS: dict[str, str] = {
    "Qwen/Qwen3-8B": "qwen3-8b",
    "Qwen/Qwen3-14B": "qwen3-14b",
    "Qwen/Qwen3-32B": "qwen3-32b",
    "google/gemma-3-12b-it": "gemma-3-12b",
    "google/gemma-3-12b-pt": "gemma-3-12b",
    "google/gemma-3-27b-it": "gemma-3-27b",
    "google/gemma-3-27b-pt": "gemma-3-27b",
    "microsoft/phi-4": "phi-4",
    "tiiuae/falcon-7b": "falcon-7b",
    "tiiuae/falcon-7b-instruct": "falcon-7b",
    "tiiuae/falcon-40b": "falcon-40b",
    "tiiuae/falcon-40b-instruct": "falcon-40b",
    "tiiuae/falcon-180B": "falcon-180b",
}
