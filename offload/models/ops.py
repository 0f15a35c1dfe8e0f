"""Plain-torch building blocks of the decoder: norms, activations, RoPE, ALiBi, masks.

Each matches the Hugging Face transformers implementation of the same family
operation for operation (including where it computes in fp32), so logits agree
within fp32 rounding.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from offload.core.config import ModelConfig
from offload.models import yarn

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}


def mlp_activation(x: torch.Tensor, kind: str, gated: bool) -> torch.Tensor:
    """Apply the MLP nonlinearity; a gated input holds [gate | up] along the last dim
    and the activation applies to the gate. (ReLU runs in the matmul's epilogue:
    `decoder._mlp`.)

    x is a temporary the caller no longer needs (it may be overwritten)."""
    if gated:
        gate, up = x.chunk(2, dim=-1)
        return ACTIVATIONS[kind](gate).mul_(up)
    return ACTIVATIONS[kind](x)


@dataclass(frozen=True)
class Rotary:
    """A model's RoPE: cos and sin tables of positions over a head's first `dim`
    channels. LongRoPE (Phi-3) takes `long_inv_freq` for a step whose positions reach
    past `original_max` (transformers switches on the step's largest position, as here),
    and scales cos and sin by `attention_factor`. `local`: the windowed layers' own
    RoPE, where it differs (Gemma 3's local layers: another base, no scaling)."""

    inv_freq: torch.Tensor
    long_inv_freq: torch.Tensor | None = None
    original_max: int = 0
    attention_factor: float = 1.0
    local: Rotary | None = None

    @classmethod
    def of(cls, cfg: ModelConfig, device: torch.device | None = None) -> Rotary | None:
        """The model's RoPE (None where it has none)."""
        if not cfg.rotary:
            return None
        scaling = cfg.rope_scaling
        local = None
        if cfg.local_rope_theta is not None:
            local = cls(_inv_freq(cfg.rotary_dim, cfg.local_rope_theta, device))
        if scaling.rope_type == "yarn":
            freqs = yarn.inv_freq(cfg.rotary_dim, cfg.rope_theta, scaling, device)
            return cls(freqs, attention_factor=yarn.attention_factor(scaling), local=local)
        if scaling.rope_type != "longrope":
            return cls(rope_inv_freq(cfg, device), local=local)
        factor = scaling.attention_factor
        if factor is None:
            original = scaling.original_max_position_embeddings
            factor = 1.0
            if scaling.factor > 1.0:
                factor = math.sqrt(1 + math.log(scaling.factor) / math.log(original))
        short, long = (
            _inv_freq(cfg.rotary_dim, cfg.rope_theta, device, factors)
            for factors in (scaling.short_factor, scaling.long_factor)
        )
        return cls(short, long, scaling.original_max_position_embeddings, factor, local)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, longest: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, T, dim] for positions [B, T]; longest: the step's largest
        position + 1 (known on the host: no device sync)."""
        inv_freq = self.inv_freq
        if self.long_inv_freq is not None and longest > self.original_max:
            inv_freq = self.long_inv_freq
        return rope_cos_sin(inv_freq, positions, dtype, self.attention_factor)


def _inv_freq(
    dim: int, theta: float, device: torch.device | None, factors: tuple[float, ...] = ()
) -> torch.Tensor:
    """1 / theta^(2i / dim), or LongRoPE's 1 / (factor_i * theta^(2i / dim))."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    if not factors:
        return 1.0 / (theta**exponents)
    ext = torch.tensor(factors, dtype=torch.float32, device=device)
    return 1.0 / (ext * theta**exponents)


def rope_inv_freq(cfg: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    inv_freq = _inv_freq(cfg.rotary_dim, cfg.rope_theta, device)
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
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [B, T, rotary dim] for integer positions [B, T], times factor
    (LongRoPE's attention factor) in float32 before the cast, as transformers does."""
    freqs = positions.to(inv_freq.device).float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, T, D] (half-split convention, as Hugging Face Llama); where
    the tables are narrower than D (partial rotary: Phi-4-mini) only the first
    channels turn and the rest pass through."""
    cos, sin = cos[:, None], sin[:, None]
    if cos.shape[-1] < x.shape[-1]:
        turned = apply_rope(x[..., : cos.shape[-1]], cos[:, 0], sin[:, 0])
        return torch.cat((turned, x[..., cos.shape[-1] :]), dim=-1)
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
    local: bool = False,
) -> torch.Tensor:
    """Additive attention bias [B, 1 or heads, T, S] for T new tokens over S cache slots;
    local: for the windowed layers where layers differ (`ModelConfig.window_of`).

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
    window = cfg.window_of(local)
    if window is not None:
        distance = query_pos[:, :, None] - key_pos[:, None, :]
        allowed &= distance < window
    allowed |= (key_slot == query_slot)[None]
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device)
    bias.masked_fill_(~allowed, torch.finfo(dtype).min)
    bias = bias[:, None]
    if cfg.record.positions == "alibi":
        slopes = torch.tensor(alibi_slopes(cfg.num_heads), dtype=torch.float32, device=device)
        alibi = slopes[None, :, None, None] * key_pos[:, None, None, :].float()
        bias = bias + alibi.to(dtype)
    return bias


def alibi_slopes(num_heads: int) -> list[float]:
    """BLOOM's per-head ALiBi slopes (geometric, with the non-power-of-two extension)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2 ** (-(2 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra_base = 2 ** (-(2 ** -(math.log2(2 * closest) - 3)))
        extra = [extra_base ** (2 * i + 1) for i in range(num_heads - closest)]
        slopes += extra
    return slopes
