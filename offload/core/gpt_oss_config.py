"""Reading gpt-oss's `config.json` (`gpt_oss`) into `ModelConfig`'s fields, over the
Llama fields of the same config (`config.ModelConfig.from_hf`).

gpt-oss is a Llama-like layer stack (RMSNorm, GQA, RoPE) with, per transformers'
`GptOssForCausalLM`:
- attention: q/k/v and o biases, a learned sink logit per head that joins each
  softmax's denominator (`attention_sinks`), sliding-window and full layers alternating
  (`layer_types`), YaRN RoPE;
- every layer's MLP a mixture of experts: a router with a bias whose top k logits are
  softmaxed (`router` "topk_softmax"), experts with biases and the clamped SwiGLU
  (`swiglu_limit`, `swiglu_alpha`: gate clamped above at the limit, up to +-limit,
  (up + 1) x gate x sigmoid(alpha x gate));
- experts shipped in MXFP4 (`quantization_config.quant_method` "mxfp4": `mxfp4_experts`,
  read and computed by `models.mxfp4`).
"""

from __future__ import annotations

from typing import Any

from offload.core.errors import UserError

MODEL_TYPE = "gpt_oss"

# `ModelConfig`'s gpt-oss fields at their defaults: left out of the fingerprint
GPT_OSS_DEFAULTS: dict[str, Any] = {
    "attention_sinks": False,
    "o_bias": False,
    "expert_bias": False,
    "swiglu_limit": None,
    "swiglu_alpha": 1.702,
    "mxfp4_experts": False,
}


def expert_format(hf: dict[str, Any]) -> bool:
    """Whether the checkpoint ships its experts in MXFP4; another quantization of a
    gpt-oss checkpoint is refused by name."""
    qc = hf.get("quantization_config") or {}
    method = qc.get("quant_method")
    if method is None:
        return False
    if method != "mxfp4":
        raise UserError(
            f"a gpt_oss checkpoint quantized with {method!r} is not read; offload reads "
            "gpt-oss as shipped (MXFP4 experts) or unquantized (bf16)"
        )
    return True


def gpt_oss_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's fields over the Llama ones (the module doc)."""
    layers = hf["num_hidden_layers"]
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"gpt_oss hidden_act {hf['hidden_act']!r} is not supported (silu is)")
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)
    ]
    local = tuple(t == "sliding_attention" for t in types)
    window = hf.get("sliding_window") if any(local) else None
    window_layers = () if window is None or all(local) else local
    bias = bool(hf.get("attention_bias", True))
    return {
        "num_experts": hf["num_local_experts"],
        "experts_per_token": hf["num_experts_per_tok"],
        "moe_intermediate_size": hf["intermediate_size"],
        "router": "topk_softmax",
        "norm_topk_prob": True,
        "sliding_window": window,
        "window_layers": window_layers,
        "qkv_bias": bias,
        "o_bias": bias,
        "attention_sinks": True,
        "expert_bias": True,
        "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
        "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
        "mxfp4_experts": expert_format(hf),
        "max_position_embeddings": hf.get("max_position_embeddings", 131072),
        "norm_eps": hf.get("rms_norm_eps", 1e-5),
    }


# transformers' default rope of a gpt_oss config without one (GptOssConfig)
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _preset(layers: int, experts: int) -> dict[str, Any]:
    """openai/gpt-oss-120b's and -20b's published config.json (their values; the two
    differ in layers and experts only): experts in MXFP4, as shipped."""
    return {
        "model_type": MODEL_TYPE,
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": layers,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": experts,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "attention_bias": True,
        "hidden_act": "silu",
        "swiglu_limit": 7.0,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        },
        "eos_token_id": 200002,
        "pad_token_id": 199999,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }


PRESETS = {"gpt-oss-120b": _preset(36, 128), "gpt-oss-20b": _preset(24, 32)}
HUB_IDS = {"openai/gpt-oss-120b": "gpt-oss-120b", "openai/gpt-oss-20b": "gpt-oss-20b"}
