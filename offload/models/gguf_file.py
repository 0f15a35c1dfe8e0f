"""GGUF files (llama.cpp's format) through the `gguf` package.

The file is memory-mapped; each stage dequantizes only its own tensors to the run's
dtype. llama.cpp stores Llama's q/k projection rows permuted for its own RoPE layout;
that permutation is undone here so the math is Hugging Face's. The tokenizer comes
from the GGUF metadata through transformers' GGUF support.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from offload.config import ModelConfig
from offload.errors import UserError
from offload.models.decoder import Weights
from offload.models.weights import WeightSource

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def open_gguf(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as exc:
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
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    hf = {
        "model_type": arch,
        "vocab_size": int(_field(reader, f"{arch}.vocab_size", len(tokens))),
        "hidden_size": hidden,
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
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
        wanted = self.stored_shapes(stage)
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
