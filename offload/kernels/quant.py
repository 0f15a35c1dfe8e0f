"""Group-wise quantization of weights and KV cache: 4 or 8 bits, groups along the last
dimension, asymmetric (scale and minimum, as FlexGen) or symmetric (scale only).

This is the plain-torch reference: `quantize` packs (two 4-bit codes a byte, low
nibble first), `dequantize` restores the values. Kernels that fuse dequantization into
matmul and attention must match it; the executor will store and move the packed form.
Scales and minimums are float16 per group (FlexGen's choice; bfloat16's 8-bit mantissa
costs 8-bit codes a full step): int4-g64 stores 4.5 bits a value, 3.56x less than fp16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload.core.errors import UserError
from offload.kernels import fp8
from offload.kernels.formats import MXFP4_BLOCKS, MXFP4_SCALES, Compression


@dataclass(frozen=True)
class QTensor:
    """A quantized tensor: packed codes [..., groups, group_bytes] and per-group params."""

    codes: torch.Tensor  # uint8
    scale: torch.Tensor  # [..., groups, 1], float16 (bf16 loses 8-bit accuracy)
    minimum: torch.Tensor | None  # asymmetric only
    shape: tuple[int, ...]
    dtype: torch.dtype
    config: Compression

    @property
    def nbytes(self) -> int:
        extra = (
            self.minimum.numel() * self.minimum.element_size() if self.minimum is not None else 0
        )
        return self.codes.numel() + self.scale.numel() * self.scale.element_size() + extra


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes in [0, 15] along the last dim (even length): low nibble first."""
    assert codes.shape[-1] % 2 == 0, "int4 packing needs an even group"
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def _grouped(t: torch.Tensor, group: int) -> torch.Tensor:
    last = t.shape[-1]
    if last % group:
        raise ValueError(f"last dimension {last} is not a multiple of group_size {group}")
    return t.reshape(*t.shape[:-1], last // group, group)


# a tensor past this many elements is quantized a slice of rows at a time: the fp32
# working copies then stay one slice (BLOOM's 250880 x 14336 head drew 61 GB at once)
QUANT_SLICE_ELEMENTS = 1 << 26
# its working set at most: the slice in fp32 and two fp32 intermediates of `_quantize`
QUANT_WORK_BYTES = 3 * 4 * QUANT_SLICE_ELEMENTS


def quantize(t: torch.Tensor, config: Compression) -> QTensor:
    """Scales multiply by the reciprocal of the level count: torch on CUDA divides by a
    Python number that way and on the CPU truly divides, so this is the arithmetic that
    is the same on every device (and in the cache's quantizing kernel). Groups are
    independent, so a large tensor is quantized a slice of rows at a time, bit-exactly.
    (fp8 is a checkpoint's format, read as shipped: nothing quantizes to it.)"""
    assert not config.fp8, "fp8 weights come from a checkpoint (`models.fp8_checkpoint`)"
    if t.dim() < 2 or t.numel() <= QUANT_SLICE_ELEMENTS:
        return _quantize(t, config)
    rows = max(1, QUANT_SLICE_ELEMENTS // (t.numel() // t.shape[0]))
    # each slice is written into the whole outputs, which are made once: parts and their
    # concatenation side by side held the codes twice (BLOOM's head: 2 GB more on the GPU)
    first = _quantize(t[:rows], config)
    out = [
        None if p is None else p.new_empty((t.shape[0], *p.shape[1:]))
        for p in (first.codes, first.scale, first.minimum)
    ]
    for start in range(0, t.shape[0], rows):
        part = first if start == 0 else _quantize(t[start : start + rows], config)
        for whole, piece in zip(out, (part.codes, part.scale, part.minimum), strict=True):
            if whole is not None:
                whole[start : start + piece.shape[0]] = piece
    codes, scale, minimum = out
    return QTensor(codes, scale, minimum, tuple(t.shape), t.dtype, config)


def _quantize(t: torch.Tensor, config: Compression) -> QTensor:
    groups = _grouped(t.float(), config.group_size)
    levels = (1 << config.bits) - 1
    if config.symmetric:
        half = levels // 2  # codes 0..levels, zero at `half`
        scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) * (1.0 / half)
        codes = (groups / scale).round().clamp(-half, half) + half
        minimum = None
    else:
        minimum = groups.amin(dim=-1, keepdim=True)
        scale = (groups.amax(dim=-1, keepdim=True) - minimum).clamp(min=1e-12) * (1.0 / levels)
        codes = ((groups - minimum) / scale).round().clamp(0, levels)
        if config.zero_point:  # the zero in the minimum's place, codes around it
            scale = scale.to(torch.float16).float()
            minimum = (-minimum / scale).round().clamp(0, levels)
            codes = (groups / scale + minimum).round().clamp(0, levels)
    codes = codes.to(torch.uint8)
    if config.bits == 4:
        codes = pack_int4(codes)
    return QTensor(
        codes,
        scale.to(torch.float16),
        minimum.to(torch.float16) if minimum is not None else None,
        tuple(t.shape),
        t.dtype,
        config,
    )


def dequantize(q: QTensor) -> torch.Tensor:
    if q.config.fp8:
        return fp8.dequantize(q.codes, q.scale, q.config, q.dtype)
    codes = unpack_int4(q.codes) if q.config.bits == 4 else q.codes
    values = codes.float()
    if q.config.symmetric:
        values = (values - ((1 << q.config.bits) - 1) // 2) * q.scale.float()
    elif q.config.zero_point:
        values = (values - q.minimum.float()) * q.scale.float()
    else:
        values = values * q.scale.float() + q.minimum.float()
    return values.reshape(q.shape).to(q.dtype)


def embedding(
    ids: torch.Tensor, table: torch.Tensor | QTensor, device: torch.device
) -> torch.Tensor:
    """Rows `ids` of a table [V, K] on `device`, gathered where the table lives: a
    quantized table's rows cross as stored (codes and group parameters, 3.56x less than
    fp16 at int4-g64) and are dequantized on `device`. From a table in another memory
    each distinct row crosses once: a prefill's prompts repeat their tokens (W1u's
    88 x 512 prompt tokens crossed as 646 MB of rows, 174 ms of a 4.8 s prefill on the
    H100 machine, for under 256 distinct ids)."""
    home = table.device if isinstance(table, torch.Tensor) else table.codes.device
    at, spread = ids.to(home), None
    if home.type != torch.device(device).type:
        at, spread = torch.unique(at, return_inverse=True)
    if isinstance(table, torch.Tensor):
        rows = torch.nn.functional.embedding(at, table).to(device)
    else:

        def part(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[at].to(device)

        codes, scale, minimum = part(table.codes), part(table.scale), part(table.minimum)
        shape = (*at.shape, table.shape[-1])
        rows = dequantize(QTensor(codes, scale, minimum, shape, table.dtype, table.config))
    return rows if spread is None else rows[spread.to(device)]


def fake_quantize(t: torch.Tensor, config: Compression) -> torch.Tensor:
    """quantize then dequantize: the values a compressed run computes with."""
    return dequantize(quantize(t, config))


# -- compressed stages: what the tiers store and move ---------------------------------
# The layer matrices and the LM head are quantized (BLOOM-176B's head alone is 7.2 GB in
# fp16); norms, biases and the input embedding (read a few rows a step) stay in the
# compute dtype.
MATRICES = ("qkv.weight", "o.weight", "mlp_in.weight", "mlp_out.weight", "lm_head.weight")
# a mixture of experts' expert matrices (`experts.<e>.mlp_in.weight`, `shared.mlp_out...`)
EXPERT_MATRICES = (".mlp_in.weight", ".mlp_out.weight")
SCALE, MINIMUM = ".scale", ".min"


def is_quantized(name: str, shape: tuple[int, ...], config: Compression | None) -> bool:
    if config is None or (name == "lm_head.weight" and not config.head):
        return False
    matrix = name in MATRICES or name.endswith(EXPERT_MATRICES)
    return matrix and (config.fp8 or shape[-1] % config.group_size == 0)


def stored_layout(
    shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, config: Compression | None
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of what a stage stores: a quantized matrix W [N, K] becomes
    codes W [N, K / G, G x bits / 8] uint8, W.scale (and W.min) [N, K / G, 1] fp16;
    fp8 (`kernels.fp8`): codes W [N, K] uint8 and W.scale [N, ceil(K / G)] float32."""
    out = {}
    for name, shape in shapes.items():
        if name.endswith((MXFP4_BLOCKS, MXFP4_SCALES)):  # bytes as they are (`formats`)
            out[name] = (tuple(shape), torch.uint8)
            continue
        if not is_quantized(name, shape, config):
            out[name] = (tuple(shape), dtype)
            continue
        assert config is not None
        *lead, k = shape
        if config.fp8:
            out[name] = (tuple(shape), torch.uint8)
            out[name + SCALE] = ((*lead, fp8.blocks(k, config)), torch.float32)
            continue
        groups = k // config.group_size
        out[name] = ((*lead, groups, config.group_size * config.bits // 8), torch.uint8)
        out[name + SCALE] = ((*lead, groups, 1), torch.float16)
        if not config.symmetric:
            out[name + MINIMUM] = ((*lead, groups, 1), torch.float16)
    return out


def compress_stage(
    weights: dict[str, torch.Tensor], config: Compression | None
) -> dict[str, torch.Tensor]:
    """A stage's weights as stored: quantized matrices split into codes and parameters
    (a `QTensor` already in the format, a pre-quantized checkpoint's, as it is; an fp8
    checkpoint's in another format converted from its dequantized values)."""
    out = {}
    for name, t in weights.items():
        if isinstance(t, QTensor) and t.config.fp8 and t.config != config:
            t = dequantize(t)
        if config is not None and config.fp8 and is_quantized(name, tuple(t.shape), config):
            _require_fp8(name, t)
        if not is_quantized(name, tuple(t.shape), config):
            assert not isinstance(t, QTensor), f"{name} is quantized, the stage's format not"
            out[name] = t
            continue
        assert config is not None
        q = t if isinstance(t, QTensor) else quantize(t, config)
        assert q.config == config, f"{name} is in {q.config}, the stage in {config}"
        out[name], out[name + SCALE] = q.codes, q.scale
        if q.minimum is not None:
            out[name + MINIMUM] = q.minimum
    return out


def _require_fp8(name: str, t: torch.Tensor | QTensor) -> None:
    """An fp8 stage holds its matrices as the checkpoint's codes: a matrix the checkpoint
    ships dense has no fp8 form here."""
    if not isinstance(t, QTensor):
        raise UserError(
            f"{name} is not fp8 in this checkpoint while its other layer matrices are; "
            "run it converted (--compress int8 or int4)"
        )


def assemble_stage(
    stored: dict[str, torch.Tensor],
    shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    config: Compression | None,
) -> dict[str, torch.Tensor | QTensor]:
    """The inverse view of `compress_stage`: quantized matrices as `QTensor`s over the
    stored tensors (no copy), everything else as stored."""
    out: dict[str, torch.Tensor | QTensor] = {}
    for name, shape in shapes.items():
        if name not in stored:
            continue
        if is_quantized(name, tuple(shape), config):
            assert config is not None
            out[name] = QTensor(
                stored[name],
                stored[name + SCALE],
                stored.get(name + MINIMUM),
                tuple(shape),
                dtype,
                config,
            )
        else:
            out[name] = stored[name]
    return out
