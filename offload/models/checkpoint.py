"""Hugging Face checkpoint directories: single or sharded safetensors, read lazily.

Each stage reads only its own tensors through `safe_open`, so memory stays near one
layer. Family-specific names map onto the canonical names of `decoder.py`; fused
layouts are rearranged here once (BLOOM's per-head interleaved query_key_value, q/k/v
and gate/up concatenated for one GEMM each).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from offload.core.config import ModelConfig
from offload.core.errors import UserError
from offload.models.shapes import Weights, expert_name
from offload.models.weights import WeightSource

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# canonical name -> HF names (concatenated along dim 0) for one stage, per family.
NameMap = dict[str, list[str]]


def _hf_names(cfg: ModelConfig, stage: str, index: int) -> NameMap:
    if cfg.family == "llama":
        p = f"model.layers.{index}."
        layer = {
            "attn_norm.weight": [p + "input_layernorm.weight"],
            "qkv": [p + f"self_attn.{n}_proj" for n in "qkv"],
            "o.weight": [p + "self_attn.o_proj.weight"],
            "mlp_norm.weight": [p + "post_attention_layernorm.weight"],
            "mlp_in.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
            "mlp_out.weight": [p + "mlp.down_proj.weight"],
        }
        embed = {"tok.weight": ["model.embed_tokens.weight"]}
        head = {"final_norm.weight": ["model.norm.weight"], "lm_head.weight": ["lm_head.weight"]}
        if cfg.num_experts:
            layer.update(_moe_names(cfg, p))
    elif cfg.family == "bloom":
        p = f"transformer.h.{index}."
        layer = {
            "attn_norm": [p + "input_layernorm"],
            "qkv": [p + "self_attention.query_key_value"],
            "o": [p + "self_attention.dense"],
            "mlp_norm": [p + "post_attention_layernorm"],
            "mlp_in": [p + "mlp.dense_h_to_4h"],
            "mlp_out": [p + "mlp.dense_4h_to_h"],
        }
        embed = {
            "tok.weight": ["transformer.word_embeddings.weight"],
            "embed_norm": ["transformer.word_embeddings_layernorm"],
        }
        head = {"final_norm": ["transformer.ln_f"], "lm_head.weight": ["lm_head.weight"]}
    else:
        p = f"model.decoder.layers.{index}."
        layer = {
            "attn_norm": [p + "self_attn_layer_norm"],
            "qkv": [p + f"self_attn.{n}_proj" for n in "qkv"],
            "o": [p + "self_attn.out_proj"],
            "mlp_norm": [p + "final_layer_norm"],
            "mlp_in": [p + "fc1"],
            "mlp_out": [p + "fc2"],
        }
        embed = {
            "tok.weight": ["model.decoder.embed_tokens.weight"],
            "pos.weight": ["model.decoder.embed_positions.weight"],
            "proj_in.weight": ["model.decoder.project_in.weight"],
        }
        head = {
            "final_norm": ["model.decoder.final_layer_norm"],
            "proj_out.weight": ["model.decoder.project_out.weight"],
            "lm_head.weight": ["lm_head.weight"],
        }
    return {"embed": embed, "layer": layer, "head": head}[stage]


def _moe_names(cfg: ModelConfig, p: str) -> NameMap:
    """A mixture of experts' layer names (Mixtral's `block_sparse_moe` with w1 (gate), w3
    (up) and w2 (down); Qwen's and GLM-4.5's `mlp` with gate, up and down projections),
    as the hub's checkpoints and transformers' save_pretrained write them."""
    mixtral = cfg.model_type == "mixtral"
    block = p + ("block_sparse_moe." if mixtral else "mlp.")
    names: NameMap = {"router.weight": [block + "gate.weight"]}
    names["router.correction"] = [block + "gate.e_score_correction_bias"]
    shared = block + ("shared_expert." if cfg.model_type == "qwen2_moe" else "shared_experts.")
    names["shared.mlp_in.weight"] = [shared + "gate_proj.weight", shared + "up_proj.weight"]
    names["shared.mlp_out.weight"] = [shared + "down_proj.weight"]
    names["shared.gate.weight"] = [block + "shared_expert_gate.weight"]
    for e in range(cfg.num_experts):
        expert = f"{block}experts.{e}."
        gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        names[expert_name(e, "mlp_in")] = [f"{expert}{gate}.weight", f"{expert}{up}.weight"]
        names[expert_name(e, "mlp_out")] = [f"{expert}{down}.weight"]
    for which in "qk":
        names[f"{which}_norm.weight"] = [p + f"self_attn.{which}_norm.weight"]
    return names


def _expand(names: NameMap, wanted: dict[str, tuple[int, ...]]) -> NameMap:
    """Turn module entries ("qkv": [modules]) into tensor entries ("qkv.weight", ...)."""
    out: NameMap = {}
    for canon in wanted:
        module, _, suffix = canon.rpartition(".")
        if canon in names:
            out[canon] = names[canon]
        elif module in names:
            out[canon] = [f"{m}.{suffix}" for m in names[module]]
        else:
            raise AssertionError(f"no checkpoint name for {canon}")
    return out


def _bloom_qkv_to_blocks(t: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """BLOOM stores qkv per head as [H, 3, D, ...]; reorder to [q heads | k heads | v heads]."""
    rest = t.shape[1:]
    t = t.view(cfg.num_heads, 3, cfg.head_dim, *rest).transpose(0, 1)
    return t.reshape(3 * cfg.num_heads * cfg.head_dim, *rest)


class SafetensorsReader:
    """Lazy tensor access to a single or sharded safetensors checkpoint directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        index_path, single = directory / INDEX_FILE, directory / SINGLE_FILE
        if index_path.is_file():
            weight_map = json.loads(index_path.read_text())["weight_map"]
        elif single.is_file():
            weight_map = {name: SINGLE_FILE for name in self._keys(single)}
        else:
            raise UserError(
                f"{directory} has no {SINGLE_FILE} or {INDEX_FILE}; only safetensors "
                "checkpoints are supported (re-save with save_pretrained(safe_serialization=True))"
            )
        self._file_of = weight_map
        self._handles: dict[str, object] = {}
        self._prefix = self._detect_prefix()

    @staticmethod
    def _keys(path: Path) -> list[str]:
        try:
            with safe_open(str(path), framework="pt") as f:
                return list(f.keys())
        except (SafetensorError, OSError) as exc:
            raise UserError(f"cannot read {path}: {exc}; the file is damaged or truncated") from exc

    def _detect_prefix(self) -> dict[str, str]:
        # Some original checkpoints drop the wrapper prefix ("h.0..." for BLOOM,
        # "decoder.layers..." for OPT); map canonical HF names onto what is stored.
        names = self._file_of.keys()
        mapping = {}
        if not any(n.startswith("transformer.") for n in names):
            mapping["transformer."] = ""
        if any(n.startswith("decoder.") for n in names):
            mapping["model.decoder."] = "decoder."
        return mapping

    def stored_name(self, name: str) -> str:
        for full, short in self._prefix.items():
            if name.startswith(full):
                return short + name[len(full) :]
        return name

    def has(self, name: str) -> bool:
        return self.stored_name(name) in self._file_of

    def get(self, name: str) -> torch.Tensor:
        stored = self.stored_name(name)
        file_name = self._file_of[stored]
        handle = self._handles.get(file_name)
        path = self.directory / file_name
        try:
            if handle is None:
                handle = safe_open(str(path), framework="pt")
                self._handles[file_name] = handle
            return handle.get_tensor(stored)
        except (SafetensorError, OSError) as exc:
            raise UserError(
                f"cannot read tensor {stored} from {path}: {exc}; the file is damaged or truncated"
            ) from exc

    def close(self) -> None:
        """Drop open files; their mapped pages leave this process's RSS."""
        self._handles.clear()


class CheckpointSource(WeightSource):
    """A Hugging Face model directory (config.json + safetensors)."""

    def __init__(self, directory: Path, config: ModelConfig) -> None:
        self.config = config
        self.reader = SafetensorsReader(directory)

    def stored_stage(
        self, stage: str, index: int, dtype: torch.dtype, device: torch.device
    ) -> Weights:
        wanted = self.stored_shapes(stage, index)
        names = _expand(_hf_names(self.config, stage, index), wanted)
        out: Weights = {}
        try:
            for canon, hf_names in names.items():
                out[canon] = self._load(canon, hf_names, wanted[canon], stage, dtype, device)
        finally:
            # safetensors maps shards; closing after each stage keeps the touched pages
            # of earlier stages out of RSS, so it stays near one layer.
            self.reader.close()
        return out

    def _load(
        self,
        canon: str,
        hf_names: list[str],
        shape: tuple[int, ...],
        stage: str,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        missing = [n for n in hf_names if not self.reader.has(n)]
        if missing:
            raise UserError(
                f"checkpoint {self.reader.directory} lacks tensor {missing[0]} "
                f"({stage} weight {canon}); is it a {self.config.model_type} checkpoint?"
            )
        parts = [self.reader.get(n) for n in hf_names]
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if self.config.family == "bloom" and canon.startswith("qkv."):
            tensor = _bloom_qkv_to_blocks(tensor, self.config)
        if tuple(tensor.shape) != shape:
            raise UserError(
                f"tensor {hf_names[0]} in {self.reader.directory} has shape "
                f"{tuple(tensor.shape)}, config.json implies {shape}"
            )
        return tensor.to(device=device, dtype=dtype)

    def close(self) -> None:
        self.reader.close()
