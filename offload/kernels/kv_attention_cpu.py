"""Decode attention over a compressed KV cache on the CPU (the format is in `kv_cache.py`).

`decode_attention_cpu` computes what `kv_attention.decode_attention_reference` defines
(dequantize, then SDPA) without dequantizing the cache at full size in the compute
dtype. `kv_attention.decode_attention` calls it wherever the Triton kernels do not
run: the executor's CPU attention, and the plain run without CUDA.
"""

from __future__ import annotations

import math

import torch

from offload.kernels.formats import Compression
from offload.kernels.kv_cache import QuantKV

# sequences x KV heads x slots a chunk of `decode_attention_cpu` takes: its float32
# codes (4 bytes a value) stay in the caches of a few cores
CPU_CHUNK_VALUES = 1 << 21


def decode_attention_cpu(
    q: torch.Tensor, cache: QuantKV, bias: torch.Tensor, end: int
) -> torch.Tensor:
    """`decode_attention` without CUDA (the executor's CPU attention, the plain run), a
    few sequences at a time: their codes are dequantized in float32 in place, one nibble
    plane at a time (int4: even and odd tokens of a key group, even and odd channels of
    a value), so nothing is interleaved at full size; only scores and outputs are."""
    batch, heads, _, dim = q.shape
    kv_heads = cache.k_codes.shape[1]
    rows = max(1, CPU_CHUNK_VALUES // (kv_heads * max(end, 1) * dim))
    bias = bias[..., :end].expand(batch, heads, 1, end)
    return torch.cat(
        [
            _decode_attention_rows(q[r : r + rows], cache, bias[r : r + rows], end, r)
            for r in range(0, batch, rows)
        ]
    )


def _dequantized_planes(packed, scale, minimum, config: Compression) -> list[torch.Tensor]:
    """float32 values of packed codes [..., n, C], by plane (int8: one; int4: low and
    high nibbles); scale and minimum [..., n, P] for P groups of each plane's columns."""
    planes = [packed] if config.bits == 8 else [packed & 0x0F, packed >> 4]
    out = []
    for plane in planes:
        values = plane.float()
        parts = scale.shape[-1]
        grouped = values.view(*values.shape[:-1], parts, values.shape[-1] // parts)
        if minimum is None:  # codes 0 .. levels, zero at levels // 2
            grouped.sub_(float(((1 << config.bits) - 1) // 2))
            grouped.mul_(scale.unsqueeze(-1))
        else:
            grouped.mul_(scale.unsqueeze(-1)).add_(minimum.unsqueeze(-1))
        out.append(values)
    return out


def _interleave(planes: list[torch.Tensor]) -> torch.Tensor:
    return planes[0] if len(planes) == 1 else torch.stack(planes, dim=-1).flatten(-2)


def _decode_attention_rows(q, cache: QuantKV, bias, end: int, first: int) -> torch.Tensor:
    batch, heads, _, dim = q.shape
    rows = slice(first, first + batch)
    kv_heads = cache.k_codes.shape[1]
    rep, g = heads // kv_heads, cache.group
    full, tail = end // g, end % g
    slots = full * g
    k_min = None if cache.k_min is None else cache.k_min[rows, :, :full, :, None]
    v_min = None if cache.v_min is None else cache.v_min[rows, :, :slots]
    qf = q.float().view(batch, kv_heads, 1, rep, dim) * (1.0 / math.sqrt(dim))
    # keys [b, h, groups, D, g]: per-channel groups of g tokens (one scale a channel)
    k_planes = _dequantized_planes(
        cache.k_codes[rows, :, :full], cache.k_scale[rows, :, :full, :, None], k_min, cache.config
    )
    scores = _interleave([qf @ plane for plane in k_planes])  # [b, h, groups, rep, g]
    scores = scores.permute(0, 1, 3, 2, 4).reshape(batch, kv_heads, rep, slots)
    tail_k = cache.k_tail[rows, :, :tail].float()  # [b, h, t, D]
    scores = torch.cat((scores, qf.squeeze(2) @ tail_k.transpose(-1, -2)), dim=-1)
    scores += bias.reshape(batch, kv_heads, rep, end).float()
    p = torch.softmax(scores, dim=-1)
    # values [b, h, slots, D]: per-token groups of channels
    v_planes = _dequantized_planes(
        cache.v_codes[rows, :, :slots], cache.v_scale[rows, :, :slots], v_min, cache.value_config
    )
    out = _interleave([p[..., :slots] @ plane for plane in v_planes])  # [b, h, rep, D]
    out += p[..., slots:] @ cache.v_tail[rows, :, :tail].float()
    return out.reshape(batch, 1, heads * dim).to(q.dtype)
