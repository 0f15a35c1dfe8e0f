"""GGUF files (llama.cpp's format): the header read here, the tensors through the `gguf`
package's dequantizers.

The file is memory-mapped; each stage dequantizes only its own tensors to the run's
dtype. llama.cpp stores Llama's q/k projection rows permuted for its own RoPE layout;
that permutation is undone here so the math is Hugging Face's. The tokenizer comes
from the GGUF metadata through transformers' GGUF support.

The header (`GGUFHeader`) is read with `struct` rather than `gguf.GGUFReader`, which
decodes every element of every array into numpy objects on open: the demo model's
49152-token vocabulary and 48900 merges took 4.5 s of its 13 s command on the 2-core
machine. Here an array of strings is stepped over and kept as its count (the config
needs no more; the tokenizer is built by transformers once and cached), in about 30 ms.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from offload.core.config import ModelConfig
from offload.core.errors import UserError
from offload.models.shapes import Weights
from offload.models.weights import WeightSource

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # the versions gguf's own reader reads
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types: struct formats of the scalars; 8 is a string, 9 an array
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
# arrays up to this many scalars are decoded; longer ones, and arrays of strings, are
# kept as their count
_DECODED_ARRAY = 64


@dataclass(frozen=True)
class GGUFArray:
    """An array value: its element type, its count, and its values where they are a few
    scalars (else None)."""

    element_type: int
    count: int
    values: tuple[Any, ...] | None = None

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class GGUFTensor:
    """A tensor of the file: `data` a view of the mapped file, shaped as `gguf`'s
    dequantizers take it (quantized types as bytes a row)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray


class GGUFHeader:
    """A GGUF file's metadata (`fields`: key -> value) and tensors, mapped (the format:
    a magic, version, tensor and key counts; the keys' typed values; each tensor's name,
    dimensions, type and offset; the data from the next multiple of general.alignment)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._map = np.memmap(path, mode="r")
        self._buf = memoryview(self._map)
        self._at = 0
        if bytes(self._buf[:4]) != GGUF_MAGIC:
            raise ValueError("no GGUF magic at its start")
        self._at = 4
        version = self._unpack("<I")
        if version not in GGUF_VERSIONS:
            raise ValueError(f"GGUF version {version} (big-endian, or not one of {GGUF_VERSIONS})")
        tensor_count, key_count = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(key_count):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        start = -(-self._at // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._buf, self._at)
        self._at += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        size = self._unpack("<Q")
        text = bytes(self._buf[self._at : self._at + size])
        if len(text) != size:
            raise ValueError("a string runs past the end of the file")
        self._at += size
        return text.decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind in _SCALAR:
            return self._unpack(_SCALAR[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        element, count = self._unpack("<I"), self._unpack("<Q")
        if element in _SCALAR:
            fmt = _SCALAR[element]
            size = struct.calcsize(fmt)
            values = None
            if count <= _DECODED_ARRAY:
                values = struct.unpack_from(f"<{count}{fmt[1:]}", self._buf, self._at)
            self._at += count * size
            if self._at > len(self._buf):
                raise ValueError("an array runs past the end of the file")
            return GGUFArray(element, count, values)
        for _ in range(count):  # strings (or arrays of arrays): stepped over
            self._value(element)
        return GGUFArray(element, count)

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
        return name, dims, self._unpack("<I"), self._unpack("<Q")

    def _tensor(self, start: int, name: str, dims: tuple[int, ...], kind: int, offset: int):
        import gguf

        tensor_type = gguf.GGMLQuantizationType(kind)
        block, type_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
        shape = tuple(reversed(dims))  # outermost first, as numpy's
        nbytes = int(np.prod(dims)) * type_bytes // block
        at = start + offset
        if at + nbytes > len(self._buf):
            raise ValueError(f"tensor {name} runs past the end of the file")
        data = self._map[at : at + nbytes]
        if tensor_type.name in _PLAIN_TYPES:
            data = data.view(_PLAIN_TYPES[tensor_type.name]).reshape(shape)
        else:
            data = data.reshape(gguf.quant_shape_to_byte_shape(shape, tensor_type))
        return GGUFTensor(name, tensor_type, data)


# tensor types stored as plain numbers (every other one is quantized blocks)
_PLAIN_TYPES = {
    "F32": np.float32, "F16": np.float16, "F64": np.float64,
    "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64,
}  # fmt: skip


def _field(reader: GGUFHeader, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def _required(reader: Any, key: str) -> Any:
    """A metadata value the config cannot do without: missing, refused naming it."""
    value = _field(reader, key)
    if value is None:
        raise UserError(
            f"GGUF file {reader.path} lacks the metadata key {key!r}; convert the model "
            "again, or use its safetensors checkpoint"
        )
    return value


def open_gguf(path: Path) -> GGUFHeader:
    try:
        return GGUFHeader(path)
    except (ValueError, OSError, IndexError, struct.error) as exc:
        raise UserError(f"cannot read GGUF file {path}: {exc}; is the file complete?") from exc


def gguf_config(reader: Any, name: str) -> ModelConfig:
    """Build a `ModelConfig` from GGUF metadata (llama and qwen2 architectures)."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UserError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise UserError("GGUF files with llama3 rope frequency tensors are not supported yet")
    if int(_field(reader, f"{arch}.expert_count", 0) or 0):
        raise UserError(
            "GGUF mixtures of experts are not supported; use the model's safetensors checkpoint"
        )
    heads = int(_required(reader, f"{arch}.attention.head_count"))
    hidden = int(_required(reader, f"{arch}.embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    hf = {
        "model_type": arch,
        "vocab_size": int(_field(reader, f"{arch}.vocab_size", len(tokens))),
        "hidden_size": hidden,
        "num_hidden_layers": int(_required(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "intermediate_size": int(_required(reader, f"{arch}.feed_forward_length")),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    return ModelConfig.from_hf(hf, name=name)


def _names(stage: str, index: int) -> dict[str, list[str]]:
    if stage == "embed":
        return {"tok.weight": ["token_embd.weight"]}
    if stage == "head":
        return {"final_norm.weight": ["output_norm.weight"], "lm_head.weight": ["output.weight"]}
    p = f"blk.{index}."
    return {
        "attn_norm.weight": [p + "attn_norm.weight"],
        "qkv.weight": [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"],
        "qkv.bias": [p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"],
        "o.weight": [p + "attn_output.weight"],
        "mlp_norm.weight": [p + "ffn_norm.weight"],
        "mlp_in.weight": [p + "ffn_gate.weight", p + "ffn_up.weight"],
        "mlp_out.weight": [p + "ffn_down.weight"],
    }


def _unpermute(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head (pairs -> halves) row permutation of q/k projections."""
    rows, rest = t.shape[0], t.shape[1:]
    return t.reshape(heads, rows // heads // 2, 2, *rest).transpose(1, 2).reshape(t.shape)


class GGUFSource(WeightSource):
    def __init__(self, path: Path, reader: Any, config: ModelConfig) -> None:
        self.path = path
        self.config = config
        self._reader = reader
        self._tensors = {t.name: t for t in reader.tensors}

    def _dequantized(self, name: str) -> torch.Tensor:
        import gguf

        tensor = self._tensors.get(name)
        if tensor is None:
            raise UserError(f"GGUF file {self.path} lacks tensor {name}")
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        return torch.from_numpy(np.array(values, dtype=np.float32))  # own, writable copy

    def stored_stage(
        self, stage: str, index: int, dtype: torch.dtype, device: torch.device
    ) -> Weights:
        cfg = self.config
        wanted = self.stored_shapes(stage, index)
        out: Weights = {}
        for canon, names in _names(stage, index).items():
            if canon not in wanted:
                continue
            parts = [self._dequantized(n) for n in names]
            if canon.startswith("qkv.") and cfg.model_type == "llama":
                parts[0] = _unpermute(parts[0], cfg.num_heads)
                parts[1] = _unpermute(parts[1], cfg.num_kv_heads)
            tensor = torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]
            if tuple(tensor.shape) != wanted[canon]:
                raise UserError(
                    f"GGUF tensor {names[0]} in {self.path} has shape {tuple(tensor.shape)}, "
                    f"its metadata implies {wanted[canon]}"
                )
            out[canon] = tensor.to(device=device, dtype=dtype)
        return out

    def close(self) -> None:
        self._tensors.clear()
