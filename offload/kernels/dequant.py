"""Dequantization in Triton registers, shared by the dequantize-and-multiply kernel
(`qmatmul.py`) and the compressed KV cache's decode attention (`kv_attention.py`).

Codes are uint8 (int8: one a byte; int4: two a byte, low nibble first), each group's
scale (and minimum, asymmetric) float16, as `formats.Compression` describes. A code c
is the value c x scale + minimum, (c - (2^bits - 1) // 2) x scale symmetric, or
(c - zero) x scale with zero points (`formats.Compression.zero_point`): the
arithmetic of `quant.dequantize`, the plain-torch reference these helpers must match
(the kernels that use them are tested against it, `tests/kernel_cases.py`).

- `dequant`: codes of any shape, in float16 by one fused multiply-add, else float32.
- `dequant_bytes` / `dequant_nibbles`: int8 / int4 codes four bytes at a time in inline
  PTX (float16 on the GPU), else `dequant`.

Only defined where Triton is installed.
"""

from __future__ import annotations

from offload.kernels.launch import INTERPRETED

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never launch a kernel
    triton = None


if triton is not None:
    FMA16: tl.constexpr = tl.constexpr(not INTERPRETED)

    @triton.jit
    def dequant(
        codes, scale, minimum, BITS: tl.constexpr, SYMMETRIC: tl.constexpr,
        out_dtype: tl.constexpr, ZERO_POINT: tl.constexpr = False,
    ):  # fmt: skip
        """Codes (uint8, any shape) to values in the compute dtype out_dtype, the fp16 scale (and
        minimum) broadcast against them.

        float16: a code c becomes the float16 1024 + c by setting the exponent bits above
        it (exact for c < 1024), and one fused multiply-add in float16 gives the correctly
        rounded c x scale + minimum: no integer-to-float conversions, the slow part of
        the float32 way, and the reference's values (float32, then rounded to float16)
        up to double-rounding ties. A float16 multiply and a separate add instead make up
        to 17x torch's error on groups with large minimums. Other
        dtypes, and the interpreter (its fma rounds the product first): float32
        arithmetic, then the cast.

        ZERO_POINT: minimum holds the group's integer zero z, and the value is
        (c - z) x scale: exact in float32, then the one rounding of the cast."""
        if ZERO_POINT:
            values = codes.to(tl.float32) - minimum.to(tl.float32)
            return (values * scale.to(tl.float32)).to(out_dtype)
        if out_dtype == tl.float16 and FMA16:
            magic = (codes.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
            if SYMMETRIC:
                return (magic - (1024 + ((1 << BITS) - 1) // 2)) * scale
            return tl.fma(magic - 1024, scale, minimum)
        values = codes.to(tl.float32)
        scale = scale.to(tl.float32)
        if SYMMETRIC:
            return ((values - ((1 << BITS) - 1) // 2) * scale).to(out_dtype)
        return (values * scale + minimum.to(tl.float32)).to(out_dtype)

    def _dequant_ptx(bits: int, symmetric: bool) -> tl.constexpr:
        """Inline PTX (for `tl.inline_asm_elementwise`, 4 codes a call) of `dequant`'s
        float16 arithmetic on four bytes of codes in one register: the bytes are spread
        over the halves of two registers (prmt); int8 ORs in the exponent bits of 1024,
        int4 takes each nibble (lop3: and, or), so each half is the float16 1024 + code;
        1024 (and a symmetric zero point) is taken off exactly, then one fma (or mul)
        a pair applies scale and minimum, rounding once as `dequant` does.

        Operands: the outputs (int8: one tensor; int4: the low nibbles' values, then the
        high ones'; two registers of float16 pairs each), the codes, the scale (two
        registers), the minimum (two; asymmetric)."""
        outs = ["a0", "a1", "b0", "b1"] if bits == 4 else ["a0", "a1"]
        codes, scale = len(outs), len(outs) + 1
        offset = 0x6400 + (((1 << bits) - 1) // 2 if symmetric else 0)
        lines = [
            f".reg .b32 z, mask, magic, offset, {', '.join(outs)};",
            "mov.b32 z, 0;",
            "mov.b32 mask, 0x000F000F;",
            "mov.b32 magic, 0x64006400;",
            f"mov.b32 offset, 0x{offset:04X}{offset:04X};",
            f"prmt.b32 a0, ${codes}, z, 0x4140;",
            f"prmt.b32 a1, ${codes}, z, 0x4342;",
        ]
        if bits == 4:
            lines += ["shr.b32 b0, a0, 4;", "shr.b32 b1, a1, 4;"]
            lines += [f"lop3.b32 {r}, {r}, mask, magic, 0xEA;" for r in outs]
        else:
            lines += [f"or.b32 {r}, {r}, magic;" for r in outs]
        lines += [f"sub.f16x2 {r}, {r}, offset;" for r in outs]
        for r in outs:
            pair = int(r[1])  # which of the two scale (and minimum) registers
            if symmetric:
                lines.append(f"mul.rn.f16x2 {r}, {r}, ${scale + pair};")
            else:
                lines.append(f"fma.rn.f16x2 {r}, {r}, ${scale + pair}, ${scale + 2 + pair};")
        lines += [f"mov.b32 ${i}, {r};" for i, r in enumerate(outs)]
        return tl.constexpr("{\n" + "\n".join(lines) + "\n}")

    _NIBBLES_ASYMMETRIC = _dequant_ptx(4, False)
    _NIBBLES_SYMMETRIC = _dequant_ptx(4, True)
    _BYTES_ASYMMETRIC = _dequant_ptx(8, False)
    _BYTES_SYMMETRIC = _dequant_ptx(8, True)

    @triton.jit
    def dequant_bytes(
        codes, scale, minimum, SYMMETRIC: tl.constexpr, out_dtype: tl.constexpr,
        HOISTABLE: tl.constexpr = True, ZERO_POINT: tl.constexpr = False,
    ):  # fmt: skip
        """int8 codes (uint8, any shape whose threads hold four consecutive codes: loaded
        rows of codes) to values, as `dequant`; four at a time in inline PTX for float16
        on the GPU (but zero points: `dequant`). HOISTABLE=False: as `dequant_nibbles`."""
        if ZERO_POINT:
            return dequant(codes, scale, minimum, 8, SYMMETRIC, out_dtype, ZERO_POINT)
        if out_dtype == tl.float16 and FMA16:
            scale = tl.broadcast_to(scale, codes.shape)
            if SYMMETRIC:
                return tl.inline_asm_elementwise(
                    _BYTES_SYMMETRIC, "=r,=r,r,r,r", [codes, scale],
                    dtype=tl.float16, is_pure=HOISTABLE, pack=4,
                )  # fmt: skip
            return tl.inline_asm_elementwise(
                _BYTES_ASYMMETRIC, "=r,=r,r,r,r,r,r",
                [codes, scale, tl.broadcast_to(minimum, codes.shape)],
                dtype=tl.float16, is_pure=HOISTABLE, pack=4,
            )  # fmt: skip
        return dequant(codes, scale, minimum, 8, SYMMETRIC, out_dtype)

    @triton.jit
    def dequant_nibbles(
        packed, scale, minimum, SYMMETRIC: tl.constexpr, out_dtype: tl.constexpr,
        HOISTABLE: tl.constexpr = True, ZERO_POINT: tl.constexpr = False,
    ):  # fmt: skip
        """int4 codes, two a byte (uint8, any shape), to the values of their low and high
        nibbles (each packed's shape), the fp16 scale (and minimum) broadcast against
        them; the same arithmetic as `dequant`, four bytes at a time in inline PTX for
        float16 on the GPU.

        HOISTABLE=False marks the PTX impure, so Triton's layout passes leave it where
        it is: when its values feed a tl.dot through shared memory, they otherwise move
        the operand's layout conversion above it, onto the codes, which are then read
        from shared memory a byte at a time (the decode attention's keys and values:
        2-3x the instructions a byte, compiled for sm_90 with triton 3.6). Zero points
        take `dequant`'s float32 arithmetic."""
        if out_dtype == tl.float16 and FMA16 and not ZERO_POINT:
            scale = tl.broadcast_to(scale, packed.shape)
            if SYMMETRIC:
                return tl.inline_asm_elementwise(
                    _NIBBLES_SYMMETRIC,
                    "=r,=r,=r,=r,r,r,r",
                    [packed, scale],
                    dtype=(tl.float16, tl.float16),
                    is_pure=HOISTABLE,
                    pack=4,
                )
            return tl.inline_asm_elementwise(
                _NIBBLES_ASYMMETRIC,
                "=r,=r,=r,=r,r,r,r,r,r",
                [packed, scale, tl.broadcast_to(minimum, packed.shape)],
                dtype=(tl.float16, tl.float16),
                is_pure=HOISTABLE,
                pack=4,
            )
        return (
            dequant(packed & 0xF, scale, minimum, 4, SYMMETRIC, out_dtype, ZERO_POINT),
            dequant(packed >> 4, scale, minimum, 4, SYMMETRIC, out_dtype, ZERO_POINT),
        )
