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
from offload.models import family_names, gpt_oss, prequant
from offload.models.shapes import Part, Parts, Weights
from offload.models.weights import WeightSource

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# the largest header a safetensors file may have (the format's own limit: 100 MB)
MAX_HEADER_BYTES = 100_000_000

# canonical name -> HF names (concatenated along dim 0) for one stage, per family.
NameMap = dict[str, list[str]]


def _hf_names(cfg: ModelConfig, stage: str, index: int) -> NameMap:
    if cfg.family == "falcon":
        return family_names.falcon(cfg, stage, index)
    if cfg.family in ("llama", "gemma"):
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
        if cfg.num_experts and stage == "layer":
            layer.update(family_names.moe(cfg, index))
        if cfg.kv_lora_rank and stage == "layer":  # latent attention's own projections
            del layer["qkv"]
            layer.update(family_names.mla(cfg, index))
        if cfg.model_type == "gpt_oss" and stage == "layer":
            layer.update(gpt_oss.layer_names(index))
        stages = {"embed": embed, "layer": layer, "head": head}
        return family_names.llama_variant(cfg, stage, index, stages[stage])
    if cfg.family == "bloom":
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


def _weight_map(directory: Path) -> dict[str, str] | None:
    """The index's tensor -> shard file map (None: a single model.safetensors)."""
    index_path, single = directory / INDEX_FILE, directory / SINGLE_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise UserError(
                f"{index_path} is not a safetensors index ({type(exc).__name__}: {exc}); "
                "download it again"
            ) from None
        return weight_map
    if single.is_file():
        return None
    raise UserError(
        f"{directory} has no {SINGLE_FILE} or {INDEX_FILE}; only safetensors "
        "checkpoints are supported (re-save with save_pretrained(safe_serialization=True))"
    )


def check_shards(directory: Path) -> None:
    """Before any weight is read: every file the checkpoint names (each shard of the
    index, or model.safetensors) is there, and as long as its own header says (8 bytes
    of header length, the JSON header, then the tensors up to the largest end offset).
    A shard found missing or cut at the layer that reads it would fail a load of minutes
    (or hours of a job) there; its header costs one small read."""
    weight_map = _weight_map(directory)
    files = [SINGLE_FILE] if weight_map is None else sorted(set(weight_map.values()))
    missing = [name for name in files if not (directory / name).is_file()]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UserError(
            f"checkpoint {directory} is missing {missing[0]}{more} ({len(missing)} of "
            f"{len(files)} files named by {INDEX_FILE}); download the missing files again"
        )
    for name in files:
        path = directory / name
        size, expected = path.stat().st_size, _size_from_header(path)
        if size != expected:
            cut = "truncated" if size < expected else "longer than its header says (damaged)"
            raise UserError(
                f"{path} is {size} bytes but its header describes {expected}: the file is "
                f"{cut}; download it again"
            )


def _size_from_header(path: Path) -> int:
    """The bytes a safetensors file holds by its own header."""
    with path.open("rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(MAX_HEADER_BYTES, path.stat().st_size - 8):
            raise UserError(f"{path} is not a safetensors file (no header); download it again")
        try:
            header = json.loads(f.read(length))
            ends = [
                entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"
            ]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, IndexError) as exc:
            raise UserError(f"{path} has a damaged header ({exc}); download it again") from None
    return 8 + length + max(ends, default=0)


class SafetensorsReader:
    """Lazy tensor access to a single or sharded safetensors checkpoint directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        check_shards(directory)
        weight_map = _weight_map(directory)
        if weight_map is None:
            weight_map = {name: SINGLE_FILE for name in self._keys(directory / SINGLE_FILE)}
        self._file_of = weight_map
        self._handles: dict[str, object] = {}
        self.bytes_read = 0  # tensor bytes handed out (whole tensors and slices)
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
        return mapping | family_names.language_model_prefix(names)

    def stored_name(self, name: str) -> str:
        for full, short in self._prefix.items():
            if name.startswith(full):
                return short + name[len(full) :]
        return name

    def has(self, name: str) -> bool:
        return self.stored_name(name) in self._file_of

    def _slice(self, name: str):
        """safetensors' lazy slice of a tensor (nothing read yet), and the file's path."""
        stored = self.stored_name(name)
        file_name = self._file_of[stored]
        handle = self._handles.get(file_name)
        path = self.directory / file_name
        try:
            if handle is None:
                handle = safe_open(str(path), framework="pt")
                self._handles[file_name] = handle
            return handle.get_slice(stored), path
        except (SafetensorError, OSError) as exc:
            raise UserError(
                f"cannot read tensor {stored} from {path}: {exc}; the file is damaged or truncated"
            ) from exc

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name)[0].get_shape())

    def get(self, name: str, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The tensor, or its rows (dim 0) or columns (dim 1) [start, stop): only those
        bytes are read (`bytes_read` counts what was handed out)."""
        piece, path = self._slice(name)
        stop = piece.get_shape()[dim] if stop is None else stop
        try:
            tensor = piece[start:stop] if dim == 0 else piece[:, start:stop]
        except (SafetensorError, OSError) as exc:
            raise UserError(
                f"cannot read tensor {self.stored_name(name)} from {path}: {exc}; the file "
                "is damaged or truncated"
            ) from exc
        self.bytes_read += tensor.nbytes
        return tensor

    def close(self) -> None:
        """Drop open files; their mapped pages leave this process's RSS."""
        self._handles.clear()


class CheckpointSource(WeightSource):
    """A Hugging Face model directory (config.json + safetensors)."""

    makes_tensors_alone = True

    def __init__(self, directory: Path, config: ModelConfig) -> None:
        self.config = config
        self.reader = SafetensorsReader(directory)
        self.quant = prequant.format_of(directory)  # GPTQ, AWQ, compressed-tensors, fp8

    def stored_stage(
        self, stage: str, index: int, dtype: torch.dtype, device: torch.device
    ) -> Weights:
        return self.stored_parts(stage, index, dtype, device, {})

    def stored_named(
        self, stage: str, index: int, names: list[str], dtype: torch.dtype, device: torch.device
    ) -> Weights:
        return self.stored_parts(stage, index, dtype, device, {}, names)

    def stored_parts(
        self,
        stage: str,
        index: int,
        dtype: torch.dtype,
        device: torch.device,
        parts: Parts,
        only: list[str] | None = None,
    ) -> Weights:
        """Each tensor whole, or only the rows or columns of its part (slices of the
        files: a tensor-parallel rank reads its share of the checkpoint); only: just
        these tensors."""
        wanted = self.stored_shapes(stage, index)
        if only is not None:
            wanted = {name: wanted[name] for name in only}
        out: Weights = {}
        try:
            if self.config.model_type == "gpt_oss" and stage == "layer":  # fused experts
                out.update(self._gpt_oss_experts(index, wanted, dtype, device))
                wanted = {n: s for n, s in wanted.items() if n not in out}
            names = _expand(_hf_names(self.config, stage, index), wanted)
            for canon, hf_names in names.items():
                shape = wanted[canon]
                if self.quant is not None and prequant.reads(self.reader, self.quant, canon, hf_names, shape):  # fmt: skip
                    assert canon not in parts, "a pre-quantized checkpoint is read whole (no --tp)"
                    q = prequant.load_matrix(self.reader, self.config, self.quant, canon, hf_names, shape)  # fmt: skip
                    out[canon] = prequant.to(q, dtype, device)
                    continue
                self._check_present(canon, hf_names, stage)
                part = parts.get(canon, Part(0, ((0, shape[0]),)))
                out[canon] = self._load(canon, hf_names, shape, part, dtype, device)
        finally:
            # safetensors maps shards; closing after each stage keeps the touched pages
            # of earlier stages out of RSS, so it stays near one layer.
            self.reader.close()
        return out

    def _gpt_oss_experts(self, index: int, wanted, dtype, device) -> Weights:
        experts = gpt_oss.read_experts(self.reader, self.config, index, dtype, device)
        experts = {name: t for name, t in experts.items() if name in wanted}
        for name, tensor in experts.items():
            if tuple(tensor.shape) != wanted[name]:
                raise UserError(
                    f"layer {index}'s expert tensor {name} in {self.reader.directory} has "
                    f"shape {tuple(tensor.shape)}, config.json implies {wanted[name]}"
                )
        return experts

    def _check_present(self, canon: str, hf_names: list[str], stage: str) -> None:
        missing = [n for n in hf_names if not self.reader.has(n)]
        if missing:
            raise UserError(
                f"checkpoint {self.reader.directory} lacks tensor {missing[0]} "
                f"({stage} weight {canon}); is it a {self.config.model_type} checkpoint?"
            )

    def _load(
        self,
        canon: str,
        hf_names: list[str],
        shape: tuple[int, ...],
        part: Part,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        stored = self._stored_shape(hf_names)
        if stored != shape:
            raise UserError(
                f"tensor {hf_names[0]} in {self.reader.directory} has shape {stored}, "
                f"config.json implies {shape}"
            )
        if part.zeros:
            return torch.zeros(shape, dtype=dtype, device=device)
        pieces = [p for start, stop in part.ranges for p in self._range(canon, hf_names, part.dim, start, stop)]  # fmt: skip
        tensor = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=part.dim)
        return tensor.to(device=device, dtype=dtype)

    def _stored_shape(self, hf_names: list[str]) -> tuple[int, ...]:
        shapes = [self.reader.shape(n) for n in hf_names]
        return (sum(s[0] for s in shapes), *shapes[0][1:])

    def _range(
        self, canon: str, hf_names: list[str], dim: int, start: int, stop: int
    ) -> list[torch.Tensor]:
        """Rows (dim 0) or columns (dim 1) [start, stop) of the canonical tensor, which is
        the checkpoint's tensors one under the other (BLOOM's qkv: its heads reordered),
        as the pieces the files hold."""
        read = self.reader.get
        if dim == 1:
            return [torch.cat([read(n, 1, start, stop) for n in hf_names])]
        if family_names.grouped_qkv(self.config) and canon.startswith("qkv."):
            return self._grouped_qkv_rows(hf_names[0], start, stop)
        pieces, offset = [], 0
        for name in hf_names:
            rows = self.reader.shape(name)[0]
            lo, hi = max(start, offset), min(stop, offset + rows)
            if lo < hi:
                pieces.append(read(name, 0, lo - offset, hi - offset))
            offset += rows
        return pieces

    def _grouped_qkv_rows(self, name: str, start: int, stop: int) -> list[torch.Tensor]:
        """Canonical qkv rows [start, stop) from a layout grouped per KV head
        (`family_names.grouped_qkv`: each group its query heads, its key, its value): the
        whole tensor in one read, reordered; a part a read a head."""
        cfg = self.config
        if (start, stop) == (0, cfg.qkv_out_features):
            return [family_names.grouped_qkv_to_blocks(self.reader.get(name), cfg)]
        dim, per_group = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
        q_rows, kv_rows = cfg.num_heads * dim, cfg.num_kv_heads * dim
        pieces, at = [], start
        while at < stop:
            if at < q_rows:  # q: head h is the (h % per_group)-th of group h // per_group
                head, offset = divmod(at, dim)
                group, slot, block_end = head // per_group, head % per_group, q_rows
            else:  # k, then v: one head a group, after the group's query heads
                block, row = divmod(at - q_rows, kv_rows)
                (group, offset), slot = divmod(row, dim), per_group + block
                block_end = q_rows + (block + 1) * kv_rows
            end = min(stop, at + dim - offset, block_end)
            first = (group * (per_group + 2) + slot) * dim + offset
            pieces.append(self.reader.get(name, 0, first, first + end - at))
            at = end
        return pieces

    def close(self) -> None:
        self.reader.close()
