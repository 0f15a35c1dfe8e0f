"""A compressed KV cache and decode attention over it.

Format (one layer, `rows` sequences, `max_slots` token slots, compression bits / G):
- keys are quantized per channel over groups of G consecutive tokens (each of the
  head_dim channels of a group has its own scale and minimum): rotary-embedded keys
  have a few channels of large magnitude, which per-token groups would have to share a
  scale with (measured on the demo model: +22% perplexity per token, +1% per channel;
  docs/compression.md). Codes `k_codes` [rows, Hkv, groups, D, G x bits / 8] (int4:
  two tokens a byte, low nibble first), `k_scale` / `k_min` [rows, Hkv, groups, D] fp16.
  The tokens of the last, incomplete group wait in `k_tail` [rows, Hkv, G, D] in the
  compute dtype and are quantized when their group completes.
- values are quantized per token in groups of gcd(G, D) channels: `v_codes`
  [rows, Hkv, slots, D x bits / 8], `v_scale` / `v_min` [rows, Hkv, slots, D / Gv].

Writes must be in slot order (each starts where the last ended), which is how a
generation fills its cache. Prefill attends over its fresh full-precision K/V; decode
reads the compressed cache through `decode_attention`: a Triton kernel that
dequantizes in registers (grouped-query heads of one KV head together, any additive
bias: padding, causality, ALiBi), or its plain-torch reference where there is no CUDA.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from offload.kernels.qmatmul import use_kernel
from offload.kernels.quant import QTensor, dequantize, quantize
from offload.policies.policy import KV_GROUPS, Compression

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs instead
    triton = None


def value_group(config: Compression, head_dim: int) -> int:
    """Channels per value group: the group size, or what of it divides head_dim."""
    return math.gcd(config.group_size, head_dim)


def kv_row_bytes(
    num_kv_heads: int, head_dim: int, max_slots: int, dtype: torch.dtype, config: Compression
) -> int:
    """Bytes of one sequence's compressed K and V for one layer (tail included)."""
    elt = torch.empty((), dtype=dtype).element_size()
    g, bits = config.group_size, config.bits
    params = 1 if config.symmetric else 2
    groups = -(-max_slots // g)
    keys = groups * head_dim * (g * bits // 8 + 2 * params) + g * head_dim * elt
    values = max_slots * (
        head_dim * bits // 8 + 2 * params * head_dim // value_group(config, head_dim)
    )
    return num_kv_heads * (keys + values)


# sequences x new tokens quantized at a time by `QuantKV.write`
WRITE_CHUNK_TOKENS = 4096


class QuantKV:
    """One layer's compressed KV for `rows` sequences (format in the module docstring)."""

    def __init__(
        self,
        rows: int,
        num_kv_heads: int,
        head_dim: int,
        max_slots: int,
        config: Compression,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if config.group_size not in KV_GROUPS:
            raise ValueError(f"KV group size {config.group_size} is not one of {KV_GROUPS}")
        self.config, self.dtype, self.head_dim = config, dtype, head_dim
        self.group = g = config.group_size
        self.value_config = Compression(
            config.bits, value_group(config, head_dim), config.symmetric
        )
        groups = -(-max_slots // g)
        lead = (rows, num_kv_heads)
        u8, f16 = dict(dtype=torch.uint8, device=device), dict(dtype=torch.float16, device=device)
        self.k_codes = torch.empty((*lead, groups, head_dim, g * config.bits // 8), **u8)
        self.k_scale = torch.empty((*lead, groups, head_dim), **f16)
        self.k_min = None if config.symmetric else torch.empty_like(self.k_scale)
        self.k_tail = torch.empty((*lead, g, head_dim), dtype=dtype, device=device)
        vg = head_dim // self.value_config.group_size
        self.v_codes = torch.empty((*lead, max_slots, head_dim * config.bits // 8), **u8)
        self.v_scale = torch.empty((*lead, max_slots, vg), **f16)
        self.v_min = None if config.symmetric else torch.empty_like(self.v_scale)

    @property
    def nbytes(self) -> int:
        parts = (self.k_codes, self.k_scale, self.k_min, self.k_tail)
        parts += (self.v_codes, self.v_scale, self.v_min)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Store new entries k, v [rows, Hkv, T, D] at slots start .. start + T - 1.

        A prefill is quantized a few sequences at a time, so its float32 temporaries
        stay small beside the layer's own (prefill rows x T can be tens of thousands)."""
        rows = max(1, WRITE_CHUNK_TOKENS // k.shape[2])
        for first in range(0, k.shape[0], rows):
            part = slice(first, first + rows)
            self._write(part, k[part], v[part], start)

    def _write(self, part: slice, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        end = start + k.shape[2]
        qv = quantize(v, self.value_config)
        self.v_codes[part, :, start:end] = qv.codes.flatten(-2)
        self.v_scale[part, :, start:end] = qv.scale.flatten(-2)
        if qv.minimum is not None:
            self.v_min[part, :, start:end] = qv.minimum.flatten(-2)
        g = self.group
        first, held = start // g, start % g
        keys = torch.cat((self.k_tail[part, :, :held], k), dim=2) if held else k
        full = end // g - first
        if full:
            rows, heads, _, dim = keys.shape
            grouped = keys[:, :, : full * g].reshape(rows, heads, full, g, dim).transpose(-1, -2)
            qk = quantize(grouped, self.config)  # groups of g tokens, per channel
            self.k_codes[part, :, first : first + full] = qk.codes.squeeze(-2)
            self.k_scale[part, :, first : first + full] = qk.scale.flatten(-3)
            if qk.minimum is not None:
                self.k_min[part, :, first : first + full] = qk.minimum.flatten(-3)
        rest = keys[:, :, full * g :]
        self.k_tail[part, :, : rest.shape[2]] = rest

    def dequantized(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [rows, Hkv, end, D] of slots 0 .. end - 1 in the compute dtype."""
        g, ng = self.group, end // self.group
        rows, heads, _, dim, _ = self.k_codes.shape
        kq = QTensor(
            self.k_codes[:, :, :ng].unsqueeze(-2),
            self.k_scale[:, :, :ng, :, None, None],
            None if self.k_min is None else self.k_min[:, :, :ng, :, None, None],
            (rows, heads, ng, dim, g),
            self.dtype,
            self.config,
        )
        keys = dequantize(kq).transpose(-1, -2).reshape(rows, heads, ng * g, dim)
        keys = torch.cat((keys, self.k_tail[:, :, : end - ng * g]), dim=2)
        vq = QTensor(
            self._value_codes(end),
            self.v_scale[:, :, :end, :, None],
            None if self.v_min is None else self.v_min[:, :, :end, :, None],
            (rows, heads, end, dim),
            self.dtype,
            self.value_config,
        )
        return keys, dequantize(vq)

    def _value_codes(self, end: int) -> torch.Tensor:
        groups = self.v_scale.shape[-1]
        return self.v_codes[:, :, :end].unflatten(-1, (groups, -1))


def decode_attention_reference(
    q: torch.Tensor, cache: QuantKV, bias: torch.Tensor, end: int
) -> torch.Tensor:
    """Attention of q [B, H, 1, D] over slots 0 .. end - 1 of the cache; [B, 1, H x D]."""
    keys, values = cache.dequantized(end)
    batch, heads, _, dim = q.shape
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=bias, enable_gqa=keys.shape[1] != heads
    )
    return out.transpose(1, 2).reshape(batch, 1, heads * dim)


def decode_attention(q: torch.Tensor, cache: QuantKV, bias: torch.Tensor, end: int) -> torch.Tensor:
    """Attention of one new token per sequence over the compressed cache; [B, 1, H x D].

    q [B, H, 1, D]; bias [B, 1 | H, 1, >= end] additive (padding, ALiBi). The new token's
    own K/V must already be written."""
    if not use_kernel(q):
        return decode_attention_reference(q, cache, bias, end)
    batch, heads, _, dim = q.shape
    kv_heads = cache.k_codes.shape[1]
    rep = heads // kv_heads
    out = torch.empty((batch, 1, heads * dim), dtype=q.dtype, device=q.device)
    g = cache.group
    _decode_attention_kernel[(batch, kv_heads)](
        q, q.stride(0), q.stride(1),
        bias, bias.stride(0), bias.stride(1) if bias.shape[1] > 1 else 0, bias.stride(3),
        cache.k_codes, cache.k_scale, cache.k_scale if cache.k_min is None else cache.k_min,
        cache.k_tail,
        cache.v_codes, cache.v_scale, cache.v_scale if cache.v_min is None else cache.v_min,
        out,
        end // g, end // g + 1, end % g, cache.k_codes.shape[2], cache.v_codes.shape[2],
        1.0 / math.sqrt(dim),
        HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim), REP=rep,
        BLOCK_R=max(16, triton.next_power_of_2(rep)),
        GROUP=g, VGROUP=cache.value_config.group_size, BITS=cache.config.bits,
        SYMMETRIC=cache.config.symmetric,
        num_warps=4,
    )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _dequant(codes, scale, minimum, BITS: tl.constexpr, SYMMETRIC: tl.constexpr):
        values = codes.to(tl.float32)
        if SYMMETRIC:
            return (values - ((1 << BITS) - 1) // 2) * scale
        return values * scale + minimum

    @triton.jit
    def _decode_attention_kernel(
        q_ptr, q_sb, q_sh,
        bias_ptr, bias_sb, bias_sh, bias_ss,
        kc_ptr, ks_ptr, km_ptr, kt_ptr,
        vc_ptr, vs_ptr, vm_ptr,
        out_ptr,
        full_groups, blocks, tail_len, num_groups, max_slots,
        sm_scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, REP: tl.constexpr, BLOCK_R: tl.constexpr,
        GROUP: tl.constexpr, VGROUP: tl.constexpr, BITS: tl.constexpr, SYMMETRIC: tl.constexpr,
    ):  # fmt: skip
        """One (sequence, KV head): its REP query heads against every slot, online softmax."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        kv_heads = tl.num_programs(1)
        r = tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        t = tl.arange(0, GROUP)
        r_ok = r < REP
        d_ok = d < HEAD_DIM
        heads = kvh * REP + r
        q = tl.load(
            q_ptr + b * q_sb + heads[:, None] * q_sh + d[None, :],
            mask=r_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        dtype = q.dtype
        row = b * kv_heads + kvh  # index of this (sequence, KV head) in the cache
        k_bytes: tl.constexpr = GROUP * BITS // 8
        v_bytes: tl.constexpr = HEAD_DIM * BITS // 8
        v_groups: tl.constexpr = HEAD_DIM // VGROUP
        m_i = tl.full((BLOCK_R,), -float("inf"), tl.float32)
        l_i = tl.zeros((BLOCK_R,), tl.float32)
        acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
        bias_rows = bias_ptr + b * bias_sb + heads[:, None] * bias_sh
        j = 0
        # the full groups, then the tail (a while loop: Triton's interpreter cannot take
        # a runtime bound in range() under numpy 2)
        while j < blocks:
            slots = j * GROUP + t
            if j < full_groups:
                # keys [D, GROUP]: channel d of token t is byte d * k_bytes + t * BITS / 8
                base = (row * num_groups + j) * HEAD_DIM
                if BITS == 4:
                    byte = tl.load(
                        kc_ptr + (base + d[:, None]) * k_bytes + t[None, :] // 2,
                        mask=d_ok[:, None],
                        other=0,
                    )
                    codes = (byte >> ((t[None, :] % 2) * 4)) & 0xF
                else:
                    codes = tl.load(
                        kc_ptr + (base + d[:, None]) * k_bytes + t[None, :],
                        mask=d_ok[:, None],
                        other=0,
                    )
                scale = tl.load(ks_ptr + base + d, mask=d_ok, other=0.0).to(tl.float32)
                minimum = tl.load(km_ptr + base + d, mask=d_ok, other=0.0).to(tl.float32)
                keys_t = _dequant(codes, scale[:, None], minimum[:, None], BITS, SYMMETRIC)
                keys_t = keys_t.to(dtype)
                valid = t < GROUP
            else:
                # the tail: tokens of the incomplete last group, in the compute dtype
                valid = t < tail_len
                keys_t = tl.load(
                    kt_ptr + (row * GROUP + t[None, :]) * HEAD_DIM + d[:, None],
                    mask=valid[None, :] & d_ok[:, None],
                    other=0.0,
                )
            scores = tl.dot(q, keys_t) * sm_scale  # [BLOCK_R, GROUP], fp32
            bias = tl.load(
                bias_rows + slots[None, :] * bias_ss, mask=r_ok[:, None] & valid[None, :], other=0.0
            )
            scores = scores + bias.to(tl.float32)
            scores = tl.where(valid[None, :], scores, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            # values [GROUP, D]: token t's channel d is byte t * v_bytes + d * BITS / 8
            vrow = row * max_slots + slots
            if BITS == 4:
                byte = tl.load(
                    vc_ptr + vrow[:, None] * v_bytes + d[None, :] // 2,
                    mask=valid[:, None] & d_ok[None, :],
                    other=0,
                )
                codes = (byte >> ((d[None, :] % 2) * 4)) & 0xF
            else:
                codes = tl.load(
                    vc_ptr + vrow[:, None] * v_bytes + d[None, :],
                    mask=valid[:, None] & d_ok[None, :],
                    other=0,
                )
            params = vrow[:, None] * v_groups + d[None, :] // VGROUP
            pmask = valid[:, None] & d_ok[None, :]
            scale = tl.load(vs_ptr + params, mask=pmask, other=0.0).to(tl.float32)
            minimum = tl.load(vm_ptr + params, mask=pmask, other=0.0).to(tl.float32)
            values = _dequant(codes, scale, minimum, BITS, SYMMETRIC).to(dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(dtype), values)
            m_i = m_new
            j += 1
        acc = acc / l_i[:, None]
        tl.store(
            out_ptr + (b * kv_heads * REP + heads[:, None]) * HEAD_DIM + d[None, :],
            acc.to(dtype),
            mask=r_ok[:, None] & d_ok[None, :],
        )
