"""Pre-quantized checkpoints read straight into our int4 format (`kernels.quant.QTensor`):
GPTQ, AWQ (GEMM) and compressed-tensors `pack-quantized`. The codes are moved, never
recomputed: each format stores a value as (code - zero) x scale with 4-bit codes and
an fp16 (or fp16-exact) scale per group of input channels. Codes and scales are
copied bit for bit (only their layout changes) and nothing is requantized:
- a symmetric checkpoint's zero is 8, so ours is code x scale + minimum with the
  minimum -8 x scale (exact in fp16: a power of two); the kernels' one rounding of
  code x scale + minimum is then that of (code - 8) x scale;
- an asymmetric one's (AWQ, GPTQ sym=false) takes our zero-point form
  (`formats.Compression.zero_point`): the zero itself, an integer exact in fp16, sits in
  the minimum's place and the kernels compute (code - zero) x scale, rounded once. (A
  minimum -zero x scale would be rounded to fp16 first: up to half an fp16 ulp of
  zero x scale, 1e-3 of the logits in the tests' tiny models.)

Layouts (W [N, K]: N output channels, K input channels, G a group; `docs/compression.md`):
- GPTQ: qweight int32 [K/8, N], 8 codes a word along K, low nibble first; qzeros
  int32 [K/G, N/8] along N; scales fp16 [K/G, N]; g_idx [K]. checkpoint_format "gptq"
  (v1) stores zero - 1, "gptq_v2" the zero.
- AWQ GEMM: qweight int32 [K, N/8] along N in the order 0 2 4 6 1 3 5 7; qzeros
  [K/G, N/8] the same; scales fp16 [K/G, N].
- compressed-tensors pack-quantized: weight_packed int32 [N, K/8] along K, low nibble
  first, each code + 8 (signed codes); weight_scale [N, K/G]; weight_zero_point (signed,
  asymmetric only) packed along N: int32 [N/8, K/G].
Ours: codes uint8 [N, K/G, G/2] (two codes a byte along K, low nibble first), scale and
minimum fp16 [N, K/G, 1]. GPTQ's and compressed-tensors' words are ours as bytes (a
transpose); AWQ's are unpacked and packed again.

FP8 block-scaled checkpoints (DeepSeek's, Kimi's) are read by `fp8_checkpoint`, per
tensor, into our fp8 format (`kernels.fp8`).

Act order (GPTQ desc_act, compressed-tensors actorder) is read where its g_idx keeps
groups in order, and refused where it permutes channels across groups (our groups are
consecutive input channels: the matmul would need the activations permuted).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from offload.core import hf_config
from offload.core.config import SUPPORTED_MODEL_TYPES, ModelConfig
from offload.core.errors import UserError
from offload.kernels.formats import Compression
from offload.kernels.quant import QTensor, is_quantized, pack_int4
from offload.models import family_names, fp8_checkpoint

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column of nibble i of an AWQ word
METHODS = ("gptq", "awq", "compressed-tensors int4", "fp8 with 128 x 128 block scales")
ORIGINAL = (
    "use the model's unquantized (bf16/fp16) checkpoint; --compress int4 or int8 then "
    "quantizes it here"
)


class Reader(Protocol):
    def has(self, name: str) -> bool: ...

    def get(self, name: str) -> torch.Tensor: ...


@dataclass(frozen=True)
class QuantFormat:
    """A checkpoint's quantization: the method, our format for it, GPTQ's zero offset
    (v1 stores zero - 1) and whether the scheme is symmetric."""

    method: str
    compression: Compression
    zero_offset: int = 0
    symmetric: bool = False


def format_of(directory: Path) -> QuantFormat | None:
    """The quantization of the checkpoint in `directory` (None: none)."""
    try:
        hf = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None  # resolving the model reports a missing or broken config.json
    if hf.get("model_type") in SUPPORTED_MODEL_TYPES:  # tie_word_embeddings: the class's
        hf = hf_config.with_defaults(hf)
    return read_format(hf)


def read_format(hf: dict[str, Any]) -> QuantFormat | None:
    """The quantization a config.json declares (None: none); a format whose math is
    not ours is refused, naming the fix."""
    qc = hf.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "mxfp4":  # gpt-oss's experts, read as they are (`models.mxfp4`)
        if hf.get("model_type") != "gpt_oss":
            raise UserError(
                f"an MXFP4 checkpoint of a {hf.get('model_type')!r} model is not read "
                f"(offload reads gpt_oss's MXFP4 experts); {ORIGINAL}"
            )
        return None
    readers = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed_tensors, "fp8": _fp8}
    if method not in readers:
        raise UserError(
            f"checkpoint is quantized with {method!r}, which offload does not read "
            f"(it reads {', '.join(METHODS)}); {ORIGINAL}"
        )
    fmt = readers[method](qc)
    if fmt.compression.head and hf.get("tie_word_embeddings", False):
        raise UserError(
            f"{method} checkpoint with a quantized LM head tied to the embedding is not "
            "supported; use one that leaves lm_head unquantized"
        )
    return fmt


def _ours(group: int, symmetric: bool, head: bool) -> Compression:
    """Our format for a checkpoint's: asymmetric with the minimum -8 x scale where it is
    symmetric, with zero points where not (the module doc)."""
    return Compression(4, group, False, head=head, zero_point=not symmetric)


def _group(method: str, group: Any) -> int:
    if not isinstance(group, int) or group < 2 or group % 2:
        raise UserError(
            f"{method} group_size {group!r} is not supported: our int4 format has groups "
            f"of an even number of input channels (per-channel, -1, is not one); {ORIGINAL}"
        )
    return group


def _bits(method: str, bits: Any) -> None:
    if bits != 4:
        raise UserError(
            f"{method} checkpoints of {bits} bits are not supported (4 are); {ORIGINAL}"
        )


def _gptq(qc: dict[str, Any]) -> QuantFormat:
    _bits("GPTQ", qc.get("bits"))
    group = _group("GPTQ", qc.get("group_size"))
    version = qc.get("checkpoint_format", "gptq")
    if version not in ("gptq", "gptq_v2"):
        raise UserError(f"GPTQ checkpoint_format {version!r} is not supported (gptq, gptq_v2 are)")
    symmetric = bool(qc.get("sym", True))
    head = bool(qc.get("lm_head", False))
    return QuantFormat("gptq", _ours(group, symmetric, head),
                       1 if version == "gptq" else 0, symmetric)  # fmt: skip


def _awq(qc: dict[str, Any]) -> QuantFormat:
    _bits("AWQ", qc.get("bits", qc.get("w_bit")))
    group = _group("AWQ", qc.get("group_size", qc.get("q_group_size")))
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise UserError(
            f"AWQ version {version!r} is not supported: its packing differs from GEMM's, "
            "the one offload reads; use the model's AWQ GEMM checkpoint"
        )
    if not qc.get("zero_point", True):
        raise UserError("AWQ without zero points is not supported; use a zero-point checkpoint")
    return QuantFormat("awq", _ours(group, False, head=False))


def _fp8(qc: dict[str, Any]) -> QuantFormat:
    return QuantFormat("fp8", fp8_checkpoint.compression(qc), symmetric=True)


def _compressed_tensors(qc: dict[str, Any]) -> QuantFormat:
    fmt = qc.get("format")
    groups = list((qc.get("config_groups") or {}).values())
    if fmt != "pack-quantized" or not groups:
        raise UserError(
            f"compressed-tensors format {fmt!r} is not supported (pack-quantized int4 "
            f"weights are: fp8, int8 and sparse formats are other math); {ORIGINAL}"
        )
    schemes = {str(g.get("weights")) for g in groups}
    if len(schemes) > 1:
        raise UserError(
            "compressed-tensors checkpoints with several weight schemes are not supported"
        )
    weights, group = groups[0].get("weights") or {}, groups[0]
    if group.get("input_activations") or group.get("output_activations"):
        raise UserError(
            "compressed-tensors activation quantization (W4A8 and the like) is not "
            "supported: offload computes with fp16/bf16 activations; use a weight-only checkpoint"
        )
    if weights.get("type", "int") != "int" or weights.get("dynamic"):
        raise UserError(
            f"compressed-tensors weight type {weights.get('type')!r} is not int4; {ORIGINAL}"
        )
    _bits("compressed-tensors", weights.get("num_bits"))
    if weights.get("strategy") != "group":
        raise UserError(
            f"compressed-tensors strategy {weights.get('strategy')!r} is not supported: "
            f"our int4 format is group-wise; {ORIGINAL}"
        )
    size = _group("compressed-tensors", weights.get("group_size"))
    symmetric = bool(weights.get("symmetric", True))
    head = not any("lm_head" in name for name in qc.get("ignore") or [])
    return QuantFormat("compressed-tensors", _ours(size, symmetric, head), symmetric=symmetric)


# -- one module's matrix ----------------------------------------------------------------
def reads(reader: Reader, fmt: QuantFormat, canon: str, names: list[str], shape) -> bool:
    """Whether `load_matrix` reads the canonical tensor: a matrix of the format, or (fp8,
    per tensor) any tensor stored in fp8, read dequantized."""
    if is_quantized(canon, tuple(shape), fmt.compression):
        return True
    return fmt.method == "fp8" and fp8_checkpoint.stored_fp8(reader, names)


def quantized(reader: Reader, module: str, fmt: QuantFormat) -> bool:
    """Whether the checkpoint holds `module` quantized (else its dense .weight)."""
    packed = ".weight_packed" if fmt.method == "compressed-tensors" else ".qweight"
    return reader.has(module + packed)


def load_matrix(reader: Reader, cfg: ModelConfig, fmt: QuantFormat, canon: str,
                names: list[str], shape: tuple[int, ...]) -> QTensor | torch.Tensor:  # fmt: skip
    """The canonical matrix `canon` [N, K] in our format from the checkpoint's modules
    `names` (their .weight names), concatenated along N (fused qkv, gate | up); an fp8
    checkpoint's tensor not all in fp8, or not a layer matrix, as float32 values."""
    if fmt.method == "fp8":
        matrix = is_quantized(canon, tuple(shape), fmt.compression)
        q = fp8_checkpoint.load(reader, fmt.compression, names, matrix)
        if family_names.grouped_qkv(cfg) and canon.startswith("qkv."):
            reorder = lambda t: family_names.grouped_qkv_to_blocks(t, cfg)  # noqa: E731
            q = rows_reordered(q, reorder) if isinstance(q, QTensor) else reorder(q)
        if tuple(q.shape) != tuple(shape):
            raise UserError(f"{names[0]}: shape {tuple(q.shape)}, config.json implies {shape}")
        return q
    modules = [name.removesuffix(".weight") for name in names]
    dense = [m for m in modules if not quantized(reader, m, fmt)]
    if dense:
        raise UserError(
            f"{dense[0]} is not quantized in this {fmt.method} checkpoint, while the other "
            "layer matrices are; checkpoints that leave some layer matrices unquantized "
            "are not supported"
        )
    q = concat([load(reader, m, fmt, shape[1]) for m in modules])
    if family_names.grouped_qkv(cfg) and canon.startswith("qkv."):
        q = rows_reordered(q, lambda t: family_names.grouped_qkv_to_blocks(t, cfg))
    if q.shape != tuple(shape):
        raise UserError(f"{modules[0]}: quantized shape {q.shape}, config.json implies {shape}")
    return q


def load(reader: Reader, module: str, fmt: QuantFormat, in_features: int) -> QTensor:
    """Module `module`'s matrix [N, in_features] in our format."""
    assert sys.byteorder == "little", "the int32 words are read as their bytes"
    group = fmt.compression.group_size
    if in_features % group:
        raise UserError(f"{module}: {in_features} input channels are not groups of {group}")
    if fmt.method == "gptq":
        codes, zeros, scales = _gptq_parts(reader, module, fmt, in_features, group)
    elif fmt.method == "awq":
        codes, zeros, scales = _awq_parts(reader, module)
    else:
        codes, zeros, scales = _ct_parts(reader, module, fmt, in_features)
    out_features, groups = scales.shape[0], in_features // group
    shape = (out_features, groups)
    if tuple(scales.shape) != shape or tuple(zeros.shape) != shape:
        raise UserError(f"{module}: group parameters {tuple(scales.shape)}, expected {shape}")
    if scales.dtype != torch.float16:
        exact = scales.to(torch.float16)
        if not torch.equal(exact.to(scales.dtype), scales):
            raise UserError(f"{module}: scales in {scales.dtype} are not exact in float16")
        scales = exact
    if fmt.compression.zero_point:
        minimum = zeros.to(torch.float16)  # integers up to 16: exact
    elif bool((zeros == 8).all()):
        minimum = scales * -8.0  # exact: a power of two
    else:
        raise UserError(f"{module}: a symmetric {fmt.method} checkpoint with zeros other than 8")
    return QTensor(
        codes.reshape(out_features, groups, group // 2).contiguous(),
        scales.reshape(*shape, 1).contiguous(),
        minimum.reshape(*shape, 1).contiguous(),
        (out_features, in_features),
        torch.float16,
        fmt.compression,
    )


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., W] -> their 8 nibbles [..., W * 8], low first (uint8)."""
    data = words.contiguous().view(torch.uint8)
    return torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2)


def _sequential_groups(reader: Reader, name: str, in_features: int, group: int) -> None:
    if not reader.has(name):
        return
    g_idx = reader.get(name).long()
    if not torch.equal(g_idx, torch.arange(in_features) // group):
        raise UserError(
            f"{name} is act-order (desc_act): it groups input channels out of order, and "
            "our int4 groups are consecutive channels; use a checkpoint quantized with "
            "desc_act=false (or static groups)"
        )


def _gptq_parts(reader: Reader, module: str, fmt: QuantFormat, in_features: int, group: int):
    _sequential_groups(reader, module + ".g_idx", in_features, group)
    qweight = reader.get(module + ".qweight")  # [K/8, N]: the bytes are ours, transposed
    rows, n = qweight.shape
    codes = qweight.contiguous().view(torch.uint8).view(rows, n, 4).permute(1, 0, 2)
    zeros = _nibbles(reader.get(module + ".qzeros")).to(torch.int16) + fmt.zero_offset
    return codes.reshape(n, rows * 4), zeros.t(), reader.get(module + ".scales").t()


def _awq_parts(reader: Reader, module: str):
    order = torch.tensor(AWQ_ORDER).argsort()  # nibble of each column of a word

    def natural(words: torch.Tensor) -> torch.Tensor:
        nibbles = _nibbles(words).view(words.shape[0], -1, 8)
        return nibbles[..., order].reshape(words.shape[0], -1)

    codes = natural(reader.get(module + ".qweight")).t()  # [N, K]
    zeros = natural(reader.get(module + ".qzeros")).t()
    return pack_int4(codes.contiguous()), zeros, reader.get(module + ".scales").t()


def _ct_parts(reader: Reader, module: str, fmt: QuantFormat, in_features: int):
    _sequential_groups(reader, module + ".weight_g_idx", in_features, fmt.compression.group_size)
    out_features, stored_in = reader.get(module + ".weight_shape").tolist()
    if stored_in != in_features:
        raise UserError(f"{module}.weight_shape has {stored_in} inputs, expected {in_features}")
    codes = reader.get(module + ".weight_packed").contiguous().view(torch.uint8)  # ours
    scales = reader.get(module + ".weight_scale")
    zeros = torch.full(scales.shape, 8, dtype=torch.int16)  # the codes' offset
    if not fmt.symmetric:  # signed zero points packed along N, + 8 like the codes
        packed = reader.get(module + ".weight_zero_point")
        signed = _nibbles(packed.t()).to(torch.int16)[:, :out_features].t() - 8
        zeros = zeros + signed
    return codes, zeros, scales


def concat(parts: list[QTensor]) -> QTensor:
    """Matrices stacked along their output channels (fused qkv, gate | up)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    out_features = sum(p.shape[0] for p in parts)
    return QTensor(
        torch.cat([p.codes for p in parts]),
        torch.cat([p.scale for p in parts]),
        torch.cat([p.minimum for p in parts]),
        (out_features, first.shape[1]),
        first.dtype,
        first.config,
    )


def rows_reordered(q: QTensor, reorder) -> QTensor:
    """q with its output channels rearranged by `reorder` (a function of a tensor whose
    first dimension is the output channels)."""
    return QTensor(reorder(q.codes), reorder(q.scale), reorder(q.minimum), q.shape,
                   q.dtype, q.config)  # fmt: skip


def to(q: QTensor | torch.Tensor, dtype: torch.dtype, device: torch.device):
    """q on device, computing in dtype (its stored parts unchanged); a tensor's values
    in dtype."""
    if isinstance(q, torch.Tensor):
        return q.to(device=device, dtype=dtype)
    move = (lambda t: t.to(device)) if q.codes.device != torch.device(device) else (lambda t: t)
    minimum = None if q.minimum is None else move(q.minimum)  # fp8 has none
    return QTensor(move(q.codes), move(q.scale), minimum, q.shape, dtype, q.config)
