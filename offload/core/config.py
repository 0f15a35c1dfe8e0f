"""`ModelConfig`: the facts of a decoder-only model, read from a Hugging Face `config.json`.

One decoder stack expresses five families:

| family | positions                 | norm      | MLP                | attention            |
| ------ | ------------------------- | --------- | ------------------ | -------------------- |
| llama  | RoPE (llama3, LongRoPE, YaRN) | RMSNorm   | SwiGLU (gated)     | GQA, optional bias   |
| gemma  | RoPE, local and global    | RMSNorm (1 + w), sandwich | GeGLU (gated) | GQA, q/k norms, soft-capping |
| bloom  | ALiBi                     | LayerNorm | tanh-GELU          | fused qkv in the ckpt |
| opt    | learned, offset 2         | LayerNorm | ReLU               | MHA with bias        |
| falcon | RoPE                      | LayerNorm | GELU, parallel to attention | MQA / GQA   |

Llama, Mistral, Qwen2, Qwen3 (q/k norms) and Phi-3 (fused qkv and gate-up, LongRoPE,
partial rotary) checkpoints map onto the `llama` family; Gemma 2 and 3 onto `gemma`
(`families.py` reads their configs and Falcon's). What differs inside a family is a
field (`qk_norm`, `sandwich_norms`, `parallel_attn`, ...), read by the decoder's
functions, not the model type.
The mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5's `glm4_moe`) are
Llama-like layers whose MLP is a router and experts (`models.moe`; `moe_config.py` reads
their configs). DeepSeek-V2/V3 and Kimi-K2 are too, with latent attention (`models.mla`;
`mla_config.py` reads their configs).
their configs); gpt-oss (`gpt_oss`) is one with attention sinks and biased, clamped
experts (`gpt_oss_config.py`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from offload.core import families, gpt_oss_config, hf_config, mla_config, moe_config
from offload.core.errors import UserError
from offload.core.family import Family, family

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


LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "phi3")
# the mixtures of experts: Llama-like layers whose MLP is a `models.moe` block
LLAMA_LIKE += moe_config.MOE_MODEL_TYPES
# ... and the latent-attention mixtures of experts (`models.mla`)
LLAMA_LIKE += mla_config.MLA_MODEL_TYPES
# gpt-oss: a mixture of experts with attention sinks (`gpt_oss_config`)
LLAMA_LIKE += (gpt_oss_config.MODEL_TYPE,)
# the routers of `models.moe`
ROUTERS = ("softmax", "sigmoid", "softmax_groups", "topk_softmax")
SUPPORTED_MODEL_TYPES = (*LLAMA_LIKE, "bloom", "opt", *families.READERS)
# OPT's learned position table starts at index 2 (fairseq heritage).
OPT_POSITION_OFFSET = 2


ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: `rope_type` is one of ROPE_TYPES. LongRoPE (Phi-3) divides
    the frequencies by `short_factor`, or by `long_factor` in a step whose positions
    reach past original_max_position_embeddings, and scales cos and sin by
    `attention_factor` (`models.ops.Rotary`). YaRN blends interpolated and extrapolated
    frequencies between the dimensions that turn `beta_fast` and `beta_slow` times
    (`models.yarn`; `truncate`: that range rounded outwards); `mscale` and
    `mscale_all_dim` set its attention factor, and latent attention's softmax scale
    (`models.mla`)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise UserError(
                f"rope scaling type {self.rope_type!r} is not supported; "
                f"supported: {', '.join(ROPE_TYPES)}"
            )


def family_name(model_type: str) -> str:
    """The family (`core.family`) a supported model type's layers belong to."""
    name = "llama" if model_type in LLAMA_LIKE else model_type
    return families.FAMILY_OF.get(name, name)


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
    # variants (the module doc's table), each read by the decoder function it changes
    qk_norm: bool = False  # an RMS norm over each head's q and k before RoPE (Qwen3, Gemma 3)
    rotary_fraction: float = 1.0  # RoPE turns this fraction of a head's channels (Phi-4-mini)
    window_layers: tuple[bool, ...] = ()  # the layers the sliding window applies to; (): all
    local_rope_theta: float | None = None  # RoPE base of windowed layers, where it differs
    query_scale: float | None = None  # the attention's score scale, where not head_dim ** -0.5
    embed_scale: float | None = None  # token embeddings times this, rounded to the dtype
    sandwich_norms: bool = False  # norms on the attention's and the MLP's outputs too (Gemma)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    attn_softcap: float | None = None  # attention scores likewise, before the bias (Gemma 2)
    parallel_attn: bool = False  # attention and MLP both read the layer's input (Falcon)
    parallel_mlp_norm: bool = False  # ... the MLP through its own norm (Falcon 40B, 180B)
    linear_bias: bool = False  # every projection has a bias (Falcon's `bias`)
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
    # latent attention (`models.mla`; kv_lora_rank 0: none): the query's low rank (0: a
    # full q projection), the cached latent's width, a query head's no-RoPE and RoPE
    # channels and a value head's; num_kv_heads is 1 and head_dim the latent's width
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # gpt-oss (`gpt_oss_config`): a learned sink logit per head in each softmax's
    # denominator; o-projection bias; experts (and router) with biases; the experts'
    # clamped SwiGLU where swiglu_limit is set; experts stored in MXFP4
    attention_sinks: bool = False
    o_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    mxfp4_experts: bool = False

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(
                f"model type {self.model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        object.__setattr__(self, "family", family_name(self.model_type))
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
        if self.router not in ROUTERS:
            raise ValueError(f"router {self.router!r} must be one of {', '.join(ROUTERS)}")

    # -- derived facts --------------------------------------------------------------
    @property
    def record(self) -> Family:
        """The family's record (`core.family`): its layer's parts and its pricing."""
        return family(self.family)

    @property
    def norm_kind(self) -> str:
        """`kernels.norm`'s kind: "rms", "rms_offset" (Gemma's (1 + w)) or "layer"."""
        return self.record.norm

    @property
    def activation(self) -> str:
        return self.record.activation

    @property
    def rotary(self) -> bool:
        """Rotary position embeddings; BLOOM and OPT add ALiBi or learned positions."""
        return self.record.positions == "rope"

    @property
    def rotary_dim(self) -> int:
        """The channels of a head that RoPE turns (the first ones; latent attention's
        decoupled RoPE part)."""
        if self.kv_lora_rank:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.rotary_fraction)

    @property
    def gated_mlp(self) -> bool:
        return self.record.gated_mlp

    @property
    def has_linear_bias(self) -> bool:
        """o-proj and MLP biases (BLOOM, OPT and Falcon with `bias`; not Llama or Gemma)."""
        return self.record.linear_bias or self.linear_bias

    @property
    def has_mlp_norm(self) -> bool:
        """A norm of the MLP's own (not a parallel layer sharing the attention's)."""
        return not self.parallel_attn or self.parallel_mlp_norm

    def window_of(self, local: bool) -> int | None:
        """The sliding window of a windowed (local) layer, or of the others."""
        return self.sliding_window if local or not self.window_layers else None

    def is_local(self, layer: int) -> bool:
        """Whether `layer` takes the local (windowed) inputs where layers differ."""
        return bool(self.window_layers) and self.window_layers[layer]

    @property
    def has_qkv_bias(self) -> bool:
        return self.has_linear_bias or self.qkv_bias

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
    def kv_entry_width(self) -> int:
        """Values one token's KV cache entry holds a layer: K and V of every KV head, or
        latent attention's compressed latent and RoPE key (one for all heads)."""
        if self.kv_lora_rank:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token over all layers at 2 bytes per element."""
        return 2 * self.num_layers * self.kv_entry_width

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
        if self.kv_lora_rank:  # latent attention's low-rank projections
            count = mla_config.attention_param_count(self) + mlp
        norms = (2 + 2 * self.sandwich_norms) * h * (2 if self.norm_kind == "layer" else 1)
        norms += 2 * self.head_dim * self.qk_norm
        biases = 0
        if self.has_qkv_bias:
            biases += self.qkv_out_features
        if self.has_linear_bias:
            biases += h + mlp_in + h
        if self.expert_bias and self.is_moe_layer(layer):  # gpt-oss: experts', router's
            experts = self.experts_per_token if active else self.num_experts
            biases += experts * (2 * self.moe_intermediate_size + h) + self.num_experts
        biases += h * self.o_bias + self.num_heads * self.attention_sinks
        return count + norms + biases

    def param_count(self) -> int:
        embed = self.vocab_size * self.embed_dim
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.embed_dim
        return embed + head + sum(self.layer_param_count(i) for i in range(self.num_layers))

    def fingerprint(self) -> str:
        """A short stable hash of the architecture, for caches and stores."""
        facts = asdict(self)
        if not facts["gathered_vocab_size"]:  # the fingerprints of stores built before it
            del facts["gathered_vocab_size"]
        # a field at its default leaves the fingerprint as it was before the field existed
        defaults = {
            **families.VARIANT_DEFAULTS,
            **moe_config.MOE_DEFAULTS,
            **mla_config.MLA_DEFAULTS,
            **gpt_oss_config.GPT_OSS_DEFAULTS,
        }
        for name, default in defaults.items():
            if facts.get(name) == default:
                del facts[name]
        for name, default in families.ROPE_DEFAULTS.items():
            if facts["rope_scaling"].get(name) == default:
                del facts["rope_scaling"][name]
        text = json.dumps(facts, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    # -- construction -----------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str = "") -> ModelConfig:
        """Build from the dict of a Hugging Face `config.json`, with the defaults its
        transformers config class fills (`hf_config.with_defaults`)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(
                f"model type {model_type!r} in config.json is not supported; "
                f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        hf = families.text_config(hf_config.with_defaults(hf))
        common = {
            "name": name or hf.get("_name_or_path", "") or model_type,
            "model_type": model_type,
            "vocab_size": hf["vocab_size"],
            "bos_token_id": hf.get("bos_token_id"),
            "eos_token_ids": _as_tuple(hf.get("eos_token_id")),
            "pad_token_id": hf.get("pad_token_id"),
            "checkpoint_dtype": str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
        }
        fields = _fields(model_type, hf)
        if "rope_scaling" in fields:  # (the readers give its keyword arguments)
            fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
        return cls(**common, **fields)


def _fields(model_type: str, hf: dict[str, Any]) -> dict[str, Any]:
    """The fields of `ModelConfig` a model type's config.json gives (`families`,
    `moe_config`, `mla_config`, `gpt_oss_config` read them)."""
    if model_type in mla_config.MLA_MODEL_TYPES:
        return mla_config.mla_fields(hf)
    if model_type in moe_config.MOE_MODEL_TYPES:
        return {**families.llama_fields(hf), **moe_config.moe_fields(hf)}
    if model_type == gpt_oss_config.MODEL_TYPE:
        if not (hf.get("rope_parameters") or hf.get("rope_scaling")):
            hf = {**hf, "rope_parameters": gpt_oss_config.DEFAULT_ROPE}
        return {**families.llama_fields(hf), **gpt_oss_config.gpt_oss_fields(hf)}
    if model_type in LLAMA_LIKE:
        return families.llama_fields(hf)
    if model_type in families.READERS:
        return families.READERS[model_type](hf)
    if model_type == "bloom":
        return families.bloom_fields(hf)
    return families.opt_fields(hf)


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)
