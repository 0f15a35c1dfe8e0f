"""The dequantization's inline PTX (`dequant._dequant_ptx`), run by a small emulator of
its few instructions on the CPU: the interpreter takes `dequant`'s float32 path instead,
so without this the PTX is checked only on the GPU (tests/test_gpu.py).

Every code of every byte position of the 32-bit word, each position with its own scale
and minimum, must come out as the float16 `dequant` computes on the GPU: c x scale +
minimum (or (c - zero point) x scale) rounded once, bit for bit.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip("triton")

from offload.kernels import dequant


def _halves(word: int) -> np.ndarray:
    """A register's two float16 halves, low first, as float64 (exact)."""
    return np.array([word & 0xFFFF, word >> 16], dtype=np.uint16).view(np.float16).astype(float)


def _word(halves: np.ndarray) -> int:
    """Two values rounded once to float16 (from exact float64), low half first."""
    low, high = np.asarray(halves, dtype=np.float64).astype(np.float16).view(np.uint16)
    return int(low) | int(high) << 16


def _prmt(a: int, b: int, selector: int) -> int:
    pool = (a | b << 32).to_bytes(8, "little")
    return int.from_bytes(bytes(pool[selector >> 4 * i & 7] for i in range(4)), "little")


def _lop3(a: int, b: int, c: int, table: int) -> int:
    out = 0
    for bit in range(32):
        index = (a >> bit & 1) << 2 | (b >> bit & 1) << 1 | (c >> bit & 1)
        out |= (table >> index & 1) << bit
    return out


def run_ptx(ptx: str, inputs: list[int], outputs: int) -> list[int]:
    """Runs the PTX's instructions on 32-bit registers: $0.. are the outputs, then the
    inputs. Products and sums are exact in float64 here, so rounding to float16 once
    is fma's (and mul's, sub's) rounding."""
    regs = {f"${outputs + i}": value for i, value in enumerate(inputs)}

    def value(operand: str) -> int:
        operand = operand.strip()
        return regs[operand] if operand in regs else int(operand, 0)

    for line in ptx.splitlines():
        match = re.fullmatch(r"(\S+)\s+([^;]*);", line.strip())
        if match is None or match.group(1) == ".reg":
            continue
        op, args = match.group(1), [a.strip() for a in match.group(2).split(",")]
        dest, src = args[0], [value(a) for a in args[1:]]
        if op == "mov.b32":
            result = src[0]
        elif op == "prmt.b32":
            result = _prmt(*src)
        elif op == "lop3.b32":
            result = _lop3(*src)
        elif op == "shr.b32":
            result = src[0] >> src[1]
        elif op == "or.b32":
            result = src[0] | src[1]
        elif op == "sub.f16x2":
            result = _word(_halves(src[0]) - _halves(src[1]))
        elif op == "mul.rn.f16x2":
            result = _word(_halves(src[0]) * _halves(src[1]))
        elif op == "fma.rn.f16x2":
            result = _word(_halves(src[0]) * _halves(src[1]) + _halves(src[2]))
        else:
            raise AssertionError(f"instruction {op} not emulated")
        regs[dest] = result & 0xFFFFFFFF
    return [regs[f"${i}"] for i in range(outputs)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
def test_dequant_ptx_gives_dequant_s_float16_values(bits, symmetric):
    ptx = dequant._dequant_ptx(bits, symmetric).value
    rng = np.random.default_rng(bits + symmetric)
    zero = ((1 << bits) - 1) // 2 if symmetric else 0
    planes = 2 if bits == 4 else 1  # int4: the low nibbles' values, then the high ones'
    failures = []
    for start in range(0, 256, 4):
        codes = np.arange(start, start + 4, dtype=np.uint32)
        # a scale and minimum for each of the four codes, so a mixed-up lane shows
        scale = rng.uniform(0.001, 0.1, 4).astype(np.float16)
        minimum = rng.uniform(-1.0, 1.0, 4).astype(np.float16)
        words = [_word(scale[:2]), _word(scale[2:])]
        if not symmetric:
            words += [_word(minimum[:2]), _word(minimum[2:])]
        packed = int(codes[0] | codes[1] << 8 | codes[2] << 16 | codes[3] << 24)
        out = run_ptx(ptx, [packed, *words], 2 * planes)
        values = [codes & 0xF, codes >> 4] if bits == 4 else [codes]
        for plane, plane_codes in enumerate(values):
            exact = (plane_codes.astype(float) - zero) * scale.astype(float)
            if not symmetric:
                exact += minimum.astype(float)
            want = [_word(exact[:2]), _word(exact[2:])]
            got = out[2 * plane : 2 * plane + 2]
            if got != want:
                failures.append(f"codes {codes.tolist()} plane {plane}: {got} != {want}")
    assert not failures, failures[:5]
