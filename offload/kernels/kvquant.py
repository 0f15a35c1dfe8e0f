"""A compressed KV cache and decode attention over it.

Format (one layer, `rows` sequences, `max_slots` token slots, compression bits / G):
- keys are quantized per channel over groups of G consecutive tokens (each of the
  head_dim channels of a group has its own scale and minimum): rotary-embedded keys
  have a few channels of large magnitude, which per-token groups would have to share a
  scale with (measured on the demo model: +22% perplexity per token, +1% per channel;
  docs/compression.md). Codes `k_codes` [rows, Hkv, groups, D, G x bits / 8] (int4:
  two tokens a byte, low nibble first), `k_scale` / `k_min` [rows, Hkv, groups, D] fp16.
- values are quantized per token in groups of gcd(G, D) channels: `v_codes`
  [rows, Hkv, slots, D x bits / 8], `v_scale` / `v_min` [rows, Hkv, slots, D / Gv].
- the tokens of the last, incomplete group wait in `k_tail` / `v_tail` [rows, Hkv, G, D]
  in the compute dtype: both are quantized when their group completes, so a decode
  step only copies its entry (the most recent tokens also stay exact, as in KIVI).

A disk home keeps the same tensors slot-major (`QuantKV(slot_major=True)`: each one's
slot axis first in memory), so the bytes of given slots are contiguous.

Writes must be in slot order (each starts where the last ended), which is how a
generation fills its cache. Prefill attends over its fresh full-precision K/V; decode
reads the compressed cache through `decode_attention`: a Triton kernel that
dequantizes in registers (grouped-query heads of one KV head together, any additive
bias: padding, causality, ALiBi), or its plain-torch reference where there is no CUDA.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from offload.kernels.formats import KV_GROUPS, Compression, value_group
from offload.kernels.launch import Launcher, use_kernel
from offload.kernels.quant import QTensor, dequantize, quantize

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs instead
    triton = None
else:
    from offload.kernels.dequant import dequant, dequant_nibbles


# the format's tensors, by non-increasing element size (`QuantKV.pack` relies on it);
# axis 2 of each is its slot axis (token groups for the keys' codes and parameters)
COMPONENTS = ("k_tail", "v_tail", "k_scale", "k_min", "v_scale", "v_min", "k_codes", "v_codes")
# byte alignment of each tensor in a QuantKV's buffer (Triton specializes 16)
ALIGN = 128


def component_shapes(
    rows: int, num_kv_heads: int, head_dim: int, max_slots: int, config: Compression, dtype
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of each present tensor of the format (the module docstring)."""
    g = config.group_size
    lead = (rows, num_kv_heads)
    groups = -(-max_slots // g)
    value_groups = head_dim // value_group(config, head_dim)
    shapes = {
        "k_tail": ((*lead, g, head_dim), dtype),
        "v_tail": ((*lead, g, head_dim), dtype),
        "k_scale": ((*lead, groups, head_dim), torch.float16),
        "k_min": ((*lead, groups, head_dim), torch.float16),
        "v_scale": ((*lead, max_slots, value_groups), torch.float16),
        "v_min": ((*lead, max_slots, value_groups), torch.float16),
        "k_codes": ((*lead, groups, head_dim, g * config.bits // 8), torch.uint8),
        "v_codes": ((*lead, max_slots, head_dim * config.bits // 8), torch.uint8),
    }
    if config.symmetric:
        del shapes["k_min"], shapes["v_min"]
    return shapes


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def kv_row_bytes(
    num_kv_heads: int, head_dim: int, max_slots: int, dtype: torch.dtype, config: Compression
) -> int:
    """Bytes of one sequence's compressed K and V for one layer (tail included)."""
    shapes = component_shapes(1, num_kv_heads, head_dim, max_slots, config, dtype)
    return sum(_nbytes(*spec) for spec in shapes.values())


def kv_buffer_bytes(
    rows: int,
    num_kv_heads: int,
    head_dim: int,
    max_slots: int,
    dtype: torch.dtype,
    config: Compression,
) -> int:
    """Bytes of a `QuantKV` of `rows` sequences: its tensors, each `ALIGN`-aligned."""
    shapes = component_shapes(rows, num_kv_heads, head_dim, max_slots, config, dtype)
    return sum(-(-_nbytes(*spec) // ALIGN) * ALIGN for spec in shapes.values())


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
        buffer: torch.Tensor | None = None,
        slot_major: bool = False,
    ) -> None:
        """buffer: uint8 memory of at least `kv_buffer_bytes` to lay the tensors out in
        (a pinned pool block for a CPU home); allocated on `device` when None.

        slot_major: each tensor is laid out with its slot axis first ([slots, rows, Hkv,
        ...], seen through a view in the usual axis order), so the bytes of given slots
        of every row are one contiguous range: a disk home reads the prefix a decode
        step needs, and writes back a step's entries (`changed`) as a few whole pages.
        The kernels take only the usual layout (`copy_slots_from` converts)."""
        if config.group_size not in KV_GROUPS:
            raise ValueError(f"KV group size {config.group_size} is not one of {KV_GROUPS}")
        self.config, self.dtype, self.head_dim = config, dtype, head_dim
        self.group = config.group_size
        self.value_config = Compression(
            config.bits, value_group(config, head_dim), config.symmetric
        )
        self.nbytes = kv_buffer_bytes(rows, num_kv_heads, head_dim, max_slots, dtype, config)
        if buffer is None:
            buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        assert buffer.numel() >= self.nbytes and buffer.dtype == torch.uint8
        self.k_min: torch.Tensor | None = None
        self.v_min: torch.Tensor | None = None
        offset = 0
        shapes = component_shapes(rows, num_kv_heads, head_dim, max_slots, config, dtype)
        for name, (shape, kind) in shapes.items():
            size = _nbytes(shape, kind)
            memory = buffer[offset : offset + size].view(kind)
            if slot_major:
                moved = (shape[2], *shape[:2], *shape[3:])
                setattr(self, name, memory.view(moved).movedim(0, 2))
            else:
                setattr(self, name, memory.view(shape))
            offset += -(-size // ALIGN) * ALIGN

    def _tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, getattr(self, n)) for n in COMPONENTS if getattr(self, n) is not None]

    def rows(self, start: int, stop: int) -> QuantKV:
        """A view of sequences start .. stop - 1 (sharing memory)."""
        view = copy.copy(self)
        for name, tensor in self._tensors():
            setattr(view, name, tensor[start:stop])
        return view

    def copy_from(self, other: QuantKV, non_blocking: bool = False) -> None:
        """Copy every tensor of `other` (same format and rows) into this cache."""
        for name, tensor in self._tensors():
            tensor.copy_(getattr(other, name), non_blocking=non_blocking)

    def copy_slots_from(self, other: QuantKV, end: int, non_blocking: bool = False) -> None:
        """Copy what holds slots 0 .. end - 1 of a slot-major cache `other` (same
        format and rows) into this one. Each piece crosses as the contiguous range it
        is and is reordered where it lands (a strided pinned source would make torch
        copy synchronously through pageable memory)."""
        for name, part in self.changed(0, end):
            source = getattr(other, name).movedim(2, 0)[part]
            moved = source.to(self.k_tail.device, non_blocking=non_blocking)
            getattr(self, name)[:, :, part].copy_(moved.movedim(0, 2))

    def slot_bytes(self, end: int) -> int:
        """Bytes of what holds slots 0 .. end - 1 (what `copy_slots_from` moves)."""
        regions = [getattr(self, name)[:, :, part] for name, part in self.changed(0, end)]
        return sum(region.numel() * region.element_size() for region in regions)

    def changed(self, start: int, end: int) -> list[tuple[str, slice]]:
        """What `write` of slots start .. end - 1 changes: (tensor name, slice of its
        axis 2). changed(0, end) is what holds slots 0 .. end - 1."""
        g = self.group
        first, last = start // g, end // g
        if first == last:  # the entries joined the tail
            tail = slice(start - first * g, end - first * g)
            return [("k_tail", tail), ("v_tail", tail)]
        groups, slots = slice(first, last), slice(first * g, last * g)
        axis = {"k_tail": slice(0, end - last * g), "v_tail": slice(0, end - last * g)}
        axis |= {"k_scale": groups, "k_min": groups, "k_codes": groups}
        axis |= {"v_scale": slots, "v_min": slots, "v_codes": slots}
        return [(name, axis[name]) for name, _ in self._tensors()]

    def pack(self, start: int, end: int) -> torch.Tensor:
        """The bytes `write` of slots start .. end - 1 changed, as one flat uint8 tensor
        (what crosses to an off-GPU home; `unpack` puts it in place there)."""
        regions = [getattr(self, name)[:, :, part] for name, part in self.changed(start, end)]
        return torch.cat([region.reshape(-1).view(torch.uint8) for region in regions])

    def unpack(self, flat: torch.Tensor, start: int, end: int) -> None:
        """Put `pack(start, end)` of a cache with the same format and rows in place."""
        offset = 0
        for name, part in self.changed(start, end):
            tensor = getattr(self, name)
            region = tensor[:, :, part]
            size = region.numel() * tensor.element_size()
            # pieces come by non-increasing element size, so each offset is aligned
            region.copy_(flat[offset : offset + size].view(tensor.dtype).view(region.shape))
            offset += size

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
        g = self.group
        first, held = start // g, start % g
        full = end // g - first
        if not full:  # no group completes (most decode steps): the entries join the tail
            self.k_tail[part, :, held : held + k.shape[2]] = k
            self.v_tail[part, :, held : held + k.shape[2]] = v
            return
        if held:  # tokens [first x g, end): the tail's, then the new ones
            k = torch.cat((self.k_tail[part, :, :held], k), dim=2)
            v = torch.cat((self.v_tail[part, :, :held], v), dim=2)
        if use_kernel(k):
            self._quantize_groups(part, k, v, first, full)
        else:
            self._quantize_groups_reference(part, k, v, first, full)
        rest = k.shape[2] - full * g
        self.k_tail[part, :, :rest] = k[:, :, full * g :]
        self.v_tail[part, :, :rest] = v[:, :, full * g :]

    def _quantize_groups_reference(
        self, part: slice, k: torch.Tensor, v: torch.Tensor, first: int, full: int
    ) -> None:
        """Groups first .. first + full - 1 from k, v [rows, Hkv, >= full x G, D]."""
        g = self.group
        rows, heads, _, dim = k.shape
        grouped = k[:, :, : full * g].reshape(rows, heads, full, g, dim).transpose(-1, -2)
        qk = quantize(grouped, self.config)  # groups of g tokens, per channel
        self.k_codes[part, :, first : first + full] = qk.codes.squeeze(-2)
        self.k_scale[part, :, first : first + full] = qk.scale.flatten(-3)
        if qk.minimum is not None:
            self.k_min[part, :, first : first + full] = qk.minimum.flatten(-3)
        slots = slice(first * g, (first + full) * g)
        qv = quantize(v[:, :, : full * g], self.value_config)  # per token
        self.v_codes[part, :, slots] = qv.codes.flatten(-2)
        self.v_scale[part, :, slots] = qv.scale.flatten(-2)
        if qv.minimum is not None:
            self.v_min[part, :, slots] = qv.minimum.flatten(-2)

    def _quantize_groups(
        self, part: slice, k: torch.Tensor, v: torch.Tensor, first: int, full: int
    ) -> None:
        """The same through one Triton kernel: each program reads one group of G tokens
        of K and V once and writes their codes and parameters (the reference's dozen
        full-size float32 passes took about a tenth of an OPT-30B prefill)."""
        rows, heads, _, dim = k.shape
        cfg = self.config
        _launch_quantize(
            (rows * heads, full), 4,
            k, k.stride(0), k.stride(1), k.stride(2),
            v, v.stride(0), v.stride(1), v.stride(2),
            self.k_codes, self.k_scale, self.k_scale if self.k_min is None else self.k_min,
            self.v_codes, self.v_scale, self.v_scale if self.v_min is None else self.v_min,
            part.start or 0, heads, first, self.k_codes.shape[2], self.v_codes.shape[2],
            # HEAD_DIM, BLOCK_D, GROUP, VGROUP, BITS, SYMMETRIC
            dim, triton.next_power_of_2(dim), self.group, self.value_config.group_size,
            cfg.bits, cfg.symmetric,
        )  # fmt: skip

    def dequantized(self, end: int, dtype: torch.dtype | None = None):
        """Keys and values [rows, Hkv, end, D] of slots 0 .. end - 1 in `dtype` (the
        compute dtype when None)."""
        dtype = dtype or self.dtype
        g, ng = self.group, end // self.group
        rows, heads, _, dim, _ = self.k_codes.shape
        kq = QTensor(
            self.k_codes[:, :, :ng].unsqueeze(-2),
            self.k_scale[:, :, :ng, :, None, None],
            None if self.k_min is None else self.k_min[:, :, :ng, :, None, None],
            (rows, heads, ng, dim, g),
            dtype,
            self.config,
        )
        keys = dequantize(kq).transpose(-1, -2).reshape(rows, heads, ng * g, dim)
        keys = torch.cat((keys, self.k_tail[:, :, : end - ng * g].to(dtype)), dim=2)
        vq = QTensor(
            self._value_codes(ng * g),
            self.v_scale[:, :, : ng * g, :, None],
            None if self.v_min is None else self.v_min[:, :, : ng * g, :, None],
            (rows, heads, ng * g, dim),
            dtype,
            self.value_config,
        )
        values = torch.cat((dequantize(vq), self.v_tail[:, :, : end - ng * g].to(dtype)), dim=2)
        return keys, values

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
        q, keys, values, attn_mask=bias[..., :end], enable_gqa=keys.shape[1] != heads
    )
    return out.transpose(1, 2).reshape(batch, 1, heads * dim)


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


# Sequence splits of the decode attention: each program of the first kernel takes
# PER_SPLIT token groups of one (sequence, KV head), so even a small batch fills
# the GPU (flash-decoding); the second kernel merges the splits' softmax partials.
MAX_SPLITS = 64


def decode_attention(
    q: torch.Tensor,
    cache: QuantKV,
    bias: torch.Tensor,
    end: int,
    max_splits: int = MAX_SPLITS,
    warps: int = 2,
) -> torch.Tensor:
    """Attention of one new token per sequence over the compressed cache; [B, 1, H x D].

    q [B, H, 1, D]; bias [B, 1 | H, 1, >= end] additive (padding, ALiBi). The new token's
    own K/V must already be written. max_splits and warps: the kernel benchmark's sweep."""
    if not use_kernel(q):
        return decode_attention_cpu(q, cache, bias, end)
    batch, heads, _, dim = q.shape
    kv_heads = cache.k_codes.shape[1]
    rep = heads // kv_heads
    g = cache.group
    blocks = end // g + 1  # the full groups, then the tail
    per_split = triton.next_power_of_2(-(-blocks // max_splits))
    splits = -(-blocks // per_split)
    block_d = triton.next_power_of_2(dim)
    # tensor cores where the query heads of a KV head fill some of the 16 MMA rows and
    # the planes are at least 16 wide (tl.dot's smallest)
    dot = rep > 1 and g >= 32 and block_d >= 32
    block_r = max(16, triton.next_power_of_2(rep)) if dot else triton.next_power_of_2(rep)
    part_acc = torch.empty((batch, heads, splits, block_d), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((2, batch, heads, splits), dtype=torch.float32, device=q.device)
    _launch_split(
        (batch, kv_heads, splits), warps,
        q, q.stride(0), q.stride(1),
        bias, bias.stride(0), bias.stride(1) if bias.shape[1] > 1 else 0, bias.stride(3),
        cache.k_codes, cache.k_scale, cache.k_scale if cache.k_min is None else cache.k_min,
        cache.k_tail,
        cache.v_codes, cache.v_scale, cache.v_scale if cache.v_min is None else cache.v_min,
        cache.v_tail,
        part_acc, part_ml, part_ml[1],
        end // g, end % g, cache.k_codes.shape[2], cache.v_codes.shape[2], splits,
        1.0 / math.sqrt(dim),
        # HEAD_DIM, BLOCK_D, REP, BLOCK_R, GROUP, VGROUP, BITS, SYMMETRIC, PER_SPLIT
        dim, block_d, rep, block_r,
        g, cache.value_config.group_size, cache.config.bits, cache.config.symmetric, per_split,
        dot,
    )  # fmt: skip
    out = torch.empty((batch, 1, heads * dim), dtype=q.dtype, device=q.device)
    _launch_merge(
        (batch, heads), 4,
        part_acc, part_ml, part_ml[1], out, splits,
        dim, block_d, triton.next_power_of_2(splits),  # HEAD_DIM, BLOCK_D, BLOCK_S
    )  # fmt: skip
    return out


if triton is not None:
    # Triton specializes integer arguments equal to 1 or divisible by 16 (a new compile
    # each, about a second): the context-dependent ones change every decode step
    @triton.jit(
        do_not_specialize=[
            "bias_sb", "bias_sh",
            "full_groups", "tail_len", "num_groups", "max_slots", "splits",
        ]
    )  # fmt: skip
    def _attention_split_kernel(
        q_ptr, q_sb, q_sh,
        bias_ptr, bias_sb, bias_sh, bias_ss,
        kc_ptr, ks_ptr, km_ptr, kt_ptr,
        vc_ptr, vs_ptr, vm_ptr, vt_ptr,
        acc_ptr, m_ptr, l_ptr,
        full_groups, tail_len, num_groups, max_slots, splits,
        sm_scale,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, REP: tl.constexpr, BLOCK_R: tl.constexpr,
        GROUP: tl.constexpr, VGROUP: tl.constexpr, BITS: tl.constexpr, SYMMETRIC: tl.constexpr,
        PER_SPLIT: tl.constexpr, DOT: tl.constexpr,
    ):  # fmt: skip
        """One (sequence, KV head, split): its REP query heads against PER_SPLIT token
        groups (the compressed groups j < full_groups; the last split also takes the
        tail); writes the split's softmax max m, sum l and unnormalized output.

        Everything is worked in planes, so int4 codes are never interleaved: keys by
        even and odd tokens (the low and high nibbles of a key byte), values by even
        and odd tokens (rows) and even and odd channels (the nibbles of a value byte).
        The loop over the compressed groups has no branch (a group past the last is
        masked), so the loads of later groups can be issued early. DOT: the products
        on tensor cores (tl.dot, 16 query rows at least), else as sums of products
        (one query head a KV head: 15 of 16 MMA rows would be wasted)."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        kv_heads = tl.num_programs(1)
        r = tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        dh = tl.arange(0, BLOCK_D // 2)  # even / odd channel planes
        th = tl.arange(0, GROUP // 2)  # even / odd token planes
        r_ok = r < REP
        d_ok = d < HEAD_DIM
        dh_ok = dh < HEAD_DIM // 2
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
        acc_e = tl.zeros((BLOCK_R, BLOCK_D // 2), tl.float32)  # even output channels
        acc_o = tl.zeros((BLOCK_R, BLOCK_D // 2), tl.float32)  # odd
        bias_rows = bias_ptr + b * bias_sb + heads[:, None] * bias_sh
        for i in tl.static_range(PER_SPLIT):
            j = split * PER_SPLIT + i
            # a one-element block, not a scalar: triton 3.9's interpreter rejects a mask
            # made of a block & a scalar condition ('mask has unsupported dtype')
            ok = (j + tl.zeros((1,), tl.int32)) < full_groups
            # keys [D, GROUP / 2] a plane: channel d of token t is byte d * k_bytes + t * BITS / 8
            kbase = (row * num_groups + j) * HEAD_DIM
            kscale = tl.load(ks_ptr + kbase + d, mask=d_ok & ok, other=0.0)[:, None]
            kmin = tl.load(km_ptr + kbase + d, mask=d_ok & ok, other=0.0)[:, None]
            krows = kc_ptr + (kbase + d[:, None]) * k_bytes
            kmask = d_ok[:, None] & ok
            if BITS == 4:
                kbyte = tl.load(krows + th[None, :], mask=kmask, other=0)
                k_e, k_o = dequant_nibbles(kbyte, kscale, kmin, SYMMETRIC, dtype)
            else:
                kbyte = tl.load(krows + tl.arange(0, GROUP)[None, :], mask=kmask, other=0)
                k_e, k_o = _pairs(kbyte, BLOCK_D, GROUP // 2)
                k_e = dequant(k_e, kscale, kmin, BITS, SYMMETRIC, dtype)
                k_o = dequant(k_o, kscale, kmin, BITS, SYMMETRIC, dtype)
            # values [GROUP / 2, D / 2] a plane: token t's channel c is byte t * v_bytes + c * BITS / 8
            slot_e = j * GROUP + 2 * th
            v_ee, v_eo = _value_planes(
                vc_ptr, vs_ptr, vm_ptr, row * max_slots + slot_e, dh, dh_ok, ok,
                v_bytes, v_groups, VGROUP, BLOCK_D, GROUP, BITS, SYMMETRIC, dtype,
            )  # fmt: skip
            v_oe, v_oo = _value_planes(
                vc_ptr, vs_ptr, vm_ptr, row * max_slots + slot_e + 1, dh, dh_ok, ok,
                v_bytes, v_groups, VGROUP, BLOCK_D, GROUP, BITS, SYMMETRIC, dtype,
            )  # fmt: skip
            block_ok = (th >= 0) & ok  # every token of a compressed group, or none
            m_i, l_i, acc_e, acc_o = _attend(
                q, k_e, k_o, v_ee, v_eo, v_oe, v_oo, bias_rows, slot_e, bias_ss,
                block_ok, block_ok, r_ok, sm_scale, m_i, l_i, acc_e, acc_o, DOT,
            )  # fmt: skip
        if split == splits - 1:
            # the tail: tokens of the incomplete last group, in the compute dtype
            t = tl.arange(0, GROUP)
            t_ok = t < tail_len
            keys = tl.load(
                kt_ptr + (row * GROUP + t[None, :]) * HEAD_DIM + d[:, None],
                mask=t_ok[None, :] & d_ok[:, None],
                other=0.0,
            )
            k_e, k_o = _pairs(keys, BLOCK_D, GROUP // 2)
            tail = vt_ptr + (row * GROUP + 2 * th[:, None]) * HEAD_DIM + d[None, :]
            e_ok = 2 * th < tail_len
            o_ok = 2 * th + 1 < tail_len
            v_ee, v_eo = _pairs(
                tl.load(tail, mask=e_ok[:, None] & d_ok[None, :], other=0.0),
                GROUP // 2,
                BLOCK_D // 2,
            )
            v_oe, v_oo = _pairs(
                tl.load(tail + HEAD_DIM, mask=o_ok[:, None] & d_ok[None, :], other=0.0),
                GROUP // 2,
                BLOCK_D // 2,
            )
            m_i, l_i, acc_e, acc_o = _attend(
                q, k_e, k_o, v_ee, v_eo, v_oe, v_oo, bias_rows, full_groups * GROUP + 2 * th,
                bias_ss, e_ok, o_ok, r_ok, sm_scale, m_i, l_i, acc_e, acc_o, DOT,
            )  # fmt: skip
        part = (b * kv_heads * REP + heads) * splits + split  # [BLOCK_R]
        tl.store(m_ptr + part, m_i, mask=r_ok)
        tl.store(l_ptr + part, l_i, mask=r_ok)
        out = acc_ptr + part[:, None] * BLOCK_D + 2 * dh[None, :]
        tl.store(out, acc_e, mask=r_ok[:, None])
        tl.store(out + 1, acc_o, mask=r_ok[:, None])

    @triton.jit
    def _pairs(x, ROWS: tl.constexpr, HALF: tl.constexpr):
        """x [ROWS, 2 x HALF] as its even and odd columns."""
        return tl.split(tl.reshape(x, (ROWS, HALF, 2)))

    @triton.jit
    def _value_planes(
        vc_ptr, vs_ptr, vm_ptr, vrow, dh, dh_ok, ok,
        v_bytes: tl.constexpr, v_groups: tl.constexpr, VGROUP: tl.constexpr,
        BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BITS: tl.constexpr,
        SYMMETRIC: tl.constexpr, dtype: tl.constexpr,
    ):  # fmt: skip
        """The values of cache rows vrow [GROUP / 2], dequantized: even and odd channels."""
        mask = dh_ok[None, :] & ok
        # both channels of a pair are in one group (VGROUP is even)
        params = vrow[:, None] * v_groups + (2 * dh[None, :]) // VGROUP
        vscale = tl.load(vs_ptr + params, mask=mask, other=0.0)
        vmin = tl.load(vm_ptr + params, mask=mask, other=0.0)
        if BITS == 4:
            vbyte = tl.load(vc_ptr + vrow[:, None] * v_bytes + dh[None, :], mask=mask, other=0)
            return dequant_nibbles(vbyte, vscale, vmin, SYMMETRIC, dtype)
        vbyte = tl.load(
            vc_ptr + vrow[:, None] * v_bytes + tl.arange(0, BLOCK_D)[None, :],
            mask=(tl.arange(0, BLOCK_D) < v_bytes)[None, :] & ok,
            other=0,
        )
        v_e, v_o = _pairs(vbyte, GROUP // 2, BLOCK_D // 2)
        return (
            dequant(v_e, vscale, vmin, BITS, SYMMETRIC, dtype),
            dequant(v_o, vscale, vmin, BITS, SYMMETRIC, dtype),
        )

    @triton.jit
    def _mm(a, b, DOT: tl.constexpr):
        """a [R, K] @ b [K, N] in float32: tensor cores, or sums of products."""
        if DOT:
            return tl.dot(a, b)
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)

    @triton.jit
    def _attend(
        q, k_e, k_o, v_ee, v_eo, v_oe, v_oo, bias_rows, slot_e, bias_ss, e_ok, o_ok, r_ok,
        sm_scale, m_i, l_i, acc_e, acc_o, DOT: tl.constexpr,
    ):  # fmt: skip
        """One block of tokens folded into the running softmax: keys k_e / k_o [D, T]
        (even / odd tokens), values v_<token><channel> [T, D / 2], e_ok / o_ok [T] which
        tokens count; slot_e [T] the even tokens' slots (the bias's columns)."""
        s_e = _mm(q, k_e, DOT) * sm_scale
        s_o = _mm(q, k_o, DOT) * sm_scale
        bias = bias_rows + slot_e[None, :] * bias_ss
        s_e += tl.load(bias, mask=r_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
        s_o += tl.load(bias + bias_ss, mask=r_ok[:, None] & o_ok[None, :], other=0.0).to(tl.float32)
        s_e = tl.where(e_ok[None, :], s_e, -float("inf"))
        s_o = tl.where(o_ok[None, :], s_o, -float("inf"))
        m_new = tl.maximum(m_i, tl.maximum(tl.max(s_e, axis=1), tl.max(s_o, axis=1)))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # nothing valid yet
        alpha = tl.exp(m_i - m_safe)
        p_e = tl.exp(s_e - m_safe[:, None])
        p_o = tl.exp(s_o - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p_e, axis=1) + tl.sum(p_o, axis=1)
        p_e = p_e.to(q.dtype)
        p_o = p_o.to(q.dtype)
        acc_e = acc_e * alpha[:, None] + _mm(p_e, v_ee, DOT) + _mm(p_o, v_oe, DOT)
        acc_o = acc_o * alpha[:, None] + _mm(p_e, v_eo, DOT) + _mm(p_o, v_oo, DOT)
        return m_new, l_i, acc_e, acc_o

    @triton.jit(do_not_specialize=["splits"])
    def _attention_merge_kernel(
        acc_ptr, m_ptr, l_ptr, out_ptr, splits,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        """One (sequence, query head): the splits' partial softmaxes merged, normalized."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        heads = tl.num_programs(1)
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        part = (b * heads + h) * splits + s
        s_ok = s < splits
        m = tl.load(m_ptr + part, mask=s_ok, other=-float("inf"))
        l_s = tl.load(l_ptr + part, mask=s_ok, other=0.0)
        acc = tl.load(acc_ptr + part[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0)
        m_max = tl.max(m, axis=0)
        w = tl.where(m == -float("inf"), 0.0, tl.exp(m - m_max))
        total = tl.sum(w * l_s, axis=0)
        out = tl.sum(w[:, None] * acc, axis=0) / total
        tl.store(
            out_ptr + (b * heads + h) * HEAD_DIM + d,
            out.to(out_ptr.dtype.element_ty),
            mask=d < HEAD_DIM,
        )

    @triton.jit
    def _round_half_even(y):
        """torch.round's rounding (ties to even) for y >= 0 (y + 0.5 is exact here)."""
        r = tl.floor(y + 0.5)
        return tl.where((r - y == 0.5) & (r % 2 == 1), r - 1, r)

    @triton.jit
    def _group_codes(x, valid, BITS: tl.constexpr, SYMMETRIC: tl.constexpr):
        """`quant.quantize` of the groups along x's last axis (float32, masked by valid):
        (codes as float, scale, minimum), the same arithmetic and rounding (a true
        division for the codes, as torch's tensor division)."""
        levels: tl.constexpr = (1 << BITS) - 1
        if SYMMETRIC:
            half: tl.constexpr = levels // 2
            amax = tl.max(tl.where(valid, tl.abs(x), 0.0), axis=-1, keep_dims=True)
            scale = tl.maximum(amax, 1e-12) * (1.0 / half)
            y = tl.math.div_rn(x, scale)
            r = _round_half_even(tl.abs(y))  # mirrored for negatives, as torch.round
            r = tl.where(y < 0, -r, r)
            codes = tl.minimum(tl.maximum(r, -half), half) + half
            return codes, scale, scale
        low = tl.min(tl.where(valid, x, float("inf")), axis=-1, keep_dims=True)
        high = tl.max(tl.where(valid, x, -float("inf")), axis=-1, keep_dims=True)
        scale = tl.maximum(high - low, 1e-12) * (1.0 / levels)
        codes = _round_half_even(tl.math.div_rn(x - low, scale))
        return tl.minimum(tl.maximum(codes, 0.0), levels), scale, low

    @triton.jit
    def _pack4(codes):
        """Float codes [m, n] in [0, 15] to bytes [m, n / 2], two a byte, low first."""
        c = codes.to(tl.uint8)
        lo, hi = tl.split(tl.reshape(c, (c.shape[0], c.shape[1] // 2, 2)))
        return lo | (hi << 4)

    @triton.jit
    def _quantize_kv_kernel(
        k_ptr, k_sr, k_sh, k_st,
        v_ptr, v_sr, v_sh, v_st,
        kc_ptr, ks_ptr, km_ptr,
        vc_ptr, vs_ptr, vm_ptr,
        row0, heads, first, num_groups, max_slots,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
        VGROUP: tl.constexpr, BITS: tl.constexpr, SYMMETRIC: tl.constexpr,
    ):  # fmt: skip
        """One (sequence, KV head) and group j of G tokens: keys per channel over the
        tokens, values per token over VGROUP channels, into cache group first + j."""
        rh = tl.program_id(0)
        j = tl.program_id(1)
        row = rh // heads
        h = rh % heads
        t = tl.arange(0, GROUP)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        tokens = j * GROUP + t
        cache_row = (row0 + row) * heads + h
        # keys [BLOCK_D, GROUP]: the groups along the tokens
        keys = tl.load(
            k_ptr + row * k_sr + h * k_sh + tokens[None, :] * k_st + d[:, None],
            mask=d_ok[:, None],
            other=0.0,
        ).to(tl.float32)
        codes, scale, low = _group_codes(keys, d_ok[:, None], BITS, SYMMETRIC)
        k_bytes: tl.constexpr = GROUP * BITS // 8
        kb = tl.arange(0, k_bytes)
        group_at = (cache_row * num_groups + first + j) * HEAD_DIM + d  # [BLOCK_D]
        k_at = kc_ptr + group_at[:, None] * k_bytes + kb[None, :]
        if BITS == 4:
            tl.store(k_at, _pack4(codes), mask=d_ok[:, None])
        else:
            tl.store(k_at, codes.to(tl.uint8), mask=d_ok[:, None])
        tl.store(ks_ptr + group_at[:, None], scale.to(tl.float16), mask=d_ok[:, None])
        if not SYMMETRIC:
            tl.store(km_ptr + group_at[:, None], low.to(tl.float16), mask=d_ok[:, None])
        # values [GROUP, BLOCK_D / VGROUP, VGROUP]: the groups along the channels
        values = tl.load(
            v_ptr + row * v_sr + h * v_sh + tokens[:, None] * v_st + d[None, :],
            mask=d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        v_groups: tl.constexpr = BLOCK_D // VGROUP
        grouped = tl.reshape(values, (GROUP, v_groups, VGROUP))
        g_ok = tl.reshape(d_ok, (v_groups, VGROUP))[None, :, :]
        codes, scale, low = _group_codes(grouped, g_ok, BITS, SYMMETRIC)
        slot = cache_row * max_slots + (first + j) * GROUP + t  # [GROUP]
        v_bytes: tl.constexpr = HEAD_DIM * BITS // 8
        vb = tl.arange(0, BLOCK_D * BITS // 8)
        v_at = vc_ptr + slot[:, None] * v_bytes + vb[None, :]
        codes = tl.reshape(codes, (GROUP, BLOCK_D))
        if BITS == 4:
            tl.store(v_at, _pack4(codes), mask=(vb < v_bytes)[None, :])
        else:
            tl.store(v_at, codes.to(tl.uint8), mask=(vb < v_bytes)[None, :])
        c = tl.arange(0, v_groups)
        c_ok = (c < HEAD_DIM // VGROUP)[None, :]
        per_token = HEAD_DIM // VGROUP
        scale = tl.reshape(scale, (GROUP, v_groups))
        tl.store(vs_ptr + slot[:, None] * per_token + c[None, :], scale.to(tl.float16), mask=c_ok)
        if not SYMMETRIC:
            low = tl.reshape(low, (GROUP, v_groups))
            tl.store(vm_ptr + slot[:, None] * per_token + c[None, :], low.to(tl.float16), mask=c_ok)

    _launch_split = Launcher(_attention_split_kernel)
    _launch_merge = Launcher(_attention_merge_kernel)
    _launch_quantize = Launcher(_quantize_kv_kernel)
