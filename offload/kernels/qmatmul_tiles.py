"""How the fused int4/int8 matmul (`qmatmul.qlinear`) is tiled: the tiles by rows of x,
the K step, split-K for decode shapes, and the tiles' shared memory fitted to the
device's limit."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from offload.kernels.formats import Compression
from offload.kernels.launch import sm_count

# rows of x from which a matmul dequantizes W and multiplies with cuBLAS (`qmatmul`'s doc)
DENSE_ROWS = 1024


class Tiles(NamedTuple):
    """How one `qlinear` call is tiled. split > 1 divides K among up to that many programs
    per output tile (split-K; the largest divisor of the K steps not above it), for
    decode shapes whose output tiles alone would leave SMs idle or too few bytes in
    flight; the last of a tile's programs to finish sums the partials in a fixed order
    (the result does not depend on which finished last). registers: a cap on a thread's
    registers (more programs an SM), or None."""

    block_m: int
    block_n: int
    max_k: int  # largest K step (several groups)
    warps: int
    stages: int
    split: int = 1
    registers: int | None = None


def block_k_of(k: int, group: int, max_k: int) -> int:
    """The widest K step up to max_k (whole groups, dividing K); the group itself at least."""
    return next(
        b
        for b in (256, 128, 64, group)
        if (b <= max_k or b == group) and b % group == 0 and k % b == 0
    )


# The fused kernel's tiles by rows of x: those of the first bucket at or above m, and
# the programs an SM its K is split for (`split_for`). Measured on the H100 machine
# (`scripts/bench_kernels.py --kernels decode`, OPT-30B and Llama-2-70B matrices, int4;
# docs/throughput.md): at 32 rows, 32-row tiles read 1.8x faster than 64-row ones; at
# 64, K steps of 128 beat 256 by 10-30% (fewer registers); at 16, a cap of 128
# registers (4 programs an SM, not 2) 2-5%; from 128 rows split-K loses.
ROW_TILES = (
    (16, Tiles(16, 64, 256, 4, 3, registers=128), 4),
    (32, Tiles(32, 64, 256, 4, 3), 4),
    (64, Tiles(64, 64, 128, 4, 3), 4),
    (DENSE_ROWS, Tiles(128, 128, 64, 8, 3), 1),
)


def tiles_for(m: int, n: int, k: int, group: int, device: torch.device) -> Tiles:
    """The tiles for [m, k] x [k, n] below DENSE_ROWS rows (`ROW_TILES`); K steps are whole
    groups (`block_k_of`), so a group longer than the bucket's K step takes its own."""
    tiles, per_sm = next((t, p) for rows, t, p in ROW_TILES if m <= rows)
    return tiles._replace(split=split_for(m, n, k, tiles, device, per_sm))


def shared_bytes(t: Tiles, block_k: int, element: int, cfg: Compression) -> int:
    """The fused kernel's shared memory, from above: every pipeline stage holds a K step
    of x, of the codes and of the group parameters, and the dequantized W tile goes
    through one more buffer on its way to the tensor cores. (Triton allocated 278528
    bytes for 128 x 128 tiles, K steps of 128 and float32 x; this counts 288256.)"""
    params = 2 * t.block_n * max(1, block_k // cfg.group_size) * 2
    stage = t.block_m * block_k * element + t.block_n * block_k * cfg.bits // 8 + params
    return t.stages * stage + t.block_n * block_k * element


@functools.cache  # on every call's path: one lookup, not the count
def fit_tiles(t: Tiles, block_k: int, element: int, cfg: Compression, limit: int | None) -> Tiles:
    """t with fewer stages, then smaller tiles in M and N, until its shared memory fits
    the device's limit (None: no limit, the interpreter). float32 x, or a group longer
    than the bucket's K step, needs it: 128 x 128 tiles with K steps of 128 over float32
    asked for 272 KiB where an H100 gives a program 227 KiB."""
    while limit is not None and shared_bytes(t, block_k, element, cfg) > limit:
        if t.stages > 2:
            t = t._replace(stages=t.stages - 1)
        elif t.block_m > 16:
            t = t._replace(block_m=t.block_m // 2)
        elif t.block_n > 16:
            t = t._replace(block_n=t.block_n // 2)
        else:
            break  # the smallest tiles: let Triton say what does not fit
    return t


def split_for(m: int, n: int, k: int, tiles: Tiles, device: torch.device, per_sm: int) -> int:
    """The most programs to divide K among for each output tile: enough that every SM
    holds per_sm programs, each with 4 K steps at least."""
    count = -(-m // tiles.block_m) * -(-n // tiles.block_n)
    wanted = -(-per_sm * sm_count(device) // count)
    return max(1, min(wanted, k // (4 * tiles.max_k)))
