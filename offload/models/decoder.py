"""The decoder stack as plain functions of inputs and explicitly handed-in weights.

No function here knows where a weight lives: callers (the plain runner, later the
offloading executor) pass a dict of tensors per stage. Canonical weight names:

    embed stage:  tok.weight [V, E]; pos.weight [P, hidden] (OPT);
                  embed_norm.weight/.bias (BLOOM); proj_in.weight [hidden, E] (OPT-350m)
    layer i:      attn_norm.weight(/.bias); qkv.weight [(H + 2*Hkv)*D, hidden](/.bias);
                  o.weight [hidden, H*D](/.bias); mlp_norm.weight(/.bias);
                  mlp_in.weight [I or 2*I (gate | up), hidden](/.bias);
                  mlp_out.weight [hidden, I](/.bias)
    head stage:   final_norm.weight(/.bias) (absent for OPT-350m);
                  proj_out.weight [E, hidden] (OPT-350m); lm_head.weight [V, E]
                  (for tied embeddings a source hands out tok.weight under this name,
                  and the executor's embedding reads its rows from it: `io.layout`)

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
from torch.nn.attention import SDPBackend, sdpa_kernel

from offload.core.config import OPT_POSITION_OFFSET, ModelConfig
from offload.kernels import qmatmul
from offload.kernels.cpu_attention import decode_attention_dense
from offload.kernels.formats import Compression
from offload.kernels.kv_attention import decode_attention
from offload.kernels.kv_cache import QuantKV
from offload.kernels.norm import norm, norm_reference
from offload.kernels.qmatmul import qlinear
from offload.kernels.quant import QTensor, embedding
from offload.models import ops

# A quantized layer matrix arrives as a `QTensor` (compressed weights); `_linear` runs
# it through the dequantize-and-multiply kernel.
Weights = dict[str, torch.Tensor | QTensor]


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
    shapes = stage_shapes(cfg, "layer").values()
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
    if cfg.has_qkv_bias:
        shapes["qkv.bias"] = (cfg.qkv_out_features,)
    if cfg.has_linear_bias:
        shapes.update({"o.bias": (hidden,), "mlp_in.bias": (mlp_in,), "mlp_out.bias": (hidden,)})
    return shapes


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
    if cfg.family == "opt":
        x = x + F.embedding(positions.clamp(min=0) + OPT_POSITION_OFFSET, w["pos.weight"])
    if cfg.family == "bloom":
        x = norm(x, w["embed_norm.weight"], w["embed_norm.bias"], "layer", cfg.norm_eps)
    return x


def _norm(
    cfg: ModelConfig, w: Weights, prefix: str, x: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """The norm `prefix` of x; residual, if given, is first added into x in place."""
    weight, bias = w[f"{prefix}.weight"], w.get(f"{prefix}.bias")
    return norm(x, weight, bias, cfg.norm_kind, cfg.norm_eps, residual)


def attn_in(cfg: ModelConfig, w: Weights, x: torch.Tensor, step: StepInputs):
    """Norm, fused QKV projection and RoPE. Returns q [B,H,T,D], k, v [B,Hkv,T,D], residual."""
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
    if step.rope is not None:
        cos, sin = step.rope
        q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)
    return q, k, v, residual


# Not cuDNN: with a bias over a cache that grows every decode step it spends about 8 ms
# of host time per call (profiled on the H100: 92% of a decode step's CPU time).
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    causal: bool = False,
):
    """Scaled dot-product attention of q [B,H,T,D] over keys/values [B,Hkv,S,D].

    Returns [B, T, H*D]. Grouped-query heads share KV heads. causal (`StepInputs`): the
    bias is the plain causal mask. Then SDPA runs its flash kernel without the bias,
    with grouped-query heads read in place:
    - where the keys are the T new tokens (a prefill), causally: half the scores. With
      a bias, the memory-efficient kernel computes every score: 0.80 ms a layer against
      the matmuls' 9.9 for W1c's prefill (12 x 512 tokens, H100);
    - for one new token on the GPU (a decode step), over every slot.
    """
    batch, heads, num_new, dim = q.shape
    kv_heads = keys.shape[1]
    fresh = num_new > 1 and keys.shape[2] == num_new
    if causal and (fresh or (num_new == 1 and q.is_cuda)):
        with sdpa_kernel(SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(
                q, keys, values, is_causal=fresh, enable_gqa=kv_heads != heads
            )
        return out.transpose(1, 2).reshape(batch, num_new, heads * dim)
    if num_new == 1 and q.device.type == "cpu":
        # decode on the CPU (the executor's CPU attention, the plain CPU run): the C
        # kernel reads each K/V byte once on every core, grouped-query heads together
        # (2x SDPA at the profile's shape, 1.4x at Llama-2-70B's: docs/cpu_attention.md);
        # None where it does not run
        out = decode_attention_dense(q, keys, values, bias)
        if out is not None:
            return out
    if kv_heads != heads and num_new == 1 and bias.shape[1] == 1:
        # decode with grouped-query heads: the query heads of one KV head become rows of
        # one attention over it (same math; SDPA's own GQA path copies K/V per query
        # head, 4-9x slower on the CPU where the executor's CPU attention runs)
        grouped = q.view(batch, kv_heads, heads // kv_heads, dim)
        with sdpa_kernel(SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=bias)
        return out.reshape(batch, 1, heads * dim)
    if kv_heads != heads:
        # prefill with grouped-query heads: SDPA's own GQA path runs in the flash backend
        # only, which takes no mask; with one it falls back to the math backend and holds
        # fp32 scores [B, H, T, S] (Llama-3.1-8B, 192 x 512 prompt rows: 28.5 GB peak under
        # a 10 GB cap, H100 run validate_cost_model 223254). K/V expanded to every query
        # head keep the memory-efficient backend (`policies.memory` counts them).
        group = heads // kv_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    with sdpa_kernel(SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias)
    return out.transpose(1, 2).reshape(batch, num_new, heads * dim)


# Prefill pushes tens of thousands of token rows through the MLP at once; in slices of
# this many rows its intermediate (4-8x the hidden size) stays small on the GPU...
MLP_CHUNK_ROWS = 4096
# ...except up to this many rows of a compressed layer, which go at once: its prefill
# dequantizes the MLP's weights for every call (`qmatmul.DENSE_ROWS`), so a second
# slice dequantizes them again. W1c (OPT-30B int4, 14 x 512 rows): 0.42 ms and a 0.07 ms
# copy of a 14 ms prefill layer (H100, trace_plan --kernels).
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
    """The attention's output projection (the caller may then drop the context)."""
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
    the layer's output hidden states. Its rows go in `mlp_chunks`."""
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
    x; the norm adds it into x in place, in the same kernel (`kernels.norm`)."""
    h = _norm(cfg, w, "mlp_norm", x, attn_residual) if cfg.do_layer_norm_before else x
    residual = h if cfg.residual_from_norm else x
    if cfg.activation == "relu" and not cfg.gated_mlp:
        act = _linear(cfg, w, "mlp_in", h, relu=True)
    else:
        act = ops.mlp_activation(_linear(cfg, w, "mlp_in", h), cfg.activation, cfg.gated_mlp)
    if parallel is None:
        out = _linear(cfg, w, "mlp_out", act, residual=residual)
    else:  # the residual joins the ranks' summed outputs
        out = parallel.reduce(_linear(cfg, w, "mlp_out", act))
        out += residual
    if not cfg.do_layer_norm_before:
        out = _norm(cfg, w, "mlp_norm", out)
    return out


def head(cfg: ModelConfig, w: Weights, x: torch.Tensor) -> torch.Tensor:
    """Final norm and LM head: hidden [B, T, hidden] -> fp32 logits [B, T, V]."""
    if "final_norm.weight" in w:
        x = _norm(cfg, w, "final_norm", x)
    if "proj_out.weight" in w:
        x = F.linear(x, w["proj_out.weight"])
    return _linear(cfg, w, "lm_head", x).float()


def warm_kernels(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
    """Launch, on a few rows at the model's widths, what a process pays for at its first
    prefill whatever the plan: the Triton runtime's start (its driver, the key of its
    cache: 0.4-0.7 s on the H200 machine, c106), the norm kernel's compile or cache load at
    this width, with and without a residual, the plain layer norm's first launch (the
    head's strided last rows take it), cuBLAS's handle and SDPA's flash kernel. No
    weights are read. Without it a streamed plan's first prefill took 1.0-1.2 s more
    than its warm one (c106, c108)."""
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


class LayerKV:
    """One layer's KV cache for a batch on one device: k, v [B, Hkv, max_slots, D], or
    with `compression` a `kernels.kv_cache.QuantKV` (read by the quantized decode
    attention kernel)."""

    def __init__(
        self,
        batch: int,
        cfg: ModelConfig,
        max_slots: int,
        dtype,
        device,
        compression: Compression | None = None,
    ) -> None:
        self.quant: QuantKV | None = None
        if compression is not None:
            self.quant = QuantKV(
                batch, cfg.num_kv_heads, cfg.head_dim, max_slots, compression, dtype, device
            )
            return
        shape = (batch, cfg.num_kv_heads, max_slots, cfg.head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        if self.quant is not None:
            return self.quant.nbytes
        return 2 * self.k.numel() * self.k.element_size()

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor,
        start: int,
        causal: bool = False,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store the new entries k, v at slots start.. and attend q over the cache
        (a compressed one: `quant_attention`); causal as `attend`'s. out: a buffer the
        decode attention over a compressed cache writes into (others return their own)."""
        end = start + k.shape[2]
        if self.quant is not None:
            return quant_attention(self.quant, q, k, v, bias, start, causal, out)
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return attend(q, self.k[:, :, :end], self.v[:, :, :end], bias, causal)


def quant_attention(
    cache: QuantKV,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias,
    start: int,
    causal: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store k, v in the compressed cache at slots start.. and attend q: a prefill
    (start 0) over its fresh entries at full precision, a decode step over the cache
    (into out where given)."""
    cache.write(k, v, start)
    if start == 0:
        return attend(q, k, v, bias, causal)
    end = start + k.shape[2]
    if q.shape[2] == 1:
        return decode_attention(q, cache, bias, end, out=out)
    return attend(q, *cache.dequantized(end), bias)


def layer_forward(
    cfg: ModelConfig, w: Weights, x: torch.Tensor, step: StepInputs, kv: LayerKV
) -> torch.Tensor:
    """One decoder layer with its KV cache on the same device as x."""
    q, k, v, residual = attn_in(cfg, w, x, step)
    context = kv.attention(q, k, v, step.bias, step.cache_start, step.causal)
    return attn_out_and_mlp(cfg, w, context, residual)
