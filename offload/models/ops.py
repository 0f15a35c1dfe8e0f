"""Plain-torch building blocks of the decoder: norms, activations, RoPE, ALiBi, masks.

Each matches the Hugging Face transformers implementation of the same family
operation for operation (including where it computes in fp32), so logits agree
within fp32 rounding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from offload.core.config import ModelConfig, alibi_slopes


def mlp_activation(x: torch.Tensor, kind: str, gated: bool) -> torch.Tensor:
    """Apply the MLP nonlinearity; a gated input holds [gate | up] along the last dim.
    (ReLU runs in the matmul's epilogue: `decoder._mlp`.)

    x is a temporary the caller no longer needs (it may be overwritten)."""
    if gated:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
    if kind == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    raise AssertionError(f"unknown activation {kind}")


def rope_inv_freq(cfg: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    dim = cfg.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    scaling = cfg.rope_scaling
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        old_ctx = scaling.original_max_position_embeddings
        low_wavelen = old_ctx / scaling.low_freq_factor
        high_wavelen = old_ctx / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [B, T, rotary_dim] for integer positions [B, T]."""
    freqs = positions.to(inv_freq.device).float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, T, D] (half-split convention, as Hugging Face Llama); with
    tables narrower than D (partial RoPE: GLM-4.5), its first channels, the rest as they
    are."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    # x * cos + rotated * sin, the same roundings, holding two x-sized temporaries (four
    # out of place: a prefill's largest layer working set, `memory._layer_transient`)
    rotated *= sin
    out = x * cos
    out += rotated
    return out


def attention_bias(
    cfg: ModelConfig,
    key_valid: torch.Tensor,
    key_pos: torch.Tensor,
    query_pos: torch.Tensor,
    cache_start: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Additive attention bias [B, 1 or heads, T, S] for T new tokens over S cache slots.

    key_valid [B, S] marks real (non-padding) slots; key_pos [B, S] and query_pos [B, T]
    are token positions. Slots are causal by index (new token t sits in slot
    cache_start + t). A query always sees its own slot, so padding rows stay finite.
    ALiBi (BLOOM) adds slope * key position, as Hugging Face does; softmax is
    invariant to the per-row constant that separates it from slope * distance.
    """
    num_new, num_slots = query_pos.shape[1], key_valid.shape[1]
    device = key_valid.device
    query_slot = torch.arange(num_new, device=device)[:, None] + cache_start
    key_slot = torch.arange(num_slots, device=device)[None, :]
    allowed = (key_slot <= query_slot)[None] & key_valid[:, None, :]
    if cfg.sliding_window is not None:
        distance = query_pos[:, :, None] - key_pos[:, None, :]
        allowed &= distance < cfg.sliding_window
    allowed |= (key_slot == query_slot)[None]
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device)
    bias.masked_fill_(~allowed, torch.finfo(dtype).min)
    bias = bias[:, None]
    if cfg.family == "bloom":
        slopes = torch.tensor(alibi_slopes(cfg.num_heads), dtype=torch.float32, device=device)
        alibi = slopes[None, :, None, None] * key_pos[:, None, None, :].float()
        bias = bias + alibi.to(dtype)
    return bias
