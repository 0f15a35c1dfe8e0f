"""gpt-oss checkpoints (`gpt_oss`): the tensor names beyond Llama's and the experts'
fused tensors, read into the canonical per-expert ones (`models.shapes`).

transformers' `GptOssExperts` keeps a layer's experts in four fused tensors:
`mlp.experts.gate_up_proj` [E, hidden, 2I] (x @ W: columns are outputs, the gate and up
columns interleaved, gate first), `gate_up_proj_bias` [E, 2I] (interleaved the same),
`down_proj` [E, I, hidden] and `down_proj_bias` [E, hidden]. Expert e's canonical
mlp_in is its gate_up_proj transposed with the gate rows first, then the up rows
(`mxfp4.deinterleave_rows`); mlp_out is its down_proj transposed. The MXFP4 checkpoint
stores `gate_up_proj_blocks` [E, 2I, hidden / 32, 16] and `_scales` (rows are outputs
already: the same deinterleave on rows) and `down_proj_blocks` [E, hidden, I / 32, 16]:
they are read as they are (`models.mxfp4`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from offload.core.config import ModelConfig
from offload.core.errors import UserError
from offload.kernels.formats import MXFP4_BLOCKS, MXFP4_SCALES
from offload.models.mxfp4 import deinterleave_rows
from offload.models.shapes import expert_name

NameMap = dict[str, list[str]]


def layer_names(index: int) -> NameMap:
    """The names of a layer's tensors that Llama's and the MoE's maps do not give."""
    p = f"model.layers.{index}."
    return {
        "o.bias": [p + "self_attn.o_proj.bias"],
        "sinks": [p + "self_attn.sinks"],
        "router.weight": [p + "mlp.router.weight"],
        "router.bias": [p + "mlp.router.bias"],
    }


def is_expert(name: str) -> bool:
    return name.startswith("experts.")


class Reader(Protocol):  # the part of `checkpoint.SafetensorsReader` read here
    def has(self, name: str) -> bool: ...

    def get(self, name: str) -> torch.Tensor: ...


def read_experts(
    reader: Reader, cfg: ModelConfig, index: int, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """Layer `index`'s experts in canonical names: matrices in dtype (or as MXFP4 blocks
    and scales, uint8, where the checkpoint is), biases in dtype."""
    p = f"model.layers.{index}.mlp.experts."
    fused = {"mlp_in": p + "gate_up_proj", "mlp_out": p + "down_proj"}
    out: dict[str, torch.Tensor] = {}
    for matrix, hf in fused.items():
        interleaved = matrix == "mlp_in"
        parts = (MXFP4_BLOCKS, MXFP4_SCALES) if cfg.mxfp4_experts else (".weight",)
        for suffix in (*parts, ".bias"):
            stored = hf + {".weight": "", ".bias": "_bias"}.get(suffix, "_" + suffix[1:])
            if not reader.has(stored):
                raise UserError(
                    f"checkpoint lacks tensor {stored} (layer {index}'s experts); "
                    f"is it a gpt_oss checkpoint{' in MXFP4' if cfg.mxfp4_experts else ''}?"
                )
            tensor = reader.get(stored)
            if tensor.shape[0] != cfg.num_experts:
                raise UserError(
                    f"tensor {stored} has {tensor.shape[0]} experts, config.json {cfg.num_experts}"
                )
            for e in range(cfg.num_experts):
                t = tensor[e].T if suffix == ".weight" else tensor[e]
                if interleaved:
                    t = deinterleave_rows(t)
                if suffix not in (MXFP4_BLOCKS, MXFP4_SCALES):
                    t = t.to(dtype)
                name = expert_name(e, matrix).removesuffix(".weight") + suffix
                out[name] = t.to(device).contiguous()
    return out
