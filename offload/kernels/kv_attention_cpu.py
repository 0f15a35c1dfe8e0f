"""Decode attention over a compressed KV cache on the CPU (the format is in `kv_cache.py`).

`decode_attention_cpu` computes what `kv_attention.decode_attention_reference` defines
(dequantize, then SDPA) without dequantizing the cache: the scales are folded into
the small operand of each matmul (the query for keys, the probabilities for values),
so the codes go from uint8 into float32 matmuls once, and each group's offset becomes
one small matmul. Codes are centred (c' = code - 2^(bits-1)), so neither sum is a
large difference of large terms. With q the scaled query, for the key group of
channel d (tokens t) and the value group j of token t (channels d):

    scores[t] = sum_d (q[d] scale[d]) c'[d, t] + sum_d q[d] centre[d]
    out[d]    = sum_t (p[t] scale[t, j]) c'[t, d] + sum_t p[t] centre[t, j]

where centre = min + 2^(bits-1) scale (symmetric: scale, the zero being code
(2^bits - 1) // 2).

`kv_attention.decode_attention` calls `decode_attention_cpu` wherever the Triton
kernels do not run: the executor's CPU attention, and the plain run without CUDA. It
runs the C kernel (`cpu_attention.decode_attention_quant`: the same algebra, streamed
once over all cores; 8.7x the torch path on one CI core at the profile's shape) where
that runs, else `decode_attention_cpu_torch`, the same algebra in torch ops.
"""

from __future__ import annotations

import math

import torch

from offload.kernels.cpu_attention import decode_attention_quant
from offload.kernels.kv_cache import QuantKV

# float32 values of one code plane (a nibble of int4, all of int8) a chunk of
# (sequence, KV head) pairs converts, per thread. On one core of the 2-core CI machine
# (int4, 32 heads x 1024 slots x 128): 1 << 16 (one pair a chunk) ran 3-4x slower
# than 1 << 20 (Python and dispatch a chunk), 1 << 22 about 1.5x slower
CPU_CHUNK_VALUES = 1 << 20
# channels a key dot product sums in one float32 chain; the blocks are summed after.
# Chains of 64 made up to 1.12x the tests' bound (2x torch's own SDPA error, float32),
# of 32 up to 1.04x, of 16 0.995x (a dequantize-then-dot path: 0.96x); 16 costs ~10%
CHANNEL_BLOCK = 16


def decode_attention_cpu(
    q: torch.Tensor, cache: QuantKV, bias: torch.Tensor, end: int
) -> torch.Tensor:
    """`decode_attention` without CUDA (the executor's CPU attention, the plain run):
    q [B, H, 1, D], bias [B, 1 | H, 1, >= end] additive; [B, 1, H x D] in q's dtype.
    The C kernel where it runs, else the torch ops below."""
    out = decode_attention_quant(q, cache, bias, end)
    return out if out is not None else decode_attention_cpu_torch(q, cache, bias, end)


def decode_attention_cpu_torch(
    q: torch.Tensor, cache: QuantKV, bias: torch.Tensor, end: int
) -> torch.Tensor:
    """`decode_attention_cpu` in torch ops (where the C kernel does not run).

    A chunk of (sequence, KV head) pairs at a time, in buffers allocated once a call
    (a fresh 8M-value `.float()` converted 0.26 G values/s on one CI core, a copy into
    a reused buffer 1.9: a new large temporary pays its page faults). int4 codes are used one nibble plane at a time: even and odd
    tokens of a key group, even and odd channels of a value; only the small scores and
    outputs are interleaved."""
    batch, heads, _, dim = q.shape
    kv_heads = cache.k_codes.shape[1]
    rep = heads // kv_heads
    planes = 2 if cache.config.bits == 4 else 1
    plane_values = max(end // cache.group * cache.group, 1) * dim // planes  # a pair's
    chunk = max(1, CPU_CHUNK_VALUES * torch.get_num_threads() // plane_values)
    head_step = min(kv_heads, chunk)
    row_step = min(batch, max(1, chunk // kv_heads))
    values = torch.empty(row_step * head_step * plane_values, dtype=torch.float32)
    codes = torch.empty(2 * values.numel(), dtype=torch.uint8)
    qf = q.float().reshape(batch, kv_heads, rep, dim) * (1.0 / math.sqrt(dim))
    bias = bias[..., :end].float().expand(batch, heads, 1, end)
    bias = bias.reshape(batch, kv_heads, rep, end)
    out = torch.empty(batch, kv_heads, rep, dim)
    for first_row in range(0, batch, row_step):
        for first_head in range(0, kv_heads, head_step):
            part = (
                slice(first_row, first_row + row_step),
                slice(first_head, first_head + head_step),
            )
            view = _Chunk(cache, part, end, codes, values)
            scores = view.scores(qf[part]) + bias[part]
            out[part] = view.attend(torch.softmax(scores, dim=-1))
    return out.view(batch, 1, heads * dim).to(q.dtype)


class _Chunk:
    """Attention of a few (sequence, KV head) pairs: `part` indexes rows and KV heads of
    the cache; `codes` (uint8, two planes' worth) and `values` (float32, one plane) are
    the call's reused buffers."""

    def __init__(self, cache: QuantKV, part, end: int, codes, values) -> None:
        self.cache, self.part = cache, part
        self.full, self.tail = divmod(end, cache.group)
        self.slots = self.full * cache.group
        self.codes_buffer, self.values_buffer = codes, values
        self.bits = cache.config.bits

    def _centre(self, scale: torch.Tensor, minimum: torch.Tensor | None) -> torch.Tensor:
        """Float32 value of a group's centred code 0 (code 2^(bits-1)): what the group's
        scale x centred codes is added to (symmetric: zero at code (2^bits - 1) // 2)."""
        half = 1 << (self.bits - 1)
        if minimum is None:
            return scale * float(half - ((1 << self.bits) - 1) // 2)
        return minimum.float() + scale * float(half)

    def _planes(self, packed: torch.Tensor, groups: int = 0):
        """Each code plane of `packed` [rows, kv heads, ..., columns] as float32 centred
        codes in one reused buffer: a contiguous tensor of packed's shape, or with
        `groups` the value layout [rows, kv heads, groups, slots, columns / groups] (the
        transpose is done by the int8 -> float32 copy). Each plane is overwritten by the
        next: the caller uses it before asking for the next."""
        shape = packed.shape
        if groups:
            shape = (*shape[:2], groups, shape[2], shape[3] // groups)
        values = self.values_buffer[: math.prod(shape)].view(shape)
        target = values.transpose(2, 3) if groups else values
        for codes in self._centred_codes(packed):
            target.copy_(codes.unflatten(-1, target.shape[-2:]) if groups else codes)
            yield values

    def _centred_codes(self, packed: torch.Tensor):
        """int8 code - 2^(bits-1) of each plane: int8's, int4's low then high nibbles.
        Flipping a code's top bit and reading it as signed subtracts 2^(bits-1); the
        arithmetic right shifts of int8 sign-extend each nibble."""
        count = packed.numel()
        flipped = self.codes_buffer[:count].view(packed.shape)
        torch.bitwise_xor(packed, 0x80 if self.bits == 8 else 0x88, out=flipped)
        signed = flipped.view(torch.int8)
        if self.bits == 8:
            yield signed
            return
        low = self.codes_buffer[count : 2 * count].view(packed.shape)
        torch.bitwise_left_shift(flipped, 4, out=low)
        yield torch.bitwise_right_shift(low.view(torch.int8), 4, out=low.view(torch.int8))
        yield torch.bitwise_right_shift(signed, 4, out=signed)

    def scores(self, qf: torch.Tensor) -> torch.Tensor:
        """Scores [rows, kv heads, rep, end] of qf [rows, kv heads, rep, D]."""
        cache, part, full = self.cache, self.part, self.full
        rows, kv_heads, rep, dim = qf.shape
        pairs = rows * kv_heads
        q_pairs = qf.reshape(pairs, rep, dim)
        tail = cache.k_tail[part][:, :, : self.tail].reshape(pairs, self.tail, dim)
        tail_scores = q_pairs @ tail.float().transpose(1, 2)
        if not full:
            return tail_scores.view(rows, kv_heads, rep, self.tail)
        # keys [rows, kv heads, groups, D, g / planes]: one scale a channel of a group
        scale = cache.k_scale[part][:, :, :full].reshape(pairs, full, dim).float()
        minimum = None if cache.k_min is None else cache.k_min[part][:, :, :full]
        centre = self._centre(scale, None if minimum is None else minimum.reshape(scale.shape))
        # the dot products in blocks of CHANNEL_BLOCK channels, summed after
        blocks = dim // math.gcd(dim, CHANNEL_BLOCK)
        q_scaled = q_pairs.unsqueeze(1) * scale.unsqueeze(2)  # [pairs, groups, rep, D]
        q_scaled = q_scaled.reshape(pairs * full, rep, blocks, -1).transpose(1, 2)
        q_scaled = q_scaled.reshape(pairs * full * blocks, rep, -1)
        by_plane = [
            torch.bmm(q_scaled, plane.view(pairs * full * blocks, dim // blocks, -1))
            .view(pairs, full, blocks, rep, -1)
            .sum(2)
            for plane in self._planes(cache.k_codes[part][:, :, :full])
        ]
        # [pairs, groups, rep, g / planes] by plane -> [pairs, groups, rep, g]
        scores = torch.stack(by_plane, dim=-1).view(pairs, full, rep, -1)
        scores += (centre @ q_pairs.transpose(1, 2)).unsqueeze(-1)  # [pairs, groups, rep]
        scores = scores.transpose(1, 2).reshape(pairs, rep, -1)
        return torch.cat((scores, tail_scores), dim=-1).view(rows, kv_heads, rep, -1)

    def attend(self, p: torch.Tensor) -> torch.Tensor:
        """Outputs [rows, kv heads, rep, D] of probabilities p [rows, kv heads, rep, end]."""
        cache, part, slots = self.cache, self.part, self.slots
        rows, kv_heads, rep, _ = p.shape
        pairs, dim = rows * kv_heads, cache.head_dim
        p = p.reshape(pairs, rep, -1)
        tail = cache.v_tail[part][:, :, : self.tail].reshape(pairs, self.tail, dim)
        out = p[..., slots:] @ tail.float()
        if not slots:
            return out.view(rows, kv_heads, rep, dim)
        # values [rows, kv heads, slots, D / planes]: one scale a token of a group
        groups = cache.v_scale.shape[-1]
        scale = cache.v_scale[part][:, :, :slots].reshape(pairs, slots, groups).float()
        minimum = None if cache.v_min is None else cache.v_min[part][:, :, :slots]
        centre = self._centre(scale, None if minimum is None else minimum.reshape(scale.shape))
        p_scaled = p[:, None, :, :slots] * scale.transpose(1, 2).unsqueeze(2)
        p_scaled = p_scaled.reshape(pairs * groups, rep, slots)
        packed = cache.v_codes[part][:, :, :slots]
        columns = packed.shape[-1] // groups
        by_plane = [
            torch.bmm(p_scaled, plane.view(pairs * groups, slots, columns))
            for plane in self._planes(packed, groups)
        ]
        # [pairs x groups, rep, columns] by plane -> [pairs, groups, rep, channels]
        grouped = torch.stack(by_plane, dim=-1).view(pairs, groups, rep, -1)
        grouped += (p[..., :slots] @ centre).transpose(1, 2).unsqueeze(-1)
        grouped = grouped.transpose(1, 2).reshape(pairs, rep, dim)
        return (out + grouped).reshape(rows, kv_heads, rep, dim)
