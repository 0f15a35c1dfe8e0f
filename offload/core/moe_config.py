"""Reading the `config.json` of the mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE,
GLM-4.5's `glm4_moe`) into `ModelConfig`'s expert fields (`config.ModelConfig.from_hf`
lays them over the Llama fields of the same config).

A layer's MLP is a router and experts (`models.moe`). A setting that changes the math
and is not supported is refused here, naming it.
"""

from __future__ import annotations

from typing import Any

from offload.core.errors import UserError

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe")

# `ModelConfig`'s expert fields at their defaults: left out of the fingerprint
# (`ModelConfig.fingerprint`), so a dense model's store keeps its name
MOE_DEFAULTS: dict[str, Any] = {
    "num_experts": 0,
    "experts_per_token": 0,
    "moe_intermediate_size": 0,
    "shared_expert_intermediate_size": 0,
    "shared_expert_gate": False,
    "router": "softmax",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "router_groups": 1,
    "router_topk_groups": 1,
    "dense_layers": (),
}


def moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """A mixture of experts' fields, over the Llama fields for its attention (Qwen's
    sliding window and bias keys, Qwen3-MoE's q/k norms, GLM-4.5's partial RoPE)."""
    model_type, layers = hf["model_type"], hf["num_hidden_layers"]
    rope = hf.get("rope_parameters") or {}
    out: dict[str, Any] = {
        "moe_intermediate_size": hf.get("moe_intermediate_size") or hf["intermediate_size"],
        "experts_per_token": hf["num_experts_per_tok"],
        # Mixtral always renormalizes; GLM-4.5's default is to, Qwen's not to
        "norm_topk_prob": model_type == "mixtral"
        or bool(hf.get("norm_topk_prob", model_type == "glm4_moe")),
        "sliding_window": hf.get("sliding_window") if model_type == "mixtral" else None,
    }
    if model_type.startswith("qwen") and hf.get("use_sliding_window", False):
        raise UserError(f"{model_type} with use_sliding_window=true is not supported")
    if model_type == "qwen3_moe" and hf.get("attention_bias", False):
        raise UserError("qwen3_moe with attention_bias=true is not supported")
    if model_type == "mixtral":
        out["num_experts"] = hf["num_local_experts"]
    elif model_type.startswith("qwen"):
        out["num_experts"] = hf.get("num_experts") or hf["num_local_experts"]
        step = hf.get("decoder_sparse_step", 1) or 1
        only = set(hf.get("mlp_only_layers") or ())
        out["dense_layers"] = tuple(i for i in range(layers) if i in only or (i + 1) % step)
        out["qkv_bias"] = bool(hf.get("qkv_bias", True)) if model_type == "qwen2_moe" else False
        out["qk_norm"] = model_type == "qwen3_moe"
        if model_type == "qwen2_moe":
            out["shared_expert_intermediate_size"] = hf.get("shared_expert_intermediate_size", 0)
            out["shared_expert_gate"] = True
    else:  # glm4_moe
        out["num_experts"] = hf.get("n_routed_experts") or hf["num_local_experts"]
        out["shared_expert_intermediate_size"] = out["moe_intermediate_size"] * hf.get(
            "n_shared_experts", 1
        )
        out["router"] = "sigmoid"
        out["routed_scaling_factor"] = float(hf.get("routed_scaling_factor", 1.0))
        out["router_groups"] = hf.get("n_group", 1)
        out["router_topk_groups"] = hf.get("topk_group", 1)
        out["dense_layers"] = tuple(range(min(layers, hf.get("first_k_dense_replace", 1))))
        out["qk_norm"] = bool(hf.get("use_qk_norm", False))
        out["rotary_fraction"] = float(
            hf.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 0.5
        )
    return out
