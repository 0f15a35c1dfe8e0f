"""Tiny pre-quantized checkpoints written by hand in the layouts GPTQ (auto-gptq,
gptqmodel, optimum), AutoAWQ (GEMM) and compressed-tensors (pack-quantized) write, from
a transformers model quantized group-wise here, with the matching quantization_config;
and that model with the dequantized weights ((code - zero) x scale, exact in float32),
transformers' own class: the reference.

The packing here is written from the formats' definitions, apart from the reading code
in `offload.models.prequant`: the test compares two implementations of each layout."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.tiny_models import save_byte_tokenizer

GROUP = 32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def quantize(w: torch.Tensor, symmetric: bool, min_zero: int = 0, scale_dtype=torch.float16):
    """codes [N, K] in 0..15, zeros [N, K/G], fp16 scales [N, K/G] of w [N, K] (zero 8
    when symmetric); min_zero: the smallest zero (GPTQ v1 cannot store 0); scale_dtype:
    the checkpoint's (bfloat16 scales are exact in float16)."""
    n, k = w.shape
    groups = w.float().reshape(n, k // GROUP, GROUP)
    if symmetric:
        scales = (groups.abs().amax(-1) / 7.5).to(scale_dtype).to(torch.float16)
        zeros = torch.full(scales.shape, 8)
    else:
        low, high = groups.amin(-1), groups.amax(-1)
        scales = ((high - low) / 15).to(scale_dtype).to(torch.float16)
        zeros = (-low / scales.float()).round().clamp(min_zero, 15).long()
    s = scales.float()[..., None]
    codes = (groups / s + zeros[..., None]).round().clamp(0, 15).long()
    return codes.reshape(n, k), zeros, scales


def dequantized(codes, zeros, scales) -> torch.Tensor:
    n, k = codes.shape
    grouped = codes.reshape(n, k // GROUP, GROUP).float() - zeros[..., None].float()
    return (grouped * scales.float()[..., None]).reshape(n, k)


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8 W] values in 0..15 -> int32 words [..., W], value i at bits 4 i."""
    shifted = nibbles.long().reshape(*nibbles.shape[:-1], -1, 8) << (4 * torch.arange(8))
    words = shifted.sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _gptq(codes, zeros, scales, v1: bool) -> dict[str, torch.Tensor]:
    n, k = codes.shape
    return {
        "qweight": _words(codes.t().reshape(k // 8, 8, n).transpose(1, 2)).squeeze(-1),
        "qzeros": _words((zeros - int(v1)).t() & 0xF),  # [K/G, N/8]
        "scales": scales.t().contiguous(),
        "g_idx": (torch.arange(k) // GROUP).to(torch.int32),
    }


def _awq(codes, zeros, scales) -> dict[str, torch.Tensor]:
    def interleaved(values: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, N/8]
        rows = values.shape[0]
        return _words(values.reshape(rows, -1, 8)[..., list(AWQ_ORDER)].reshape(rows, -1))

    return {
        "qweight": interleaved(codes.t()),
        "qzeros": interleaved(zeros.t()),
        "scales": scales.t().contiguous(),
    }


def _compressed_tensors(codes, zeros, scales, symmetric: bool) -> dict[str, torch.Tensor]:
    n, k = codes.shape
    # signed codes (code - 8) stored + 8: the codes themselves; bf16 scales (exact in fp16)
    out = {
        "weight_packed": _words(codes),
        "weight_scale": scales.to(torch.bfloat16),
        "weight_shape": torch.tensor([n, k]),
    }
    if not symmetric:  # signed zero points (zero - 8), + 8, packed along N
        out["weight_zero_point"] = _words(zeros.t()).t().contiguous()
    return out


def _config(method: str, symmetric: bool) -> dict:
    if method.startswith("gptq"):
        return {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": GROUP,
            "desc_act": False,
            "sym": symmetric,
            "checkpoint_format": "gptq_v2" if method == "gptq-v2" else "gptq",
        }
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
                "version": "gemm"}  # fmt: skip
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group",
               "group_size": GROUP, "dynamic": False, "actorder": None}  # fmt: skip
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}
        },
        "ignore": ["lm_head"],
    }


def write(model: torch.nn.Module, directory: Path, method: str, symmetric: bool):
    """The model's layer matrices quantized and written as `method` ("gptq" (v1),
    "gptq-v2", "awq", "compressed-tensors") under directory; returns the reference
    (a copy of the model computing with the dequantized weights)."""
    reference = copy.deepcopy(model)
    params = dict(reference.named_parameters())
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        module = name.removesuffix(".weight")
        in_layer = ".layers." in name or ".h." in name
        if not (in_layer and name.endswith(".weight") and tensor.dim() == 2):
            tensors[name] = tensor.contiguous()
            continue
        scale_dtype = torch.bfloat16 if method == "compressed-tensors" else torch.float16
        codes, zeros, scales = quantize(tensor, symmetric, int(method == "gptq"), scale_dtype)
        with torch.no_grad():
            params[name].copy_(dequantized(codes, zeros, scales))
        if method.startswith("gptq"):
            parts = _gptq(codes, zeros, scales, v1=method == "gptq")
        elif method == "awq":
            parts = _awq(codes, zeros, scales)
        else:
            parts = _compressed_tensors(codes, zeros, scales, symmetric)
        tensors.update({f"{module}.{key}": value for key, value in parts.items()})
    directory.mkdir(parents=True)
    save_file(tensors, directory / "model.safetensors")
    config = model.config.to_dict()
    config["quantization_config"] = _config(method, symmetric)
    (directory / "config.json").write_text(json.dumps(config))
    save_byte_tokenizer(directory)  # (a real checkpoint ships its tokenizer)
    return reference
