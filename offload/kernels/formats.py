"""The quantized formats: what a `Compression` names, and the facts every layer that
stores, moves or computes on compressed tensors shares.

A `Compression` is group-wise quantization to `bits` (4 or 8) a value: groups of
`group_size` consecutive values share a float16 scale, and a float16 minimum unless
`symmetric` (then codes are centred on (2^bits - 1) // 2), or with `zero_point` a
float16 integer zero. int4 codes are packed two a byte, low nibble first.

`fp8` is the block-scaled float8 (e4m3) format of DeepSeek's and Kimi's checkpoints,
read as shipped (`models.fp8_checkpoint`, `kernels.fp8`): a value is a float8_e4m3fn
byte times a float32 scale shared by a block of `group_size` x `group_size` weights
(128 x 128), 1 byte a value plus the scales. It is a checkpoint's format only: nothing
here quantizes to it.

- Weights (`quant.py`): groups along a matrix's last dimension (its input features).
- KV cache (`kvcache.py`): keys per channel over groups of `group_size` tokens, which
  must be one of `KV_GROUPS`; values per token over `value_group` channels.

Nothing here imports torch or triton: policies, models and the io store read these
facts without the kernels' dependencies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Compression:
    """head: the LM head is quantized too (weights); a pre-quantized checkpoint whose
    head ships dense keeps it in the compute dtype (`models.prequant`).
    zero_point (weights, asymmetric): the minimum's place holds each group's integer
    zero z, and a code c is the value (c - z) x scale, rounded once: GPTQ's and AWQ's
    arithmetic, which c x scale + minimum matches only where z x scale is exact.
    fp8 (weights): float8 e4m3 values with float32 block scales (the module doc); bits 8,
    symmetric (no minimum), group_size the block's side."""

    bits: int = 4
    group_size: int = 64
    symmetric: bool = False
    head: bool = True
    zero_point: bool = False
    fp8: bool = False

    def __post_init__(self) -> None:
        if self.fp8 and not (self.bits == 8 and self.symmetric and not self.zero_point):
            raise ValueError("fp8 is 8 bits a value, symmetric, without zero points")
        if self.bits not in (4, 8):
            raise ValueError(f"compression bits must be 4 or 8, got {self.bits!r}")
        if self.zero_point and self.symmetric:
            raise ValueError("a symmetric compression has no zero points")
        if not isinstance(self.group_size, int) or self.group_size < 2:
            raise ValueError(
                f"compression group_size must be an integer >= 2, got {self.group_size!r}"
            )


# MXFP4 (the OCP microscaling format gpt-oss ships its experts in; `models.mxfp4`): a
# matrix [rows, cols] is two uint8 tensors, `<name>.blocks` [rows, cols / 32, 16] (two
# e2m1 values a byte, the even column in the low nibble) and `<name>.scales`
# [rows, cols / 32] (a block's e8m0 exponent, bias 127): 4.25 bits a value. They are
# stored and moved as they are, never requantized.
MXFP4_BLOCK = 32
MXFP4_BLOCKS, MXFP4_SCALES = ".blocks", ".scales"


# token-group sizes a compressed KV cache supports (the decode kernel's tile of tokens)
KV_GROUPS = (16, 32, 64, 128)


def value_group(config: Compression, head_dim: int) -> int:
    """Channels per value group: the group size, or what of it divides head_dim."""
    return math.gcd(config.group_size, head_dim)
