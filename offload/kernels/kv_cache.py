"""A compressed KV cache: `QuantKV`, its layout and its byte sizes.

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
generation fills its cache; a group is quantized when it completes (`kv_quantize.py`:
a Triton kernel, or its plain-torch reference). Prefill attends over its fresh
full-precision K/V; decode reads the compressed cache through
`kv_attention.decode_attention` (`kv_attention_cpu.py` where there is no CUDA).
"""

from __future__ import annotations

import copy
import functools
import math

import torch

from offload.kernels.formats import KV_GROUPS, Compression, value_group
from offload.kernels.kv_quantize import quantize_groups, quantize_groups_reference
from offload.kernels.launch import use_kernel
from offload.kernels.quant import QTensor, dequantize

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
    return math.prod(shape) * dtype.itemsize


def kv_row_bytes(
    num_kv_heads: int, head_dim: int, max_slots: int, dtype: torch.dtype, config: Compression
) -> int:
    """Bytes of one sequence's compressed K and V for one layer (tail included)."""
    shapes = component_shapes(1, num_kv_heads, head_dim, max_slots, config, dtype)
    return sum(_nbytes(*spec) for spec in shapes.values())


@functools.lru_cache(maxsize=8192)  # (the search sizes every candidate's homes)
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
        self._views: dict[tuple[int, int], QuantKV] = {}  # `rows`
        # a slot-major cache's memory, whose pieces `copy_slots_from` moves in one copy
        self.slot_major_buffer = buffer if slot_major else None
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
        """A view of sequences start .. stop - 1 (sharing memory). Made once for each
        range: a decode step asks for the same few views of a scratch in every layer
        and micro-batch."""
        view = self._views.get((start, stop))
        if view is None:
            view = copy.copy(self)
            view._views = {}
            # a slot-major cache's rows are strided within each slot: no longer one
            # prefix a tensor (`copy_slots_from` refuses them)
            view.slot_major_buffer = None
            for name, tensor in self._tensors():
                setattr(view, name, tensor[start:stop])
            self._views[start, stop] = view
        return view

    def copy_from(self, other: QuantKV, non_blocking: bool = False) -> None:
        """Copy every tensor of `other` (same format and rows) into this cache."""
        for name, tensor in self._tensors():
            tensor.copy_(getattr(other, name), non_blocking=non_blocking)

    def copy_slots_from(self, other: QuantKV, end: int, non_blocking: bool = False) -> None:
        """Copy what holds slots 0 .. end - 1 of a slot-major cache `other` (same
        format and rows) into this one. What holds them is a prefix of each of other's
        tensors; the bytes from the first to the end of the last prefix cross in one
        copy (the unused slots between come along: a disk row's home is a few hundred
        KB, and each copy issued costs the host more than that takes to cross), and each
        piece is reordered where it lands. A strided pinned source would make torch copy
        synchronously through pageable memory."""
        memory = other.slot_major_buffer
        assert memory is not None, "copy_slots_from reads a slot-major cache"
        pieces = []
        for name, part in self.changed(0, end):
            source = getattr(other, name).movedim(2, 0)[part]  # contiguous: a prefix
            at = source.data_ptr() - memory.data_ptr()
            pieces.append((name, part, source, at, at + source.numel() * source.element_size()))
        span = max(stop for *_, stop in pieces)
        landed = memory[:span].to(self.k_tail.device, non_blocking=non_blocking)
        for name, part, source, at, stop in pieces:
            moved = landed[at:stop].view(source.dtype).view(source.shape)
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
        self._quantize_groups(part, k, v, first, full)
        rest = k.shape[2] - full * g
        self.k_tail[part, :, :rest] = k[:, :, full * g :]
        self.v_tail[part, :, :rest] = v[:, :, full * g :]

    def _quantize_groups(
        self, part: slice, k: torch.Tensor, v: torch.Tensor, first: int, full: int
    ) -> None:
        """Groups first .. first + full - 1 from k, v [rows, Hkv, >= full x G, D]: the
        Triton kernel where kernels run, else its plain-torch reference (`kv_quantize`)."""
        quantize = quantize_groups if use_kernel(k) else quantize_groups_reference
        quantize(self, part, k, v, first, full)

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
