"""MXFP4 matrices (gpt-oss's experts as shipped) read, kept and computed in that form.

A checkpoint with `quantization_config.quant_method` "mxfp4" stores each expert
matrix of a layer as `<name>_blocks` uint8 [E, rows, cols / 32, 16] (two e2m1 values a
byte: the even column in the low nibble, the odd in the high one) and `<name>_scales`
uint8 [E, rows, cols / 32] (the e8m0 exponent of a block of 32 values, bias 127). A
value is e2m1(nibble) x 2^(scale - 127), exactly as transformers' own conversion
(`transformers.integrations.mxfp4.convert_moe_packed_tensors`) computes it: the e2m1
value in the compute dtype, then `torch.ldexp` by the exponent.

Here each expert's matrices stay as their blocks and scales (`kernels.formats`:
4.25 bits a value): they are stored, placed and copied across PCIe as those bytes, and
a matmul dequantizes its matrix on the device into the compute dtype just before it
(`MXFP4.dequantize`: a few elementwise kernels over one expert's matrix at a time).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from offload.kernels.formats import MXFP4_BLOCK

# the 16 e2m1 values, by nibble (sign in the high bit)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES += tuple(-v for v in E2M1_VALUES)
SCALE_BIAS = 127


@dataclass(frozen=True)
class MXFP4:
    """A matrix [rows, cols] as MXFP4 blocks [rows, cols / 32, 16] and scales
    [rows, cols / 32] (uint8 both)."""

    blocks: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        assert self.blocks.dtype == torch.uint8 and self.scales.dtype == torch.uint8
        assert self.blocks.shape[:-1] == self.scales.shape, (self.blocks.shape, self.scales.shape)

    @property
    def shape(self) -> tuple[int, int]:
        rows, groups, pairs = self.blocks.shape
        return rows, groups * pairs * 2

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(self.blocks, self.scales, dtype)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks [..., G, 16] and scales [..., G] -> values [..., G x 32] in dtype: the
    arithmetic of transformers' conversion, so the values are its own bit for bit."""
    lut = torch.tensor(E2M1_VALUES, dtype=dtype, device=blocks.device)
    *lead, groups, pairs = blocks.shape
    out = torch.empty((*lead, groups, pairs * 2), dtype=dtype, device=blocks.device)
    out[..., 0::2] = lut[(blocks & 0x0F).int()]
    out[..., 1::2] = lut[(blocks >> 4).int()]
    torch.ldexp(out, scales.int()[..., None] - SCALE_BIAS, out=out)
    return out.view(*lead, groups * pairs * 2)


def deinterleave_rows(t: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gate_up rows interleaved (gate, up, gate, ...) -> [gate rows | up rows],
    the canonical mlp_in's order (`models.shapes`)."""
    return torch.cat((t[0::2], t[1::2]))


def dummy(name: str, shape: tuple[int, ...], key: str, device: torch.device) -> torch.Tensor:
    """Seeded dummy blocks (uniform nibbles) or scales (an exponent giving values of
    about 1 / sqrt(cols) root mean square: unit-variance outputs, as `DummySource`'s
    other matrices)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1)
    if name.endswith(".blocks"):
        return torch.randint(0, 256, shape, generator=gen, device=device, dtype=torch.uint8)
    cols = shape[-1] * MXFP4_BLOCK
    rms = math.sqrt(sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES))
    exponent = round(math.log2(1 / (rms * math.sqrt(cols))))
    low = torch.randint(0, 2, shape, generator=gen, device=device, dtype=torch.int16)
    return (low + SCALE_BIAS + exponent).to(torch.uint8)
