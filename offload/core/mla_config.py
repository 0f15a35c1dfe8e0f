"""Reading the `config.json` of the latent-attention families (DeepSeek-V2 `deepseek_v2`;
DeepSeek-V3 `deepseek_v3`, which Moonlight uses, and Kimi-K2 `kimi_k2`, read as
DeepSeek-V3) into `ModelConfig`'s fields (`config.ModelConfig.from_hf`).

Latent attention (`models.mla`) caches one compressed latent a token and layer, so the
config maps onto the decoder's fields as one KV head (`num_kv_heads` 1) whose width
(`head_dim`) is the latent's `kv_lora_rank`: the width every query head attends over
in the absorbed form, and the width of its context before the value projection. The
query's no-RoPE and RoPE parts, the value width and the low ranks are fields of their
own. A setting that changes the math and is not supported is refused here, naming it.
"""

from __future__ import annotations

import math
from typing import Any

from offload.core import families
from offload.core.errors import UserError

# "kimi_k2" is Kimi-K2's own model type for DeepSeek-V3's architecture
MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")

# `ModelConfig`'s latent-attention fields at their defaults: left out of the fingerprint
MLA_DEFAULTS: dict[str, Any] = {
    "q_lora_rank": 0,
    "kv_lora_rank": 0,
    "qk_nope_head_dim": 0,
    "qk_rope_head_dim": 0,
    "v_head_dim": 0,
}


def mla_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Every field but the common ones (`ModelConfig.from_hf`) of a DeepSeek-V2/V3 config."""
    model_type = hf["model_type"]
    if hf.get("attention_bias", False):
        raise UserError(f"{model_type} with attention_bias=true is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(
            f"{model_type}'s hidden_act {hf['hidden_act']!r} is not supported (silu is)"
        )
    if hf.get("mlp_bias", False):
        raise UserError(f"{model_type} with mlp_bias=true is not supported")
    if model_type != "deepseek_v2" and hf.get("rope_interleave", True) is False:
        raise UserError(f"{model_type} with rope_interleave=false is not supported")
    layers, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    kv_rank = hf["kv_lora_rank"]
    return {
        "hidden_size": hf["hidden_size"],
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": 1,
        "head_dim": kv_rank,
        "intermediate_size": hf["intermediate_size"],
        "max_position_embeddings": hf.get("max_position_embeddings", 4096),
        "norm_eps": hf.get("rms_norm_eps", 1e-6),
        **_rope(hf),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "q_lora_rank": hf.get("q_lora_rank") or 0,
        "kv_lora_rank": kv_rank,
        "qk_nope_head_dim": hf["qk_nope_head_dim"],
        "qk_rope_head_dim": hf["qk_rope_head_dim"],
        "v_head_dim": hf["v_head_dim"],
        **_router(hf, layers),
    }


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and rope_scaling (`RopeScaling`'s kwargs, YaRN's included)."""
    fields = families.rope_fields(hf, hf.get("rope_parameters") or hf.get("rope_scaling"))
    kind = fields["rope_scaling"]["rope_type"]
    if kind not in ("default", "yarn"):
        raise UserError(f"{hf['model_type']} with rope type {kind!r} is not supported")
    return {"rope_theta": fields["rope_theta"], "rope_scaling": fields["rope_scaling"]}


def _router(hf: dict[str, Any], layers: int) -> dict[str, Any]:
    """The experts' fields: DeepSeek-V2's softmax router (greedy or group-limited) or
    V3's sigmoid router with its correction bias (noaux_tc), shared experts, and the
    dense layers (the first `first_k_dense_replace`, and those off `moe_layer_freq`)."""
    model_type = hf["model_type"]
    v2 = model_type == "deepseek_v2"
    method = hf.get("topk_method") or ("greedy" if v2 else "noaux_tc")
    allowed = ("greedy", "group_limited_greedy") if v2 else ("noaux_tc",)
    if method not in allowed:
        raise UserError(f"{model_type} with topk_method {method!r} is not supported")
    scoring = hf.get("scoring_func") or ("softmax" if v2 else "sigmoid")
    if scoring != ("softmax" if v2 else "sigmoid"):
        raise UserError(f"{model_type} with scoring_func {scoring!r} is not supported")
    experts = hf.get("n_routed_experts") or 0
    if not experts:
        raise UserError(f"{model_type} without routed experts (n_routed_experts) is not supported")
    groups = hf.get("n_group") or 1
    if method == "greedy":
        groups = 1
    first, freq = hf.get("first_k_dense_replace") or 0, hf.get("moe_layer_freq") or 1
    moe_inter = hf["moe_intermediate_size"]
    return {
        "num_experts": experts,
        "experts_per_token": hf["num_experts_per_tok"],
        "moe_intermediate_size": moe_inter,
        "shared_expert_intermediate_size": moe_inter * (hf.get("n_shared_experts") or 0),
        # transformers' DeepSeek-V2 router never renormalizes (its norm_topk_prob unread)
        "router": "softmax_groups" if v2 else "sigmoid",
        "norm_topk_prob": False if v2 else bool(hf.get("norm_topk_prob", True)),
        "routed_scaling_factor": float(hf.get("routed_scaling_factor") or 1.0),
        "router_groups": groups,
        "router_topk_groups": (hf.get("topk_group") or 1) if groups > 1 else 1,
        "dense_layers": tuple(i for i in range(layers) if i < first or i % freq),
    }


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude scale, 0.1 mscale ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_param_count(cfg) -> int:
    """A latent-attention layer's attention parameters (projections and their norms)."""
    h, heads = cfg.hidden_size, cfg.num_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    if cfg.q_lora_rank:
        q = h * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * heads * qk
    else:
        q = h * heads * qk
    kv = h * latent + cfg.kv_lora_rank
    kv += cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return q + kv + heads * cfg.v_head_dim * h
