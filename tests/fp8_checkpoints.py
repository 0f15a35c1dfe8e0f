"""Tiny FP8 block-scaled checkpoints written as DeepSeek-V3 ships its own: each layer
matrix's `weight` in float8_e4m3fn with float32 `weight_scale_inv` over 128 x 128 blocks
(partial at the bottom and right edges), everything else in bfloat16, and the config's
quantization_config. Beside each, the same model's dense checkpoint holding the
dequantized values (float32), which transformers' own class loads: the reference.

The block arithmetic here is written from the format's definition, block by block,
apart from the reading code in `offload.models.fp8_checkpoint` and `offload.kernels.fp8`."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.tiny_models import save_byte_tokenizer

BLOCK = 128
E4M3_MAX = 448.0
QUANT_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}
# the layer matrices DeepSeek quantizes: attention and MLP projections, experts' w1-w3
QUANTIZED = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$|\.experts\.\d+\.w[123]\.weight$")


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn codes [N, K], float32 scale_inv [ceil(N/128), ceil(K/128)]) of w:
    each block's largest magnitude maps to e4m3's largest value."""
    n, k = w.shape
    codes = torch.empty((n, k), dtype=torch.float8_e4m3fn)
    scales = torch.empty((math.ceil(n / BLOCK), math.ceil(k / BLOCK)), dtype=torch.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            block = w[rows, cols].float()
            scales[i, j] = block.abs().max().clamp(min=1e-12) / E4M3_MAX
            codes[rows, cols] = (block / scales[i, j]).clamp(-E4M3_MAX, E4M3_MAX).to(codes.dtype)
    return codes, scales


def dequantized(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The documented value, block by block: weight.float() x scale_inv, in float32."""
    out = torch.empty(codes.shape, dtype=torch.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            out[rows, cols] = codes[rows, cols].float() * scales[i, j]
    return out


def write(model: torch.nn.Module, directory: Path, dense: Path) -> dict[str, torch.Tensor]:
    """`model` as an FP8 checkpoint in `directory` and its dequantized values as a dense
    float32 checkpoint in `dense`; returns the dequantized values by tensor name."""
    plain = directory.parent / (directory.name + "-plain")
    model.save_pretrained(plain)  # transformers' own names (a mixture's experts one by one)
    tensors = load_file(plain / "model.safetensors")
    stored, values = {}, {}
    for name, t in tensors.items():
        if QUANTIZED.search(name):
            codes, scales = quantize(t)
            stored[name], stored[name.removesuffix("weight") + "weight_scale_inv"] = codes, scales
            values[name] = dequantized(codes, scales)
        else:
            stored[name] = t.to(torch.bfloat16).contiguous()
            values[name] = stored[name].float()
    config = json.loads((plain / "config.json").read_text())
    config["dtype"] = "bfloat16"
    for out, tensors_out, extra in (
        (directory, stored, {"quantization_config": QUANT_CONFIG}),
        (dense, values, {}),
    ):
        out.mkdir(parents=True, exist_ok=True)
        save_file(tensors_out, out / "model.safetensors", metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps({**config, **extra}))
        save_byte_tokenizer(out)
    return values
