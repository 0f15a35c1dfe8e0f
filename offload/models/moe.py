"""A mixture-of-experts MLP block as functions of inputs and weights.

A layer whose weights hold `router.weight` (`ModelConfig.is_moe_layer`) runs this block
in place of the dense MLP, in three parts that an executor may run apart:

    pre      the attention's residual added, the MLP norm: h [N, hidden]
    route    each token row's top-k experts and their weights (`Routing`)
    experts  each chosen expert once over all the rows that chose it, its weighted
             outputs added into the block's output in ascending expert order
             (`expert_rows`, `apply_expert`); plus the shared expert
    post     the residual added

The plain runner runs all of it at once (`moe_block`); the offloading executor routes
a whole block's micro-batches before any expert runs, so each chosen expert's weights
are fetched once a layer and step (docs/moe.md). Every expert's output is added in
ascending expert order, whatever order the executor fetched them in, so every
schedule adds the same numbers in the same order as the plain run.

The routers match transformers' classes:
- softmax (Mixtral, Qwen2-MoE, Qwen3-MoE): the top k of the softmax over all experts,
  divided by their sum where `norm_topk_prob` (Mixtral always: its softmax over the
  top k). Mixtral weighs the expert outputs in float32, the Qwen models in the
  compute dtype (`_weights_dtype`).
- sigmoid (DeepSeek-V3, GLM-4.5): in float32, sigmoid scores plus `router.correction`
  choose: the best `router_topk_groups` of `router_groups` groups (a group's score is
  the sum of its best two), then the top k within them; the chosen experts' plain
  sigmoid scores, renormalized where `norm_topk_prob`, times `routed_scaling_factor`.
- softmax_groups (DeepSeek-V2): in float32, the softmax over all experts; with
  `router_groups` > 1 (group_limited_greedy) the top k within the best
  `router_topk_groups` groups (a group's score is its best), else the plain top k; the
  chosen probabilities, not renormalized, times `routed_scaling_factor`.
- topk_softmax (gpt-oss): the router's logits with its bias; the top k of them,
  softmaxed among themselves, in the compute dtype.

gpt-oss's experts have biases (`Biased`: the matmul, then the bias added, as
transformers' `x @ W + b`), their matrices may be MXFP4 (`models.mxfp4`), and their
activation is the clamped SwiGLU (`swiglu`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from offload.core.config import ModelConfig
from offload.kernels import qmatmul
from offload.kernels.formats import MXFP4_BLOCKS, MXFP4_SCALES
from offload.kernels.norm import norm
from offload.kernels.qmatmul import qlinear
from offload.kernels.quant import QTensor
from offload.models import ops
from offload.models.mxfp4 import MXFP4
from offload.models.shapes import Weights, expert_name

# an expert's rows go through its MLP in slices of this many (as `decoder.mlp_chunks`):
# its intermediate (2 x moe_intermediate_size a row) stays small in a long prefill
EXPERT_CHUNK_ROWS = 4096


@dataclass(frozen=True)
class Routing:
    """The experts each of N token rows chose: ids [N, k] and weights [N, k]."""

    ids: torch.Tensor
    weights: torch.Tensor


@dataclass(frozen=True)
class Biased:
    """An expert matrix with its bias (gpt-oss)."""

    weight: torch.Tensor | QTensor | MXFP4
    bias: torch.Tensor


# gpt-oss's clamped SwiGLU: (limit, alpha)
Swiglu = tuple[float, float] | None


def swiglu(cfg: ModelConfig) -> Swiglu:
    """The experts' clamped SwiGLU where the model has one (None: plain SwiGLU)."""
    return None if cfg.swiglu_limit is None else (cfg.swiglu_limit, cfg.swiglu_alpha)


def is_moe(w: Weights) -> bool:
    """These layer weights hold a mixture of experts."""
    return "router.weight" in w


def pre(cfg: ModelConfig, w: Weights, x: torch.Tensor, attn_residual: torch.Tensor):
    """x (the attention's projected output) plus its residual, in place: the block's
    residual; and its MLP norm h. Both [N, hidden]."""
    rows = x.reshape(-1, x.shape[-1])
    residual = attn_residual.reshape(rows.shape)
    h = norm(rows, w["mlp_norm.weight"], None, "rms", cfg.norm_eps, residual)
    return h, rows


def route(cfg: ModelConfig, w: Weights, h: torch.Tensor) -> Routing:
    """Each row of h [N, hidden]'s experts and weights (the module docstring's rules)."""
    k = cfg.experts_per_token
    if cfg.router == "softmax_groups":
        return _route_softmax_groups(cfg, w, h)
    if cfg.router == "topk_softmax":
        logits = F.linear(h, w["router.weight"], w.get("router.bias"))
        top, ids = torch.topk(logits, k, dim=-1)
        return Routing(ids, torch.softmax(top, dim=-1, dtype=top.dtype))
    if cfg.router == "softmax":
        logits = F.linear(h, w["router.weight"])
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, ids = torch.topk(probs, k, dim=-1)
        if cfg.norm_topk_prob:
            top /= top.sum(dim=-1, keepdim=True)
        return Routing(ids, top.to(_weights_dtype(cfg, h.dtype)))
    logits = F.linear(h.float(), w["router.weight"].float())
    scores = logits.sigmoid()
    choice = scores + w["router.correction"].float()
    groups, experts = cfg.router_groups, cfg.num_experts
    if groups > 1:
        grouped = choice.view(-1, groups, experts // groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        best = torch.topk(group_scores, k=cfg.router_topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, best, 1).bool()
        keep = keep[:, :, None].expand(-1, groups, experts // groups).reshape(-1, experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    top = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        top /= top.sum(dim=-1, keepdim=True) + 1e-20
    return Routing(ids, top * cfg.routed_scaling_factor)


def _route_softmax_groups(cfg: ModelConfig, w: Weights, h: torch.Tensor) -> Routing:
    """DeepSeek-V2's router (the module docstring's softmax_groups)."""
    logits = F.linear(h.float(), w["router.weight"].float())
    probs = logits.softmax(dim=-1)
    groups, experts = cfg.router_groups, cfg.num_experts
    if groups > 1:
        best_in_group = probs.view(-1, groups, experts // groups).max(dim=-1).values
        best = torch.topk(best_in_group, k=cfg.router_topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(best_in_group).scatter_(1, best, 1).bool()
        keep = keep[:, :, None].expand(-1, groups, experts // groups).reshape(-1, experts)
        probs = probs.masked_fill(~keep, 0.0)
    top, ids = torch.topk(probs, k=cfg.experts_per_token, dim=-1, sorted=False)
    return Routing(ids, top * cfg.routed_scaling_factor)


def _weights_dtype(cfg: ModelConfig, dtype: torch.dtype) -> torch.dtype:
    """Mixtral multiplies an expert's output by its float32 weight (then rounds); the
    Qwen models round the weight to the compute dtype first."""
    return torch.float32 if cfg.model_type == "mixtral" else dtype


def expert_rows(routing: Routing) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, its token rows, their weights) of every chosen expert, ascending. One
    host sync: the counts a expert."""
    k = routing.ids.shape[-1]
    flat = routing.ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat).tolist()
    weights = routing.weights.reshape(-1)
    out, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            picks = order[start : start + count]
            out.append((expert, picks // k, weights[picks]))
        start += count
    return out


def _matmul(x: torch.Tensor, weight) -> torch.Tensor:
    if isinstance(weight, Biased):
        out = _matmul(x, weight.weight)
        out += weight.bias
        return out
    if isinstance(weight, MXFP4):  # dequantized on x's device for this matmul
        return F.linear(x, weight.dequantize(x.dtype))
    if isinstance(weight, QTensor):
        nbytes = weight.shape[0] * weight.shape[1] * x.element_size()
        return qlinear(x, weight, None, scratch_bytes=qmatmul.dense_scratch_bytes(nbytes))
    return F.linear(x, weight)


def expert_mlp(x: torch.Tensor, mlp_in, mlp_out, glu: Swiglu = None) -> torch.Tensor:
    """One expert's SwiGLU MLP over rows x [n, hidden] ([gate | up] in mlp_in); glu:
    gpt-oss's clamped SwiGLU instead (`swiglu`)."""

    def run(rows: torch.Tensor) -> torch.Tensor:
        gate_up = _matmul(rows, mlp_in)
        if glu is None:
            act = ops.mlp_activation(gate_up, "silu", gated=True)
        else:
            act = clamped_swiglu(gate_up, *glu)
        return _matmul(act, mlp_out)

    if x.shape[0] <= EXPERT_CHUNK_ROWS:
        return run(x)
    return torch.cat([run(part) for part in x.split(EXPERT_CHUNK_ROWS)])


def clamped_swiglu(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's activation over [gate | up], in transformers' order of operations."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


def expert_weights(w: Weights, expert: int) -> tuple:
    """Expert `expert`'s (mlp_in, mlp_out) from a layer's weights (or a view of one
    expert's): each a tensor or `QTensor`, an `MXFP4` where stored as blocks and scales,
    `Biased` where it has a bias."""
    return tuple(_matrix(w, expert_name(expert, m)) for m in ("mlp_in", "mlp_out"))


def _matrix(w: Weights, name: str):
    base = name.removesuffix(".weight")
    weight = w[name] if name in w else MXFP4(w[base + MXFP4_BLOCKS], w[base + MXFP4_SCALES])
    bias = w.get(base + ".bias")
    return weight if bias is None else Biased(weight, bias)


def apply_expert(
    out: torch.Tensor,
    h: torch.Tensor,
    rows: torch.Tensor,
    weights: torch.Tensor,
    mlp_in,
    mlp_out,
    glu: Swiglu = None,
) -> None:
    """One expert over its rows of h, its weighted outputs added into the block's
    output, EXPERT_CHUNK_ROWS rows at a time: a prefill's expert never holds more than a
    slice's input, intermediate and output. (The rows are distinct: one add each, as
    transformers' index_add_; on the CPU beside the executor's threads index_add_ took
    0.17 s a call on a 2-core machine, this a millisecond.)"""
    for start in range(0, rows.shape[0], EXPERT_CHUNK_ROWS):
        part = rows[start : start + EXPERT_CHUNK_ROWS]
        y = expert_mlp(h[part], mlp_in, mlp_out, glu)
        out[part] += (y * weights[start : start + EXPERT_CHUNK_ROWS, None]).to(out.dtype)


def shared(cfg: ModelConfig, w: Weights, h: torch.Tensor) -> torch.Tensor | None:
    """The shared expert's output over h (gated by its sigmoid where it has a gate);
    None without one."""
    if "shared.mlp_in.weight" not in w:
        return None
    out = expert_mlp(h, w["shared.mlp_in.weight"], w["shared.mlp_out.weight"])
    if "shared.gate.weight" in w:
        out = torch.sigmoid(F.linear(h, w["shared.gate.weight"])) * out
    return out


def post(out: torch.Tensor, shared_out: torch.Tensor | None, residual: torch.Tensor):
    """The block's output: the experts' sum, the shared expert's, then the residual."""
    if shared_out is not None:
        out += shared_out
    return residual + out


def moe_block(
    cfg: ModelConfig, w: Weights, x: torch.Tensor, attn_residual: torch.Tensor
) -> torch.Tensor:
    """The whole block over x [..., hidden] on one device: the layer's output."""
    h, residual = pre(cfg, w, x, attn_residual)
    routing = route(cfg, w, h)
    out = torch.zeros_like(h)
    for expert, rows, weights in expert_rows(routing):
        apply_expert(out, h, rows, weights, *expert_weights(w, expert), swiglu(cfg))
    return post(out, shared(cfg, w, h), residual).view_as(x)
