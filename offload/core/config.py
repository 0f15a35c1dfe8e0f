"""`ModelConfig`: the facts of a decoder-only model, read from a Hugging Face `config.json`.

One decoder stack expresses three families:

| family | positions                 | norm      | MLP                | attention            |
| ------ | ------------------------- | --------- | ------------------ | -------------------- |
| llama  | RoPE (incl. llama3 scale) | RMSNorm   | SwiGLU (gated)     | GQA, optional bias   |
| bloom  | ALiBi                     | LayerNorm | tanh-GELU          | fused qkv in the ckpt |
| opt    | learned, offset 2         | LayerNorm | ReLU               | MHA with bias        |

Llama, Mistral and Qwen2 checkpoints all map onto the `llama` family.
So do the mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5's `glm4_moe`):
their layers' MLP is a router and experts (`models.moe`).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from offload.core.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)


def resolve_dtype(name: str, on_gpu: bool, checkpoint_dtype: str) -> torch.dtype:
    """ "auto": float32 on the CPU; on a GPU the checkpoint's float16, else bfloat16."""
    if name != "auto":
        if name not in DTYPES:
            raise UserError(f"unknown dtype {name!r}; choose {', '.join(DTYPE_CHOICES)}")
        return DTYPES[name]
    if not on_gpu:
        return torch.float32
    return torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16


LLAMA_LIKE = ("llama", "mistral", "qwen2")
SUPPORTED_MODEL_TYPES = (*LLAMA_LIKE, "bloom", "opt")
# mixture-of-experts families: Llama-like layers whose MLP is a `models.moe` block
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "glm4_moe")
LLAMA_LIKE += MOE_MODEL_TYPES
SUPPORTED_MODEL_TYPES += MOE_MODEL_TYPES
# fields added after stores were built: left out of a fingerprint at their defaults
LATE_FIELDS = (
    "gathered_vocab_size",
    "qk_norm",
    "partial_rotary_factor",
    "num_experts",
    "experts_per_token",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "shared_expert_gate",
    "router",
    "norm_topk_prob",
    "routed_scaling_factor",
    "router_groups",
    "router_topk_groups",
    "dense_layers",
)
# OPT's learned position table starts at index 2 (fairseq heritage).
OPT_POSITION_OFFSET = 2


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `rope_type` is "default", "linear" or "llama3"."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "linear", "llama3"):
            raise UserError(
                f"rope scaling type {self.rope_type!r} is not supported; "
                "supported: default, linear, llama3"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Architecture facts; no placement, no dtype of the run."""

    name: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    family: str = field(init=False)
    # Llama family
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    qkv_bias: bool = False
    sliding_window: int | None = None
    # OPT
    do_layer_norm_before: bool = True
    word_embed_proj_dim: int | None = None
    # BLOOM
    residual_from_norm: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    checkpoint_dtype: str = "float32"
    # a tensor-parallel rank's shard: the whole model's vocabulary, which its logits are
    # gathered to (`parallel.comm.gather_vocab`); 0 where vocab_size is the whole
    gathered_vocab_size: int = 0
    # per-head RMSNorm of q and k before RoPE (Qwen3-MoE); RoPE over the first
    # partial_rotary_factor of each head's channels (GLM-4.5: half)
    qk_norm: bool = False
    partial_rotary_factor: float = 1.0
    # mixture of experts (`models.moe`); num_experts 0: a dense model
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    # an always-on expert beside the routed ones (0: none), with its own sigmoid gate
    # over the hidden state where shared_expert_gate (Qwen2-MoE)
    shared_expert_intermediate_size: int = 0
    shared_expert_gate: bool = False
    # "softmax" (Mixtral, Qwen: top-k of the softmax, renormalized where norm_topk_prob)
    # or "sigmoid" (DeepSeek-V3, GLM-4.5: sigmoid scores plus a correction bias choose,
    # within the best router_topk_groups of router_groups groups; the chosen scores,
    # renormalized where norm_topk_prob, times routed_scaling_factor weigh)
    router: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    router_groups: int = 1
    router_topk_groups: int = 1
    # layers whose MLP is a plain one of intermediate_size (GLM-4.5's first layers)
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(
                f"model type {self.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        family = "llama" if self.model_type in LLAMA_LIKE else self.model_type
        object.__setattr__(self, "family", family)
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token={self.experts_per_token} must be in 1..{self.num_experts}"
            )
        if self.router not in ("softmax", "sigmoid"):
            raise ValueError(f"router {self.router!r} must be softmax or sigmoid")

    # -- derived facts --------------------------------------------------------------
    @property
    def norm_kind(self) -> str:
        return "rms" if self.family == "llama" else "layer"

    @property
    def activation(self) -> str:
        return {"llama": "silu", "bloom": "gelu_tanh", "opt": "relu"}[self.family]

    @property
    def rotary(self) -> bool:
        """Rotary position embeddings (the Llama family); the others add positions or ALiBi."""
        return self.family == "llama"

    @property
    def gated_mlp(self) -> bool:
        return self.family == "llama"

    @property
    def has_linear_bias(self) -> bool:
        """o-proj and MLP biases (BLOOM and OPT have them; Llama-family models do not)."""
        return self.family != "llama"

    @property
    def has_qkv_bias(self) -> bool:
        return self.has_linear_bias or self.qkv_bias

    @property
    def rotary_dim(self) -> int:
        """Channels of a head that RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, layer: int) -> bool:
        """Layer `layer`'s MLP is a mixture of experts (`models.moe`)."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    @property
    def embed_dim(self) -> int:
        """Width of the token embedding (OPT-350m embeds at 512 and projects to 1024)."""
        return self.word_embed_proj_dim or self.hidden_size

    @property
    def qkv_out_features(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token over all layers at 2 bytes per element."""
        return 2 * 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def layer_param_count(self, layer: int | None = None, active: bool = False) -> int:
        """A layer's parameters (default: the average layer's); active: those one token
        computes with (a mixture of experts' routed experts it chose, not all)."""
        if layer is None:
            counts = [self.layer_param_count(i, active) for i in range(self.num_layers)]
            return sum(counts) // max(1, len(counts))
        h, q_out = self.hidden_size, self.num_heads * self.head_dim
        mlp_in = self.intermediate_size * (2 if self.gated_mlp else 1)
        mlp = h * mlp_in + self.intermediate_size * h
        if self.is_moe_layer(layer):
            experts = self.experts_per_token if active else self.num_experts
            mlp = experts * self.moe_intermediate_size + self.shared_expert_intermediate_size
            mlp = 3 * h * mlp + h * (self.num_experts + self.shared_expert_gate)
        count = h * self.qkv_out_features + q_out * h + mlp
        norms = 2 * h * (2 if self.norm_kind == "layer" else 1)
        biases = 0
        if self.has_qkv_bias:
            biases += self.qkv_out_features
        if self.has_linear_bias:
            biases += h + mlp_in + h
        return count + norms + biases

    def param_count(self) -> int:
        embed = self.vocab_size * self.embed_dim
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.embed_dim
        return embed + head + sum(self.layer_param_count(i) for i in range(self.num_layers))

    def fingerprint(self) -> str:
        """A short stable hash of the architecture, for caches and stores."""
        facts = asdict(self)
        defaults = {f.name: f.default for f in fields(self)}
        for name in LATE_FIELDS:  # the fingerprints of stores built before them
            if facts[name] == defaults[name]:
                del facts[name]
        text = json.dumps(facts, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    # -- construction -----------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str = "") -> ModelConfig:
        """Build from the dict of a Hugging Face `config.json`."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(
                f"model type {model_type!r} in config.json is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        common = {
            "name": name or hf.get("_name_or_path", "") or model_type,
            "model_type": model_type,
            "vocab_size": hf["vocab_size"],
            "bos_token_id": hf.get("bos_token_id"),
            "eos_token_ids": _as_tuple(hf.get("eos_token_id")),
            "pad_token_id": hf.get("pad_token_id"),
            "checkpoint_dtype": str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
        }
        if model_type in MOE_MODEL_TYPES:
            return cls(**common, **{**_llama_fields(hf), **_moe_fields(hf)})
        if model_type in LLAMA_LIKE:
            return cls(**common, **_llama_fields(hf))
        if model_type == "bloom":
            return cls(**common, **_bloom_fields(hf))
        return cls(**common, **_opt_fields(hf))


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _llama_fields(hf: dict[str, Any]) -> dict[str, Any]:
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    # transformers 5 writes rope settings as `rope_parameters`; older configs as
    # `rope_theta` plus `rope_scaling`.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    scaling_keys = {
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    }
    scaling = RopeScaling(
        rope_type=rope_type, **{k: v for k, v in rope.items() if k in scaling_keys}
    )
    window = hf.get("sliding_window")
    if hf["model_type"] == "qwen2" and not hf.get("use_sliding_window", False):
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
        "rope_theta": float(theta),
        "rope_scaling": scaling,
        "qkv_bias": bool(hf.get("attention_bias", False)) or hf["model_type"] == "qwen2",
        "sliding_window": window,
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def _moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """A mixture of experts' fields, over `_llama_fields`' for its attention (Qwen's
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
        out["partial_rotary_factor"] = float(
            hf.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 0.5
        )
    return out


def _bloom_fields(hf: dict[str, Any]) -> dict[str, Any]:
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


def _opt_fields(hf: dict[str, Any]) -> dict[str, Any]:
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


def alibi_slopes(num_heads: int) -> list[float]:
    """BLOOM's per-head ALiBi slopes (geometric, with the non-power-of-two extension)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        extra = [extra_base ** (2 * i + 1) for i in range(num_heads - closest)]
        slopes += extra
    return slopes
