"""Mixtures of experts: dummy routing's skew, the block's parts against its whole.

The families' math against transformers' own classes runs in tests/test_model_math.py
(the `tiny_models.MOE_CASES`)."""

from __future__ import annotations

import torch

from offload.core.config import ModelConfig
from offload.core.presets import PRESETS
from offload.models import moe
from offload.models.weights import DummySource


def _tiny(name: str, **extra) -> ModelConfig:
    hf = {**PRESETS[name], "hidden_size": 64, "num_hidden_layers": 2, "head_dim": 16}
    hf.update({"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320})
    hf.update({"intermediate_size": 96, "moe_intermediate_size": 32})
    return ModelConfig.from_hf({**hf, **extra}, name)


def test_dummy_routing_is_skewed_in_a_seeded_order():
    """The dummy router's rows are scaled in a seeded order: some experts take several
    times the tokens of others, and the favourites differ between layers."""
    cfg = _tiny("qwen3-235b-a22b", num_experts=64)  # top 8
    h = torch.randn(4096, cfg.hidden_size)
    source = DummySource(cfg, seed=0)
    favourites = []
    for layer in range(2):
        w = source.layer(layer, torch.float32, torch.device("cpu"))
        routing = moe.route(cfg, w, h)
        counts = torch.bincount(routing.ids.flatten(), minlength=cfg.num_experts)
        assert counts.max() > 3 * counts.min(), counts
        favourites.append(counts.argmax().item())
    assert favourites[0] != favourites[1]


def test_the_block_by_parts_is_the_block():
    """Routing a block, then each chosen expert over its rows in any order of fetching,
    added in ascending expert order, is `moe_block` bit for bit."""
    cfg = _tiny("glm-4.5-air")
    w = DummySource(cfg, seed=1).layer(1, torch.float32, torch.device("cpu"))
    x, residual = torch.randn(2, 5, cfg.hidden_size), torch.randn(2, 5, cfg.hidden_size)
    whole = moe.moe_block(cfg, w, x.clone(), residual)
    h, res = moe.pre(cfg, w, x.clone(), residual)
    chosen = moe.expert_rows(moe.route(cfg, w, h))
    outputs = {e: moe.expert_mlp(h[rows], *moe.expert_weights(w, e)) for e, rows, _ in chosen[::-1]}
    out = torch.zeros_like(h)
    for expert, rows, weights in chosen:
        moe.add_expert(out, rows, weights, outputs[expert])
    assert torch.equal(moe.post(out, moe.shared(cfg, w, h), res).view_as(x), whole)
