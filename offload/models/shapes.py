"""The canonical names and shapes of a stage's weights, which every weight source hands
out and every layer reads:

    embed stage:  tok.weight [V, E]; pos.weight [P, hidden] (OPT);
                  embed_norm.weight/.bias (BLOOM); proj_in.weight [hidden, E] (OPT-350m)
    layer i:      attn_norm.weight(/.bias); qkv.weight [(H + 2*Hkv)*D, hidden](/.bias);
                  o.weight [hidden, H*D](/.bias); mlp_norm.weight(/.bias) (absent where a
                  parallel layer's MLP shares attn_norm: Falcon-7B);
                  mlp_in.weight [I or 2*I (gate | up), hidden](/.bias);
                  mlp_out.weight [hidden, I](/.bias); q_norm.weight, k_norm.weight [D]
                  (`qk_norm`); post_attn_norm.weight, post_mlp_norm.weight [hidden]
                  (`sandwich_norms`)
    a latent-attention layer (`models.mla`; `ModelConfig.kv_lora_rank`), in place of
                  qkv and o: qkv.weight [Q + R + P, hidden] (the query's projection,
                  Q = q_lora_rank, or H*(N + P) without one, beside kv_a's R =
                  kv_lora_rank latent and P = qk_rope_head_dim RoPE key rows);
                  q_a_norm.weight [Q] and q_b.weight [H*(N + P), Q] (with q_lora_rank);
                  kv_a_norm.weight [R]; kv_b.weight [H*(N + V), R] (each head's N
                  no-RoPE key rows then its V value rows); o.weight [hidden, H*V]
    a mixture-of-experts layer (`models.moe`; `ModelConfig.is_moe_layer`), in place of
                  mlp_in/mlp_out: router.weight [E, hidden]; router.correction [E]
                  (the sigmoid router's score bias); shared.mlp_in.weight
                  [2*Is, hidden], shared.mlp_out.weight [hidden, Is] and
                  shared.gate.weight [1, hidden] (a shared expert, its gate); then each
                  expert e in order, last in the stage: experts.<e>.mlp_in.weight
                  [2*Im, hidden], experts.<e>.mlp_out.weight [hidden, Im] (gpt-oss:
                  router.bias, each matrix's .bias, MXFP4 .blocks and .scales in place
                  of .weight; `sinks` [H], o.bias). Each expert's
                  tensors are its own, together at the image's end (`io.layout`), so an
                  expert is placed and fetched alone.
    head stage:   final_norm.weight(/.bias) (absent for OPT-350m);
                  proj_out.weight [E, hidden] (OPT-350m); lm_head.weight [V, E]
                  (for tied embeddings a source hands out tok.weight under this name,
                  and the executor's embedding reads its rows from it: `io.layout`)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload.core.config import OPT_POSITION_OFFSET, ModelConfig
from offload.kernels.formats import MXFP4_BLOCK, MXFP4_BLOCKS, MXFP4_SCALES
from offload.kernels.quant import QTensor

# A quantized layer matrix arrives as a `QTensor` (compressed weights); the decoder runs
# it through the dequantize-and-multiply kernel.
Weights = dict[str, torch.Tensor | QTensor]


def expert_name(expert: int, matrix: str) -> str:
    """The canonical name of routed expert `expert`'s matrix "mlp_in" or "mlp_out"."""
    return f"experts.{expert}.{matrix}.weight"


def stage_shapes(cfg: ModelConfig, stage: str, index: int = 0) -> dict[str, tuple[int, ...]]:
    """Canonical tensor names and shapes of a stage: "embed", "layer" (layer `index`:
    a mixture of experts' layers differ) or "head"."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    if stage == "embed":
        shapes: dict[str, tuple[int, ...]] = {"tok.weight": (cfg.vocab_size, cfg.embed_dim)}
        if cfg.family == "opt":
            shapes["pos.weight"] = (cfg.max_position_embeddings + OPT_POSITION_OFFSET, hidden)
        if cfg.word_embed_proj_dim:
            shapes["proj_in.weight"] = (hidden, cfg.embed_dim)
        if cfg.family == "bloom":
            shapes["embed_norm.weight"] = (hidden,)
            shapes["embed_norm.bias"] = (hidden,)
        return shapes
    if stage == "head":
        shapes = {}
        if cfg.do_layer_norm_before:
            shapes["final_norm.weight"] = (hidden,)
            if cfg.norm_kind == "layer":
                shapes["final_norm.bias"] = (hidden,)
        if cfg.word_embed_proj_dim:
            shapes["proj_out.weight"] = (cfg.embed_dim, hidden)
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.embed_dim)
        return shapes
    assert stage == "layer", stage
    mlp_in = inter * (2 if cfg.gated_mlp else 1)
    shapes = {
        "attn_norm.weight": (hidden,),
        "qkv.weight": (cfg.qkv_out_features, hidden),
        "o.weight": (hidden, cfg.num_heads * cfg.head_dim),
        "mlp_norm.weight": (hidden,),
        "mlp_in.weight": (mlp_in, hidden),
        "mlp_out.weight": (hidden, inter),
    }
    if cfg.norm_kind == "layer":
        shapes["attn_norm.bias"] = (hidden,)
        shapes["mlp_norm.bias"] = (hidden,)
    if not cfg.has_mlp_norm:  # a parallel layer's MLP reads the attention's norm
        shapes.pop("mlp_norm.weight")
        shapes.pop("mlp_norm.bias", None)
    if cfg.qk_norm:
        shapes["q_norm.weight"] = shapes["k_norm.weight"] = (cfg.head_dim,)
    if cfg.sandwich_norms:
        shapes["post_attn_norm.weight"] = shapes["post_mlp_norm.weight"] = (hidden,)
    if cfg.has_qkv_bias:
        shapes["qkv.bias"] = (cfg.qkv_out_features,)
    if cfg.has_linear_bias:
        shapes.update({"o.bias": (hidden,), "mlp_in.bias": (mlp_in,), "mlp_out.bias": (hidden,)})
    if cfg.kv_lora_rank:
        shapes.update(_latent_shapes(cfg))
    if cfg.o_bias:
        shapes["o.bias"] = (hidden,)
    if cfg.attention_sinks:
        shapes["sinks"] = (cfg.num_heads,)
    if cfg.is_moe_layer(index):
        del shapes["mlp_in.weight"], shapes["mlp_out.weight"]
        shapes.update(_moe_shapes(cfg))
    return shapes


def _latent_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A latent-attention layer's projections and norms (the module docstring's)."""
    hidden, heads = cfg.hidden_size, cfg.num_heads
    q_out = heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    q_in = cfg.q_lora_rank or q_out
    shapes: dict[str, tuple[int, ...]] = {
        "qkv.weight": (q_in + cfg.kv_lora_rank + cfg.qk_rope_head_dim, hidden),
        "o.weight": (hidden, heads * cfg.v_head_dim),
    }
    if cfg.q_lora_rank:
        shapes["q_a_norm.weight"] = (cfg.q_lora_rank,)
        shapes["q_b.weight"] = (q_out, cfg.q_lora_rank)
    shapes["kv_a_norm.weight"] = (cfg.kv_lora_rank,)
    shapes["kv_b.weight"] = (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    return shapes


def _moe_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A mixture-of-experts block's tensors: router and shared expert, then the experts."""
    hidden, experts = cfg.hidden_size, cfg.num_experts
    shapes: dict[str, tuple[int, ...]] = {"router.weight": (experts, hidden)}
    if cfg.expert_bias:
        shapes["router.bias"] = (experts,)
    if cfg.router == "sigmoid":
        shapes["router.correction"] = (experts,)
    shared = cfg.shared_expert_intermediate_size
    if shared:
        shapes["shared.mlp_in.weight"] = (2 * shared, hidden)
        shapes["shared.mlp_out.weight"] = (hidden, shared)
        if cfg.shared_expert_gate:
            shapes["shared.gate.weight"] = (1, hidden)
    inter = cfg.moe_intermediate_size
    for expert in range(experts):
        for matrix, (rows, cols) in (("mlp_in", (2 * inter, hidden)), ("mlp_out", (hidden, inter))):
            name = expert_name(expert, matrix)
            if cfg.mxfp4_experts:  # `models.mxfp4`: 32 values a block, two a byte
                base = name.removesuffix(".weight")
                shapes[base + MXFP4_BLOCKS] = (rows, cols // MXFP4_BLOCK, MXFP4_BLOCK // 2)
                shapes[base + MXFP4_SCALES] = (rows, cols // MXFP4_BLOCK)
            else:
                shapes[name] = (rows, cols)
            if cfg.expert_bias:
                shapes[name.removesuffix(".weight") + ".bias"] = (rows,)
    return shapes


@dataclass(frozen=True)
class Part:
    """A piece of a canonical tensor that one tensor-parallel rank holds: the ranges
    [start, stop) along `dim`, concatenated in order (a rank's q, k and v heads of the
    fused qkv rows; its columns of a row-parallel matrix). zeros: a tensor of zeros of
    the whole shape instead (a row-parallel bias off the first rank: the all-reduce adds
    the first rank's once)."""

    dim: int = 0
    ranges: tuple[tuple[int, int], ...] = ()
    zeros: bool = False

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        if self.zeros:
            return full
        size = sum(stop - start for start, stop in self.ranges)
        return (*full[: self.dim], size, *full[self.dim + 1 :])

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This part of the whole `tensor`, in fresh memory of its own."""
        if self.zeros:
            return torch.zeros_like(tensor)
        pieces = [tensor.narrow(self.dim, start, stop - start) for start, stop in self.ranges]
        if len(pieces) > 1:
            return torch.cat(pieces, dim=self.dim)
        return pieces[0].clone(memory_format=torch.contiguous_format)


# canonical name -> the part of it wanted (a name not in it: the whole tensor)
Parts = dict[str, Part]
