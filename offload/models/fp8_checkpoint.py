"""FP8 block-scaled checkpoints, as DeepSeek-V3/R1 and Kimi-K2 ship them, read per tensor.

config.json: quantization_config {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}. A quantized linear
`X` stores `X.weight` float8_e4m3fn [N, K] and `X.weight_scale_inv` float32
[ceil(N / 128), ceil(K / 128)]; weight [r, c] is weight.float()[r, c] x
scale_inv[r // 128, c // 128], in float32, rounded once to the compute dtype: the
blocks at the bottom and right edge are partial where N or K is not a multiple of 128
(DeepSeek-V3's kv_a_proj_with_mqa has N = 576). transformers dequantizes the same way
(`Fp8Dequantize`: its CPU load, bit for bit) and indexes the same blocks in its GPU
kernel; its CPU load refuses a weight whose sides are not multiples of the block.
Tensors without a scale (norms, embeddings, the LM head, routers) are as stored.

Layer matrices become `QTensor`s in our fp8 format (`kernels.fp8`: the codes as
shipped, the block scales a row), the concatenation of fused modules along N included.
A canonical tensor the checkpoint stores dense, or in part dense (a module in
`modules_to_not_convert`), and an fp8 tensor outside the layer matrices (a quantized LM
head or router) are read dequantized, as the float32 values the compute dtype rounds
once. Formats read otherwise are refused by name from the config, before the load.
"""

from __future__ import annotations

from typing import Any

import torch

from offload.core.errors import UserError
from offload.kernels import fp8
from offload.kernels.formats import Compression
from offload.kernels.quant import QTensor

BLOCK = 128  # the block side offload reads: DeepSeek's and Kimi's
SCALE = ".weight_scale_inv"
ORIGINAL = "use the model's bf16 checkpoint (or one in FP8 with 128 x 128 block scales)"


def compression(qc: dict[str, Any]) -> Compression:
    """Our format for a config's fp8 quantization_config; what it cannot read, refused."""
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UserError(
            f"fp8 checkpoint with fmt {fmt!r} is not supported (e4m3, float8_e4m3fn "
            f"weights, is); {ORIGINAL}"
        )
    block = qc.get("weight_block_size")
    if block is None:
        raise UserError(
            "fp8 checkpoint without weight_block_size (per-tensor scales) is not supported: "
            f"offload reads [{BLOCK}, {BLOCK}] block scales; {ORIGINAL}"
        )
    if list(block) != [BLOCK, BLOCK]:
        raise UserError(
            f"fp8 weight_block_size {list(block)} is not supported ([{BLOCK}, {BLOCK}] is); "
            f"{ORIGINAL}"
        )
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise UserError(
            f"fp8 activation_scheme {scheme!r} is not supported (dynamic is: offload "
            f"computes with the dequantized weights and bf16/fp16 activations); {ORIGINAL}"
        )
    return Compression(8, BLOCK, True, head=False, fp8=True)


def stored_fp8(reader, names: list[str]) -> bool:
    """Whether any of the checkpoint tensors `names` is stored in fp8 (has a scale)."""
    return any(n.endswith(".weight") and reader.has(n.removesuffix(".weight") + SCALE) for n in names)  # fmt: skip


def load(reader, config: Compression, names: list[str], matrix: bool) -> QTensor | torch.Tensor:
    """The tensors `names` concatenated along dim 0: a `QTensor` in `config` where
    `matrix` (a layer matrix of the fp8 format) and each is stored in fp8, else their
    float32 values (fp8 ones dequantized)."""
    if matrix and all(stored_fp8(reader, [n]) for n in names):
        parts = [_parts(reader, n.removesuffix(".weight")) for n in names]
        codes = torch.cat([c for c, _ in parts])
        scale = torch.cat([s for _, s in parts])
        return QTensor(codes, scale, None, tuple(codes.shape), torch.float32, config)
    dense = []
    for name in names:
        if stored_fp8(reader, [name]):
            codes, scale = _parts(reader, name.removesuffix(".weight"))
            dense.append(fp8.dequantize(codes, scale, config, torch.float32))
        elif reader.has(name):
            dense.append(reader.get(name).float())
        else:
            raise UserError(f"the checkpoint lacks tensor {name}; is it this model's checkpoint?")
    return torch.cat(dense)


def _parts(reader, module: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A module's codes [N, K] uint8 and row scales [N, ceil(K / BLOCK)] float32."""
    weight, scale = reader.get(module + ".weight"), reader.get(module + SCALE)
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise UserError(
            f"{module}.weight is {weight.dtype} {tuple(weight.shape)} beside its "
            f"weight_scale_inv; an e4m3 checkpoint's quantized weights are 2-d float8_e4m3fn"
        )
    n, k = weight.shape
    blocks = (-(-n // BLOCK), -(-k // BLOCK))
    if tuple(scale.shape) != blocks:
        raise UserError(
            f"{module}.weight_scale_inv has shape {tuple(scale.shape)}, the {BLOCK} x {BLOCK} "
            f"blocks of its {n} x {k} weight are {blocks}; {ORIGINAL}"
        )
    if scale.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise UserError(
            f"{module}.weight_scale_inv is {scale.dtype}: offload reads float scales "
            f"(float32, as DeepSeek's), not packed exponents; {ORIGINAL}"
        )
    return weight.view(torch.uint8), fp8.row_scales(scale, n, BLOCK)
