"""The decoder stack as plain functions of inputs and explicitly handed-in weights.

No function here knows where a weight lives: callers (the plain runner, the offloading
executor) pass a dict of tensors per stage, under the canonical names of `models.shapes`.
Attention over a cache lives in `models.attention`.

A layer is split at its attention so an executor can run `attend` elsewhere (e.g. on
the CPU next to a CPU-resident KV cache): `attn_in` -> `attend` -> `attn_out_and_mlp`.

Tensor parallelism enters through one optional argument, `parallel` (`Parallel`), of
`embed` and `attn_out_and_mlp`: the vocab-parallel lookup and the all-reduce after each
row-parallel matmul. `head` returns the rank's vocabulary slice of the logits; the
caller gathers them (`offload.parallel`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from offload.core.config import OPT_POSITION_OFFSET, ModelConfig
from offload.kernels import qmatmul
from offload.kernels.norm import norm, norm_reference
from offload.kernels.qmatmul import qlinear
from offload.kernels.quant import QTensor, embedding
from offload.models import mla, moe, ops
from offload.models.attention import LayerKV, attend
from offload.models.shapes import Weights, stage_shapes


def _linear(
    cfg: ModelConfig,
    w: Weights,
    name: str,
    x: torch.Tensor,
    relu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x's rows through the named matrix (and bias); relu: then ReLU; residual (x's rows
    by the output width): then added. A compressed matrix's fused kernel does both in
    its epilogue, a dense one's matmul the ReLU (x [N, hidden])."""
    weight, bias = w[f"{name}.weight"], w.get(f"{name}.bias")
    if isinstance(weight, QTensor):
        scratch = dense_scratch_bytes(cfg, x.element_size())
        return qlinear(x, weight, bias, scratch_bytes=scratch, relu=relu, residual=residual)
    out = qmatmul.dense_linear(x, weight, bias, relu) if relu else F.linear(x, weight, bias)
    if residual is not None:
        out += residual
    return out


@functools.cache
def dense_scratch_bytes(cfg: ModelConfig, element_size: int) -> int:
    """Bytes of W a compressed prefill matmul dequantizes at once
    (`qmatmul.dense_scratch_bytes` of the layer's largest matrix)."""
    layers = {0, *cfg.moe_layers[:1]}  # a dense layer's and a mixture of experts'
    shapes = [s for i in layers for s in stage_shapes(cfg, "layer", i).values()]
    largest = max(math.prod(shape) for shape in shapes if len(shape) == 2)
    return qmatmul.dense_scratch_bytes(largest * element_size)


class Parallel(Protocol):
    """Tensor-parallel seam (`offload.parallel.comm.TensorParallel` implements it).

    With it the config's head counts, MLP width and vocabulary are one rank's share;
    `reduce` sums the ranks' partial outputs of a row-parallel matmul (in place), and
    `embed` looks token ids up in the rank's rows of the table and sums over ranks.
    None everywhere below is one device: no collective runs."""

    def reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def embed(self, token_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class StepInputs:
    """What every layer of one forward step shares.

    positions [B, T] are the new tokens' positions; bias [B, 1|heads, T, S] the additive
    attention bias over S cache slots; the new tokens' K/V go to slots
    cache_start .. cache_start + T - 1. rope holds (cos, sin) [B, T, D] or None.
    causal: the bias is the plain causal mask (no padding, no ALiBi, no sliding window
    inside the context): a prefill from slot 0, or a decode step, can run SDPA's flash
    kernel without it (`attend`).
    """

    positions: torch.Tensor
    bias: torch.Tensor
    cache_start: int
    rope: tuple[torch.Tensor, torch.Tensor] | None
    causal: bool = False
    # the windowed layers' bias, rope and causal flag, where they differ from the
    # others' (`ModelConfig.window_layers`; `layer_step` picks)
    local: StepInputs | None = None


def layer_step(cfg: ModelConfig, step: StepInputs, layer: int) -> StepInputs:
    """The step inputs layer `layer` attends with (its window's, where layers differ)."""
    return step.local if step.local is not None and cfg.is_local(layer) else step


def embed(
    cfg: ModelConfig,
    w: Weights,
    token_ids: torch.Tensor,
    positions: torch.Tensor,
    parallel: Parallel | None = None,
):
    """Token ids [B, T] -> hidden states [B, T, hidden]. A table held in host memory
    (the executor's gathered embedding) is read there: only these rows cross; a
    quantized table (a tied model's compressed head) is dequantized after they cross.
    With `parallel` the table is this rank's vocabulary slice (`Parallel.embed`)."""
    table = w["tok.weight"]
    if parallel is None:
        x = embedding(token_ids, table, token_ids.device)
    else:
        x = parallel.embed(token_ids, table)
    if "proj_in.weight" in w:
        x = F.linear(x, w["proj_in.weight"])
    if cfg.record.positions == "learned":
        x = x + F.embedding(positions.clamp(min=0) + OPT_POSITION_OFFSET, w["pos.weight"])
    if cfg.family == "bloom":
        x = norm(x, w["embed_norm.weight"], w["embed_norm.bias"], "layer", cfg.norm_eps)
    if cfg.embed_scale is not None:  # the scale rounded to the dtype first, as Gemma's
        x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
    return x


def _norm(
    cfg: ModelConfig, w: Weights, prefix: str, x: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """The norm `prefix` of x; residual, if given, is first added into x in place."""
    weight, bias = w[f"{prefix}.weight"], w.get(f"{prefix}.bias")
    return norm(x, weight, bias, cfg.norm_kind, cfg.norm_eps, residual)


def attn_in(cfg: ModelConfig, w: Weights, x: torch.Tensor, step: StepInputs):
    """Norm, fused QKV projection and RoPE. Returns q [B,H,T,D], k, v [B,Hkv,T,D], residual.
    Latent attention: its absorbed query and latent entries (`mla.attn_in`)."""
    if cfg.kv_lora_rank:
        return mla.attn_in(cfg, w, x, step)
    batch, num_new, _ = x.shape
    h = _norm(cfg, w, "attn_norm", x) if cfg.do_layer_norm_before else x
    residual = h if cfg.residual_from_norm else x
    qkv = _linear(cfg, w, "qkv", h)
    q_size = cfg.num_heads * cfg.head_dim
    kv_size = cfg.num_kv_heads * cfg.head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(batch, num_new, cfg.num_heads, cfg.head_dim).transpose(1, 2)
    k = k.view(batch, num_new, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
    v = v.view(batch, num_new, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
    if cfg.qk_norm:  # each head's q and k normed over its channels
        q, k = _norm(cfg, w, "q_norm", q), _norm(cfg, w, "k_norm", k)
    if step.rope is not None:
        cos, sin = step.rope
        q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)
    if cfg.query_scale is not None:
        # the attention scales scores by head_dim ** -0.5 (SDPA, the CPU and Triton
        # kernels alike); q takes the ratio to the model's scale, so every path has it
        q = q * (cfg.query_scale * math.sqrt(cfg.head_dim))
    return q, k, v, residual


# Prefill pushes tens of thousands of token rows through the MLP at once; in slices of
# this many rows its intermediate (4-8x the hidden size) stays small on the GPU...
MLP_CHUNK_ROWS = 4096
# ...except up to this many rows of a compressed layer, which go at once: its prefill
# dequantizes the MLP's weights for every call (`qmatmul.DENSE_ROWS`), so a second
# slice dequantizes them again; one slice's intermediate at this size is a small part of
# a compressed plan's prefill transients (docs/throughput.md, "Prefill").
MLP_WHOLE_ROWS = 8192


def mlp_chunks(rows: int, compressed: bool) -> list[int]:
    """The row slices the MLP runs `rows` token rows in (compressed: its weights are)."""
    if rows <= MLP_CHUNK_ROWS or (compressed and rows <= MLP_WHOLE_ROWS):
        return [rows]
    return [min(MLP_CHUNK_ROWS, rows - start) for start in range(0, rows, MLP_CHUNK_ROWS)]


# a layer's matmul calls at decode (one each: decode rows are fewer than a chunk)
LAYER_MATMULS = ("qkv", "o", "mlp_in", "mlp_out")


def attn_out_and_mlp(
    cfg: ModelConfig,
    w: Weights,
    context: torch.Tensor,
    residual: torch.Tensor,
    parallel: Parallel | None = None,
) -> torch.Tensor:
    """Output projection, residual, MLP block. Returns the layer's output hidden states."""
    return mlp_block(cfg, w, attn_out(cfg, w, context, parallel), residual, parallel)


def attn_out(
    cfg: ModelConfig, w: Weights, context: torch.Tensor, parallel: Parallel | None = None
) -> torch.Tensor:
    """The attention's output projection (the caller may then drop the context); a
    latent context goes through each head's value projection first (`mla.values_out`)."""
    if cfg.kv_lora_rank:
        context = mla.values_out(cfg, w, context)
    x = _linear(cfg, w, "o", context)
    return x if parallel is None else parallel.reduce(x)


def mlp_block(
    cfg: ModelConfig,
    w: Weights,
    x: torch.Tensor,
    residual: torch.Tensor,
    parallel: Parallel | None = None,
) -> torch.Tensor:
    """The attention's residual and the MLP block over the projected attention output x;
    the layer's output hidden states. Its rows go in `mlp_chunks`; a mixture of
    experts' layer runs `moe.moe_block` instead."""
    if cfg.sandwich_norms:  # the attention's output normed before the residual joins
        x = _norm(cfg, w, "post_attn_norm", x)
    if moe.is_moe(w):
        assert parallel is None, "tensor parallelism does not split experts"
        return moe.moe_block(cfg, w, x, residual)
    if not cfg.do_layer_norm_before:
        x = _norm(cfg, w, "attn_norm", x, residual)
        residual = None  # added by the norm
    rows = x.reshape(-1, x.shape[-1])
    res = None if residual is None else residual.reshape(-1, x.shape[-1])
    chunks = mlp_chunks(rows.shape[0], isinstance(w["mlp_in.weight"], QTensor))
    if len(chunks) == 1:
        return _mlp(cfg, w, rows, parallel, res).view_as(x)
    out = torch.empty_like(rows)
    start = 0
    for size in chunks:
        part = slice(start, start + size)
        out[part] = _mlp(cfg, w, rows[part], parallel, None if res is None else res[part])
        start += size
    return out.view_as(x)


def _mlp(
    cfg: ModelConfig,
    w: Weights,
    x: torch.Tensor,
    parallel: Parallel | None = None,
    attn_residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MLP with its residual (and OPT's post-norm) over token rows x [N, hidden].

    attn_residual (pre-norm models): the attention block's residual, not yet added to
    x; the norm adds it into x in place, in the same kernel (`kernels.norm`). A parallel
    layer (Falcon) has its MLP read that residual, the layer's input, and adds the
    attention's output x and the input to the MLP's, in transformers' order."""
    if cfg.parallel_attn:
        assert attn_residual is not None
        h = _norm(cfg, w, "mlp_norm" if cfg.has_mlp_norm else "attn_norm", attn_residual)
        out = _mlp_out(cfg, w, h, parallel)
        out += x
        out += attn_residual
        return out
    h = _norm(cfg, w, "mlp_norm", x, attn_residual) if cfg.do_layer_norm_before else x
    residual = h if cfg.residual_from_norm else x
    if cfg.sandwich_norms:  # the MLP's output normed before the residual joins
        out = _norm(cfg, w, "post_mlp_norm", _mlp_out(cfg, w, h, parallel))
        out += residual
        return out
    out = _mlp_out(cfg, w, h, parallel, residual)
    if not cfg.do_layer_norm_before:
        out = _norm(cfg, w, "mlp_norm", out)
    return out


def _mlp_out(
    cfg: ModelConfig,
    w: Weights,
    h: torch.Tensor,
    parallel: Parallel | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MLP's projections of normed rows h, with the residual added where given."""
    if cfg.activation == "relu" and not cfg.gated_mlp:
        act = _linear(cfg, w, "mlp_in", h, relu=True)
    else:
        act = ops.mlp_activation(_linear(cfg, w, "mlp_in", h), cfg.activation, cfg.gated_mlp)
    if parallel is None:
        return _linear(cfg, w, "mlp_out", act, residual=residual)
    out = parallel.reduce(_linear(cfg, w, "mlp_out", act))  # the ranks' summed outputs
    if residual is not None:
        out += residual
    return out


def head(cfg: ModelConfig, w: Weights, x: torch.Tensor) -> torch.Tensor:
    """Final norm and LM head: hidden [B, T, hidden] -> fp32 logits [B, T, V]."""
    if "final_norm.weight" in w:
        x = _norm(cfg, w, "final_norm", x)
    if "proj_out.weight" in w:
        x = F.linear(x, w["proj_out.weight"])
    logits = _linear(cfg, w, "lm_head", x)
    if cfg.final_softcap is not None:  # in the model's dtype, as transformers does
        logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
    return logits.float()


def warm_kernels(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
    """Launch, on a few rows at the model's widths, what a process pays for at its first
    prefill whatever the plan: the Triton runtime's start (its driver, the key of its
    cache: most of a second), the norm kernel's compile or cache load at this width,
    with and without a residual, the plain layer norm's first launch (the head's strided
    last rows take it), cuBLAS's handle and SDPA's flash kernel. No weights are read.
    Without it a streamed plan's first prefill pays all of these (docs/executor.md)."""
    hidden = cfg.hidden_size
    x = torch.zeros(2, hidden, dtype=dtype, device=device)
    weight = torch.ones(hidden, dtype=dtype, device=device)
    bias = torch.zeros_like(weight) if cfg.norm_kind == "layer" else None
    for residual in (None, torch.zeros_like(x)):
        norm(x, weight, bias, cfg.norm_kind, cfg.norm_eps, residual)
    norm_reference(x, weight, bias, cfg.norm_kind, cfg.norm_eps)
    F.linear(x, torch.zeros(16, hidden, dtype=dtype, device=device))
    heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = torch.zeros(1, heads, 16, dim, dtype=dtype, device=device)
    kv = torch.zeros(1, kv_heads, 16, dim, dtype=dtype, device=device)
    attend(q, kv, kv, torch.zeros(1, 1, 16, 16, dtype=dtype, device=device), causal=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def layer_forward(
    cfg: ModelConfig, w: Weights, x: torch.Tensor, step: StepInputs, kv: LayerKV
) -> torch.Tensor:
    """One decoder layer with its KV cache on the same device as x (step: this layer's,
    `layer_step`)."""
    q, k, v, residual = attn_in(cfg, w, x, step)
    context = kv.attention(q, k, v, step.bias, step.cache_start, step.causal, sinks=w.get("sinks"))
    return attn_out_and_mlp(cfg, w, context, residual)
