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
    head stage:   final_norm.weight(/.bias) (absent for OPT-350m);
                  proj_out.weight [E, hidden] (OPT-350m); lm_head.weight [V, E]
                  (for tied embeddings a source hands out tok.weight under this name,
                  and the executor's embedding reads its rows from it: `io.layout`)
"""

from __future__ import annotations

import torch

from offload.core.config import OPT_POSITION_OFFSET, ModelConfig
from offload.kernels.quant import QTensor

# A quantized layer matrix arrives as a `QTensor` (compressed weights); the decoder runs
# it through the dequantize-and-multiply kernel.
Weights = dict[str, torch.Tensor | QTensor]


def stage_shapes(cfg: ModelConfig, stage: str) -> dict[str, tuple[int, ...]]:
    """Canonical tensor names and shapes of a stage: "embed", "layer" or "head"."""
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
    return shapes
