"""YaRN RoPE scaling as transformers computes it (`_compute_yarn_parameters`): the
inverse frequencies blend the interpolated (divided by `factor`) and the extrapolated
(plain) ones with a linear ramp between the dimensions that turn `beta_fast` and
`beta_slow` times over the original context, and cos and sin are scaled by an
attention factor. Latent attention also scales its softmax by mscale(mscale_all_dim)
squared (`models.mla.softmax_scale`)."""

from __future__ import annotations

import math

import torch

from offload.core.config import RopeScaling
from offload.core.mla_config import yarn_mscale


def attention_factor(scaling: RopeScaling) -> float:
    """cos and sin's scale: the config's, else mscale / mscale_all_dim's ratio where
    both are set, else the plain mscale of the factor."""
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(
            scaling.factor, scaling.mscale_all_dim
        )
    return yarn_mscale(scaling.factor)


def inv_freq(
    dim: int, theta: float, scaling: RopeScaling, device: torch.device | None = None
) -> torch.Tensor:
    """YaRN's inverse frequencies over `dim` rotary channels."""
    original = scaling.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)
    extrapolation = (1 - ramp.clamp(0, 1)).to(device)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (scaling.factor * pos_freqs)
    return interpolated * (1 - extrapolation) + extrapolated * extrapolation
