"""Reading the `config.json` of Llama and the Llama-like families, BLOOM, OPT, Gemma 2
and 3 and Falcon, and the RoPE settings every rotary family shares, into
`ModelConfig`'s fields (`config.ModelConfig.from_hf`).

Each reader returns the fields as a dict, "rope_scaling" as `RopeScaling`'s keyword
arguments (config.py builds it; this module imports nothing of it). A setting that
changes the math and is not supported is refused here, naming it.
"""

from __future__ import annotations

from typing import Any

from offload.core.errors import UserError

# model types that map onto a family of another name
FAMILY_OF = {"gemma2": "gemma", "gemma3_text": "gemma", "gemma3": "gemma"}

# `ModelConfig`'s variant fields and `RopeScaling`'s LongRoPE fields at their defaults:
# left out of the fingerprint (`ModelConfig.fingerprint`), so a store of a model that
# has none of them keeps its name
VARIANT_DEFAULTS: dict[str, Any] = {
    "qk_norm": False,
    "rotary_fraction": 1.0,
    "window_layers": (),
    "local_rope_theta": None,
    "query_scale": None,
    "embed_scale": None,
    "sandwich_norms": False,
    "final_softcap": None,
    "attn_softcap": None,
    "parallel_attn": False,
    "parallel_mlp_norm": False,
    "linear_bias": False,
}
ROPE_DEFAULTS: dict[str, Any] = {
    "short_factor": (),
    "long_factor": (),
    "attention_factor": None,
    # YaRN's
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.0,
    "mscale_all_dim": 0.0,
    "truncate": True,
}
# YaRN's fields of `RopeScaling` beside the ones every rope type reads
_YARN_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")

_SCALING_KEYS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
    "attention_factor",
    # YaRN
    "beta_fast",
    "beta_slow",
    "truncate",
    "mscale",
    "mscale_all_dim",
)


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal Gemma 3 config (`gemma3`) as its language model's: `text_config`'s
    keys over the outer ones, but for the outer token ids (the ones generation uses)."""
    if hf.get("model_type") == "gemma3" and isinstance(hf.get("text_config"), dict):
        ids = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf}
        return {**hf, **hf["text_config"], **ids, "model_type": "gemma3"}
    return hf


def rope_fields(hf: dict[str, Any], rope: dict[str, Any] | None) -> dict[str, Any]:
    """rope_theta, rope_scaling (`RopeScaling`'s kwargs) and rotary_fraction from one
    rope dict: transformers 5's `rope_parameters` or an older `rope_scaling`, the base
    and Phi-3's original_max_position_embeddings and partial_rotary_factor beside it."""
    rope = dict(rope or {})
    theta = rope.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    if rope_type in ("su", "yarn") and "long_factor" in rope:  # Phi-3's older names
        rope_type = "longrope"
    scaling = {k: rope[k] for k in _SCALING_KEYS if rope.get(k) is not None}
    if rope_type == "longrope":
        original = rope.get("original_max_position_embeddings") or hf.get(
            "original_max_position_embeddings"
        )
        if not original:
            raise UserError("a longrope config needs original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = original
        if rope.get("factor") is None:  # transformers: the ratio of the two lengths
            scaling["factor"] = hf.get("max_position_embeddings", original) / original
        scaling["short_factor"] = tuple(float(f) for f in rope["short_factor"])
        scaling["long_factor"] = tuple(float(f) for f in rope["long_factor"])
    if rope_type == "yarn":
        scaling.update(_yarn_fields(hf, rope))
    fraction = rope.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0
    return {
        "rope_theta": float(theta),
        "rope_scaling": {"rope_type": rope_type, **scaling},
        "rotary_fraction": float(fraction),
    }


def _yarn_fields(hf: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """YaRN's settings as transformers reads them (`_compute_yarn_parameters`): the
    factor, else the ratio of the context to the original one; the ramp's rotations,
    mscale and mscale_all_dim where given; truncate."""
    original = rope.get("original_max_position_embeddings") or hf.get(
        "original_max_position_embeddings"
    )
    if not original:
        raise UserError("a yarn rope config needs original_max_position_embeddings")
    factor = rope.get("factor")
    if factor is None:
        factor = hf.get("max_position_embeddings", original) / original
    out = {"original_max_position_embeddings": original, "factor": float(factor)}
    out.update({k: float(rope[k]) for k in _YARN_KEYS if rope.get(k)})
    return {**out, "truncate": bool(rope.get("truncate", True))}


def _windows(text: dict[str, Any], pattern_default: int) -> tuple[int | None, tuple[bool, ...]]:
    """(sliding window, window_layers): which layers are local (sliding_attention)."""
    layers, window = text["num_hidden_layers"], text.get("sliding_window")
    types = text.get("layer_types")
    if types is None:
        pattern = (
            text.get("sliding_window_pattern")
            or text.get("_sliding_window_pattern")
            or pattern_default
        )
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
    local = tuple(t == "sliding_attention" for t in types)
    if window is None or not any(local):
        return None, ()
    return window, () if all(local) else local


def _gemma_rope(text: dict[str, Any]) -> tuple[dict[str, Any], float | None]:
    """The global layers' rope fields and the local layers' base where it differs."""
    params = text.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one rope dict per layer type
        rope = rope_fields(text, params["full_attention"])
        local = params.get("sliding_attention") or {}
        local_type = local.get("rope_type", "default")
        local_theta = local.get("rope_theta")
    else:
        rope = rope_fields(text, params or text.get("rope_scaling"))
        local_type, local_theta = "default", text.get("rope_local_base_freq")
    if local_type != "default":
        raise UserError(f"Gemma's local layers' rope type {local_type!r} is not supported")
    same = local_theta is not None and float(local_theta) == rope["rope_theta"]
    if same and rope["rope_scaling"]["rope_type"] == "default":
        local_theta = None
    return rope, None if local_theta is None else float(local_theta)


def gemma_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 and Gemma 3 (text; the multimodal `gemma3` config through `text_config`)."""
    if hf.get("use_bidirectional_attention"):
        raise UserError("Gemma with use_bidirectional_attention is an encoder; not supported")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UserError(f"Gemma's hidden_activation {act!r} is not supported")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    window, window_layers = _windows(hf, 2 if hf["model_type"] == "gemma2" else 6)
    rope, local_theta = _gemma_rope(hf)
    if window is not None and not window_layers and local_theta is not None:  # all local
        rope = {**rope, "rope_theta": local_theta, "rope_scaling": {"rope_type": "default"}}
    head_dim = hf.get("head_dim") or hidden // heads
    return {
        "hidden_size": hidden,
        "num_layers": hf["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": head_dim,
        "intermediate_size": hf["intermediate_size"],
        "max_position_embeddings": hf.get("max_position_embeddings", 8192),
        "norm_eps": hf.get("rms_norm_eps", 1e-6),
        **rope,
        "qkv_bias": bool(hf.get("attention_bias", False)),
        "qk_norm": hf["model_type"] != "gemma2",
        "sliding_window": window,
        "window_layers": window_layers,
        "local_rope_theta": local_theta if window_layers else None,
        "query_scale": float(hf.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        "embed_scale": hidden**0.5,
        "sandwich_norms": True,
        "final_softcap": _cap(hf.get("final_logit_softcapping")),
        "attn_softcap": _cap(hf.get("attn_logit_softcapping")),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


def _cap(value: Any) -> float | None:
    """A soft-capping value (x -> cap * tanh(x / cap)); None caps nothing."""
    if value is None:
        return None
    if value <= 0:
        raise UserError(f"Gemma's soft-capping value {value} must be positive (or null: none)")
    return float(value)


def falcon_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Falcon: 7B's multi-query attention beside the MLP with one shared norm, and the
    new decoder architecture of 40B and 180B (grouped KV heads, the MLP's own norm)."""
    if hf.get("alibi"):
        raise UserError("Falcon with ALiBi (falcon-rw) is not supported; rotary Falcons are")
    if hf.get("activation", "gelu") != "gelu":
        raise UserError(f"Falcon's activation {hf['activation']!r} is not supported (gelu is)")
    hidden = hf.get("hidden_size") or hf["n_embed"]
    heads = hf.get("num_attention_heads") or hf["n_head"]
    new_arch = bool(hf.get("new_decoder_architecture", False))
    parallel = bool(hf.get("parallel_attn", True))
    if new_arch and not parallel:
        raise UserError("Falcon's new_decoder_architecture without parallel_attn is not supported")
    if new_arch:
        kv_heads = hf.get("num_kv_heads") or heads
    else:
        kv_heads = 1 if hf.get("multi_query", True) else heads
    return {
        "hidden_size": hidden,
        "num_layers": hf.get("num_hidden_layers") or hf["n_layer"],
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": hidden // heads,
        "intermediate_size": hf.get("ffn_hidden_size") or 4 * hidden,
        "max_position_embeddings": hf.get("max_position_embeddings", 2048),
        "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
        **rope_fields(hf, hf.get("rope_parameters") or hf.get("rope_scaling")),
        "parallel_attn": parallel,
        "parallel_mlp_norm": new_arch and (hf.get("num_ln_in_parallel_attn") or 2) == 2,
        "linear_bias": bool(hf.get("bias", False)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


READERS = {
    "gemma2": gemma_fields,
    "gemma3_text": gemma_fields,
    "gemma3": gemma_fields,
    "falcon": falcon_fields,
}


def llama_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Llama's and the Llama-like families' fields (Mistral, Qwen2/3, Phi-3)."""
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    # transformers 5 writes rope settings as `rope_parameters`; older configs as
    # `rope_theta` plus `rope_scaling`.
    rope = rope_fields(hf, hf.get("rope_parameters") or hf.get("rope_scaling"))
    window = hf.get("sliding_window")
    if hf["model_type"] in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
        window = None
    return {
        "hidden_size": hidden,
        "num_layers": hf["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hidden // heads,
        "intermediate_size": hf["intermediate_size"],
        "max_position_embeddings": hf.get("max_position_embeddings", 2048),
        "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": rope["rope_theta"],
        "rope_scaling": rope["rope_scaling"],
        "rotary_fraction": rope["rotary_fraction"],
        "qkv_bias": bool(hf.get("attention_bias", False)) or hf["model_type"] == "qwen2",
        "qk_norm": hf["model_type"] == "qwen3",
        "sliding_window": window,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def bloom_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """BLOOM's fields (its older key names beside the newer)."""
    hidden = hf.get("hidden_size") or hf.get("n_embed")
    heads = hf.get("n_head") or hf["num_attention_heads"]
    return {
        "hidden_size": hidden,
        "num_layers": hf.get("n_layer") or hf["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": heads,
        "head_dim": hidden // heads,
        "intermediate_size": 4 * hidden,
        # ALiBi has no position limit; BLOOM was trained on 2048-token sequences.
        "max_position_embeddings": hf.get("seq_length", 2048),
        "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
        "residual_from_norm": bool(hf.get("apply_residual_connection_post_layernorm", False)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


def opt_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """OPT's fields; the variants offload does not run are refused, named."""
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    proj = hf.get("word_embed_proj_dim") or hidden
    if hf.get("_remove_final_layer_norm", False):
        raise UserError("OPT configs with _remove_final_layer_norm=true are not supported")
    if not hf.get("enable_bias", True):
        raise UserError("OPT configs with enable_bias=false are not supported")
    return {
        "hidden_size": hidden,
        "num_layers": hf["num_hidden_layers"],
        "num_heads": heads,
        "num_kv_heads": heads,
        "head_dim": hidden // heads,
        "intermediate_size": hf["ffn_dim"],
        "max_position_embeddings": hf.get("max_position_embeddings", 2048),
        "norm_eps": 1e-5,
        "do_layer_norm_before": bool(hf.get("do_layer_norm_before", True)),
        "word_embed_proj_dim": proj if proj != hidden else None,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }
