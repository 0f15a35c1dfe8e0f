"""Presets of the latent-attention mixtures of experts (`models.mla`, `models.moe`),
config facts only, in `config.json` form: each preset's values are the published
config.json's of the hub repository beside it in `MLA_HUB_IDS` (the keys that change
the math; none of the training-only ones), run with dummy weights (`--dummy`)."""

from __future__ import annotations

from typing import Any


def _deepseek(model_type: str, **facts: Any) -> dict[str, Any]:
    """The keys every DeepSeek-V2/V3 config shares at these models' values."""
    return {
        "model_type": model_type,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "moe_layer_freq": 1,
        **facts,
    }


# DeepSeek-V3 (and R1, the same architecture): 671B, 37B active
_DEEPSEEK_V3 = _deepseek(
    "deepseek_v3",
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
    n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, routed_scaling_factor=2.5,
    q_lora_rank=1536, topk_method="noaux_tc", scoring_func="sigmoid", n_group=8, topk_group=4,
    norm_topk_prob=True, first_k_dense_replace=3, max_position_embeddings=163840,
    rope_theta=10000,
    rope_scaling={
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
    },
    bos_token_id=0, eos_token_id=1,
)  # fmt: skip

# Kimi-K2-Instruct: 1T, 32B active; DeepSeek-V3's architecture with 384 experts in one
# group, 64 heads and one dense layer
_KIMI_K2 = _deepseek(
    "kimi_k2",
    vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64,
    n_shared_experts=1, n_routed_experts=384, num_experts_per_tok=8,
    routed_scaling_factor=2.827, q_lora_rank=1536, topk_method="noaux_tc",
    scoring_func="sigmoid", n_group=1, topk_group=1, norm_topk_prob=True,
    first_k_dense_replace=1, max_position_embeddings=131072, rope_theta=50000.0,
    rope_scaling={
        "type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
        "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
    },
    bos_token_id=163584, eos_token_id=163586,
)  # fmt: skip

# DeepSeek-V2-Lite: 15.7B, 2.4B active; no query low rank, softmax greedy routing
_DEEPSEEK_V2_LITE = _deepseek(
    "deepseek_v2",
    vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
    n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6, routed_scaling_factor=1.0,
    q_lora_rank=None, topk_method="greedy", scoring_func="softmax", n_group=1, topk_group=1,
    norm_topk_prob=False, first_k_dense_replace=1, max_position_embeddings=163840,
    rope_theta=10000,
    rope_scaling={
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
    },
    bos_token_id=100000, eos_token_id=100001,
)  # fmt: skip

# Moonlight-16B-A3B: DeepSeek-V3's classes at DeepSeek-V2-Lite's size, no RoPE scaling
_MOONLIGHT = _deepseek(
    "deepseek_v3",
    vocab_size=163840, hidden_size=2048, intermediate_size=11264, moe_intermediate_size=1408,
    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
    n_shared_experts=2, n_routed_experts=64, num_experts_per_tok=6,
    routed_scaling_factor=2.446, q_lora_rank=None, topk_method="noaux_tc",
    scoring_func="sigmoid", n_group=1, topk_group=1, norm_topk_prob=True,
    first_k_dense_replace=1, max_position_embeddings=8192, rope_theta=50000.0,
    rope_scaling=None, bos_token_id=163584, eos_token_id=163585,
)  # fmt: skip

MLA_PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v3": _DEEPSEEK_V3,
    "kimi-k2": _KIMI_K2,
    "deepseek-v2-lite": _DEEPSEEK_V2_LITE,
    "moonlight-16b-a3b": _MOONLIGHT,
}

MLA_HUB_IDS: dict[str, str] = {
    "deepseek-ai/DeepSeek-V3": "deepseek-v3",
    "deepseek-ai/DeepSeek-V3-0324": "deepseek-v3",
    "deepseek-ai/DeepSeek-R1": "deepseek-v3",
    "moonshotai/Kimi-K2-Instruct": "kimi-k2",
    "deepseek-ai/DeepSeek-V2-Lite": "deepseek-v2-lite",
    "deepseek-ai/DeepSeek-V2-Lite-Chat": "deepseek-v2-lite",
    "moonshotai/Moonlight-16B-A3B": "moonlight-16b-a3b",
    "moonshotai/Moonlight-16B-A3B-Instruct": "moonlight-16b-a3b",
}
