"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight) as functions of
inputs and weights, and its cache (`LatentKV`).

A token's keys and values are one compressed latent c (`kv_lora_rank` R wide, RMS-
normed) and one RoPE key k_pe (`qk_rope_head_dim` P wide) shared by every head; head
h's no-RoPE key is W_UK[h] c and its value W_UV[h] c (kv_b's rows). The cache holds
[c | k_pe] a token and layer: R + P values (576 for DeepSeek-V3, against 2 x 128 x 128
= 32768 for K and V of its 128 heads).

Attention runs in the absorbed form at every step: head h's query's no-RoPE part q_n
is folded through W_UK[h] (q_n W_UK[h]: R wide) beside its RoPE part q_pe, so that

    score(h, s) = [q_n W_UK[h] | q_pe] . [c_s | k_pe_s]
    context(h)  = sum_s p(h, s) c_s,   output(h) = W_UV[h] context(h)

is multi-query attention with one "KV head" of R + P channels whose values are its
first R channels, over the cache as it is: no key or value is ever expanded per head.
The output projection then takes each head's context through W_UV[h] (`values_out`).
The products are the same as transformers' expanded form (scores q . k with k =
[W_UK c | k_pe], outputs p (W_UV c)) in another association, so float32 logits agree
within rounding.

RoPE turns the P channels in DeepSeek's interleaved layout (pairs (x0, x1), (x2, x3)
each by one frequency; outputs the pairs' first elements, then their second, as
transformers' `apply_rotary_pos_emb_interleave`): q and k are permuted alike, so their
products are those of DeepSeek-V2's complex rotation too (which transformers computes
in float32; here, as DeepSeek-V3's, in the compute dtype). The softmax scale is
(N + P) ** -0.5 (N = qk_nope_head_dim) times YaRN's mscale(mscale_all_dim) squared.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from offload.core.config import ModelConfig
from offload.core.mla_config import yarn_mscale
from offload.kernels import qmatmul
from offload.kernels.norm import norm
from offload.kernels.qmatmul import qlinear
from offload.kernels.quant import QTensor
from offload.models.shapes import Weights

# as `attention.SDPA_BACKENDS` (not cuDNN); no flash kernel takes R + P = 576 channels
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def softmax_scale(cfg: ModelConfig) -> float:
    """The scores' scale: (N + P) ** -0.5, times mscale(factor, mscale_all_dim) squared
    under YaRN (transformers' `yarn_apply_mscale`)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    rope = cfg.rope_scaling
    if rope.rope_type == "yarn" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


def _matmul(x: torch.Tensor, weight: torch.Tensor | QTensor) -> torch.Tensor:
    if isinstance(weight, QTensor):
        nbytes = weight.shape[0] * weight.shape[1] * x.element_size()
        return qlinear(x, weight, None, scratch_bytes=qmatmul.dense_scratch_bytes(nbytes))
    return F.linear(x, weight)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, P] turned pair by pair; cos, sin [B, T, P] (`ops.rope_cos_sin`:
    each frequency twice, the first half read)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :, :half], sin[:, None, :, :half]
    first, second = x[..., 0::2], x[..., 1::2]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def _kv_b(cfg: ModelConfig, w: Weights) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b's per-head W_UK [H, N, R] and W_UV [H, V, R] (views)."""
    per_head = w["kv_b.weight"].view(cfg.num_heads, -1, cfg.kv_lora_rank)
    return per_head[:, : cfg.qk_nope_head_dim], per_head[:, cfg.qk_nope_head_dim :]


def attn_in(cfg: ModelConfig, w: Weights, x: torch.Tensor, step):
    """Norm, the query's and the latent's projections, RoPE, and the query absorbed
    through W_UK. Returns q [B, H, T, R + P], the new cache entries [B, 1, T, R + P],
    their values (a view of the entries' first R channels) and the residual
    (`decoder.attn_in`'s contract, one KV head)."""
    batch, num_new, _ = x.shape
    heads, nope, rope, rank = (
        cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    )  # fmt: skip
    h = norm(x, w["attn_norm.weight"], None, "rms", cfg.norm_eps)
    fused = _matmul(h, w["qkv.weight"])
    q, latent = fused.split([fused.shape[-1] - rank - rope, rank + rope], dim=-1)
    if cfg.q_lora_rank:
        q = norm(q.contiguous(), w["q_a_norm.weight"], None, "rms", cfg.norm_eps)
        q = _matmul(q, w["q_b.weight"])
    q = q.view(batch, num_new, heads, nope + rope).transpose(1, 2)
    q_nope, q_pe = q.split([nope, rope], dim=-1)
    c, k_pe = latent.split([rank, rope], dim=-1)
    c = norm(c.contiguous(), w["kv_a_norm.weight"], None, "rms", cfg.norm_eps)
    k_pe = k_pe[:, None]
    if step.rope is not None:
        cos, sin = step.rope
        q_pe, k_pe = rope_interleaved(q_pe, cos, sin), rope_interleaved(k_pe, cos, sin)
    w_uk, _ = _kv_b(cfg, w)
    q_latent = torch.matmul(q_nope, w_uk)  # [B, H, T, N] x [H, N, R]
    query = torch.cat((q_latent, q_pe), dim=-1)
    entries = torch.cat((c[:, None], k_pe), dim=-1)
    return query, entries, entries[..., :rank], x


def values_out(cfg: ModelConfig, w: Weights, context: torch.Tensor) -> torch.Tensor:
    """Each head's latent context [B, T, H * R] through its W_UV: [B, T, H * V], the
    output projection's input."""
    batch, num_new, _ = context.shape
    _, w_uv = _kv_b(cfg, w)
    per_head = context.reshape(batch, num_new, cfg.num_heads, cfg.kv_lora_rank).transpose(1, 2)
    out = torch.matmul(per_head, w_uv.transpose(1, 2))  # [B, H, T, R] x [H, R, V]
    return out.transpose(1, 2).reshape(batch, num_new, cfg.num_heads * cfg.v_head_dim)


def latent_attend(
    q: torch.Tensor,
    entries: torch.Tensor,
    rank: int,
    bias: torch.Tensor,
    scale: float,
    causal: bool = False,
) -> torch.Tensor:
    """Absorbed queries q [B, H, T, R + P] over latent entries [B, 1, S, R + P] whose
    values are their first R channels: the contexts [B, T, H * R].

    A decode step's heads are the rows of one attention over the latent (the bias
    [B, 1, 1, S] is every head's); a prefill from slot 0 runs causally without the
    bias where `StepInputs.causal`, else with it, the latent shared by every head."""
    batch, heads, num_new, _ = q.shape
    values = entries[..., :rank]
    with sdpa_kernel(SDPA_BACKENDS):
        if num_new == 1:
            rows = q.reshape(batch, 1, heads, q.shape[-1])
            out = F.scaled_dot_product_attention(rows, entries, values, bias, scale=scale)
            return out.reshape(batch, 1, heads * rank)
        fresh = causal and entries.shape[2] == num_new
        out = F.scaled_dot_product_attention(
            q, entries, values, None if fresh else bias, is_causal=fresh, scale=scale,
            enable_gqa=True,
        )  # fmt: skip
    return out.transpose(1, 2).reshape(batch, num_new, heads * rank)


class LatentKV:
    """One layer's latent cache for a batch on one device: [B, 1, max_slots, R + P]
    (`attention.LayerKV` holds one for a latent-attention model)."""

    def __init__(
        self, batch: int, cfg: ModelConfig, max_slots: int, dtype: torch.dtype, device
    ) -> None:
        self.rank, self.scale = cfg.kv_lora_rank, softmax_scale(cfg)
        shape = (batch, 1, max_slots, cfg.kv_entry_width)
        self.entries = torch.empty(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.entries.numel() * self.entries.element_size()

    def attention(
        self, q: torch.Tensor, entries: torch.Tensor, bias: torch.Tensor, start: int,
        causal: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """Store the new entries at slots start.. and attend q over the cache."""
        end = start + entries.shape[2]
        self.entries[:, :, start:end] = entries
        cached = entries if start == 0 else self.entries[:, :, :end]
        return latent_attend(q, cached, self.rank, bias, self.scale, causal)


def attention_elements(cfg: ModelConfig, rows: int, new: int, slots: int) -> int:
    """Elements the attention half of a latent-attention layer holds at its peak over
    `rows` sequences of `new` new tokens attending `slots` slots (`attn_in` and
    `latent_attend`): the norm, the fused projection, the query before and after its
    absorption (its parts, the latent query and their cat), the entries, and the
    scores and probabilities in float32 (two elements each) with the latent expanded
    to every head where SDPA's kernel cannot read it shared, and the context."""
    heads, width = cfg.num_heads, cfg.kv_entry_width
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    tokens = rows * new
    q_in = cfg.q_lora_rank or heads * qk
    held = tokens * (cfg.hidden_size + q_in + width + cfg.q_lora_rank + 2 * heads * qk)
    held += tokens * (2 * heads * width + width)
    scores = rows * heads * new * slots * 2 * 2
    expanded = rows * heads * slots * (width + cfg.kv_lora_rank) if new > 1 else 0
    return held + scores + expanded + tokens * heads * cfg.kv_lora_rank
