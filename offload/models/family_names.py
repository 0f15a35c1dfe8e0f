"""Checkpoint tensor names of the families beyond Llama, BLOOM and OPT (`checkpoint.py`
reads with them): Falcon's own, and what Qwen3, Phi-3, Gemma and the mixtures of experts
change in Llama's.

A name map takes canonical names (`models.shapes`) to the Hugging Face names that are
concatenated along dim 0 into them; an entry without a suffix is a module whose
`.weight` (and `.bias`) are meant.
"""

from __future__ import annotations

import torch

from offload.core.config import ModelConfig
from offload.models.shapes import expert_name

NameMap = dict[str, list[str]]


def llama_variant(cfg: ModelConfig, stage: str, index: int, names: NameMap) -> NameMap:
    """Llama's names of a stage, changed where the model differs: Phi-3's fused qkv and
    gate-up projections, the q/k norms of Qwen3 and Gemma 3, Gemma's sandwich norms."""
    if stage != "layer":
        return names
    p = f"model.layers.{index}."
    names = dict(names)
    if cfg.model_type == "phi3":
        names["qkv"] = [p + "self_attn.qkv_proj"]
        names["mlp_in.weight"] = [p + "mlp.gate_up_proj.weight"]
    if cfg.qk_norm:
        names["q_norm.weight"] = [p + "self_attn.q_norm.weight"]
        names["k_norm.weight"] = [p + "self_attn.k_norm.weight"]
    if cfg.sandwich_norms:
        names["post_attn_norm.weight"] = [p + "post_attention_layernorm.weight"]
        names["mlp_norm.weight"] = [p + "pre_feedforward_layernorm.weight"]
        names["post_mlp_norm.weight"] = [p + "post_feedforward_layernorm.weight"]
    return names


def moe(cfg: ModelConfig, index: int) -> NameMap:
    """A mixture of experts' layer names (Mixtral's `block_sparse_moe` with w1 (gate), w3
    (up) and w2 (down); Qwen's and GLM-4.5's `mlp` with gate, up and down projections),
    as the hub's checkpoints and transformers' save_pretrained write them."""
    p, mixtral = f"model.layers.{index}.", cfg.model_type == "mixtral"
    block = p + ("block_sparse_moe." if mixtral else "mlp.")
    names: NameMap = {"router.weight": [block + "gate.weight"]}
    names["router.correction"] = [block + "gate.e_score_correction_bias"]
    shared = block + ("shared_expert." if cfg.model_type == "qwen2_moe" else "shared_experts.")
    names["shared.mlp_in.weight"] = [shared + "gate_proj.weight", shared + "up_proj.weight"]
    names["shared.mlp_out.weight"] = [shared + "down_proj.weight"]
    names["shared.gate.weight"] = [block + "shared_expert_gate.weight"]
    for e in range(cfg.num_experts):
        expert = f"{block}experts.{e}."
        gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        names[expert_name(e, "mlp_in")] = [f"{expert}{gate}.weight", f"{expert}{up}.weight"]
        names[expert_name(e, "mlp_out")] = [f"{expert}{down}.weight"]
    return names


def mla(cfg: ModelConfig, index: int) -> NameMap:
    """A latent-attention layer's attention names (DeepSeek-V2/V3's `self_attn`): the
    query's projection (q_a_proj, or q_proj without q_lora_rank) and kv_a_proj_with_mqa
    concatenated into one matrix, as `models.shapes` lays them out."""
    p = f"model.layers.{index}.self_attn."
    query = "q_a_proj" if cfg.q_lora_rank else "q_proj"
    names: NameMap = {
        "qkv.weight": [f"{p}{query}.weight", f"{p}kv_a_proj_with_mqa.weight"],
        "kv_a_norm.weight": [p + "kv_a_layernorm.weight"],
        "kv_b.weight": [p + "kv_b_proj.weight"],
        "o.weight": [p + "o_proj.weight"],
    }
    if cfg.q_lora_rank:
        names["q_a_norm.weight"] = [p + "q_a_layernorm.weight"]
        names["q_b.weight"] = [p + "q_b_proj.weight"]
    return names


def falcon(cfg: ModelConfig, stage: str, index: int) -> NameMap:
    p = f"transformer.h.{index}."
    if stage == "embed":
        return {"tok.weight": ["transformer.word_embeddings.weight"]}
    if stage == "head":
        return {"final_norm": ["transformer.ln_f"], "lm_head.weight": ["lm_head.weight"]}
    layer = {
        "attn_norm": [p + ("ln_attn" if cfg.parallel_mlp_norm else "input_layernorm")],
        "qkv": [p + "self_attention.query_key_value"],
        "o": [p + "self_attention.dense"],
        "mlp_in": [p + "mlp.dense_h_to_4h"],
        "mlp_out": [p + "mlp.dense_4h_to_h"],
    }
    if cfg.has_mlp_norm:
        layer["mlp_norm"] = [p + ("ln_mlp" if cfg.parallel_attn else "post_attention_layernorm")]
    return layer


def language_model_prefix(names) -> dict[str, str]:
    """Where a multimodal checkpoint (Gemma 3's) keeps its language model: the
    canonical Hugging Face prefixes mapped onto the stored ones ({} if not one)."""
    for stored in ("model.language_model.", "language_model.model."):
        if any(n.startswith(stored) for n in names):
            head = "language_model.lm_head." if stored.startswith("language_model") else "lm_head."
            return {"model.": stored, "lm_head.": head}
    return {}


def grouped_qkv(cfg: ModelConfig) -> bool:
    """Whether the checkpoint's fused qkv rows are grouped per KV head, [the group's
    query heads, its key, its value] for each: BLOOM (a group a head) and Falcon."""
    return cfg.family in ("bloom", "falcon")


def grouped_qkv_to_blocks(t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Rows grouped per KV head (`grouped_qkv`) reordered to [q heads | k heads | v heads]."""
    per_group, rest = cfg.num_heads // cfg.num_kv_heads, t.shape[1:]
    groups = t.reshape(cfg.num_kv_heads, per_group + 2, cfg.head_dim, *rest)
    q = groups[:, :per_group].reshape(-1, *rest)
    k, v = (groups[:, per_group + i].reshape(-1, *rest) for i in (0, 1))
    return torch.cat([q, k, v])
