"""Triton kernels against their plain-torch references under TRITON_INTERPRET=1.

Each case runs in its own subprocess, so an interpreter crash fails one test and the
interpreter setting never leaks into other tests. The same cases run compiled on the
GPU machine (tests/test_gpu.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent


def _interpreted(module: str, *args: str) -> list[str]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", module, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", ["asym", "sym"])
def test_qlinear_kernel_matches_reference_interpreted(bits, symmetric):
    assert _interpreted("tests.kernel_cases", "qlinear", str(bits), symmetric) == []


def test_qlinear_kernel_with_zero_points_matches_reference_interpreted():
    """int4 with integer zero points, (c - z) x scale: pre-quantized checkpoints' format."""
    assert _interpreted("tests.kernel_cases", "qlinear", "4", "zp") == []


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", ["asym", "sym"])
def test_quantized_decode_attention_matches_reference_interpreted(bits, symmetric):
    assert _interpreted("tests.kernel_cases", "attention", str(bits), symmetric) == []


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", ["asym", "sym"])
def test_kv_cache_quantizing_kernel_is_bit_exact_interpreted(bits, symmetric):
    assert _interpreted("tests.kernel_cases", "kv-write", str(bits), symmetric) == []


def test_norm_kernel_matches_layer_and_rms_norm_interpreted():
    assert _interpreted("tests.kernel_cases", "norm", "0", "asym") == []


def test_wgmma_matmuls_x_permutation_interpreted():
    assert _interpreted("tests.kernel_cases", "wgmma-permute", "4", "asym") == []


def test_wgmma_operand_from_the_codes_pairs_each_weight_with_its_x_column():
    """What `qmatmul_wgmma`'s kernel does to a group's packed codes (`QTensor`'s bytes):
    lane j's words (bytes 8 j to 8 j + 7), each shifted by 4 k and masked with
    0x000F000F, give wgmma A registers whose halves are the codes (then their values) of
    K columns 16 (2 w + k // 2) + 8 (k % 2) + 2 j + h of the MMA; x permuted by
    `X_ORDER` must hold, at each such column, the x column of the code there, so the
    MMA's sum is x . W."""
    from offload.kernels.qmatmul_wgmma import X_ORDER
    from offload.kernels.quant import pack_int4

    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (64,), generator=gen, dtype=torch.uint8)
    packed = pack_int4(codes).to(torch.int64)
    operand = torch.full((64,), -1, dtype=torch.int64)
    for j in range(4):
        for w in range(2):
            b = packed[8 * j + 4 * w : 8 * j + 4 * w + 4]
            word = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24  # little-endian
            for k in range(4):
                register = (word >> 4 * k) & 0x000F000F
                for h, half in enumerate((register & 0xFFFF, register >> 16)):
                    operand[16 * (2 * w + k // 2) + 8 * (k % 2) + 2 * j + h] = half
    assert torch.equal(operand, codes[X_ORDER].to(torch.int64))
    x = torch.randn(64, generator=gen, dtype=torch.float64)
    assert torch.allclose((operand * x[X_ORDER]).sum(), (codes * x).sum())


def test_the_launcher_takes_triton_s_path_only_while_a_launch_hook_is_installed():
    """The Tritons the project allows hold launch hooks in a chain that is never None:
    with none in it the Launcher's direct launches run (they did not, on every Triton
    the project allows, until this was checked); a profiler's hook sends launches to
    Triton's path."""
    pytest.importorskip("triton")
    from triton import knobs

    from offload.kernels.launch import hooks_installed

    assert not hooks_installed()
    chain = knobs.runtime.launch_enter_hook
    hook = lambda metadata: None  # noqa: E731
    chain.add(hook)
    try:
        assert hooks_installed()
    finally:
        chain.remove(hook)
    assert not hooks_installed()


def test_the_matmul_s_tiles_are_cut_to_the_device_s_shared_memory():
    """float32 x with 128-wide K steps (a 128 group) asked Triton for 272 KiB of shared
    memory, where an H100 gives a program 227 KiB (GPU suite, this session): the
    launcher now drops stages, then tile rows, until its count fits; fp16 tiles of the
    decode buckets are left as they are."""
    from offload.kernels.formats import Compression
    from offload.kernels.qmatmul_tiles import ROW_TILES, Tiles, fit_tiles, shared_bytes

    h100 = 232448
    cfg = Compression(4, 128, False)
    wide = Tiles(128, 128, 64, 8, 3)
    assert shared_bytes(wide, 128, 4, cfg) > h100
    fitted = fit_tiles(wide, 128, 4, cfg, h100)
    assert shared_bytes(fitted, 128, 4, cfg) <= h100
    assert fitted == wide._replace(stages=2)
    # a group of 1024 in float32 needs smaller tiles as well
    huge = fit_tiles(wide, 1024, 4, Compression(4, 1024, False), h100)
    assert huge.block_m < 128 and shared_bytes(huge, 1024, 4, Compression(4, 1024, False)) <= h100
    for _, tiles, _ in ROW_TILES:
        for group in (32, 64, 128):
            block_k = max(group, min(tiles.max_k, 256))
            assert fit_tiles(tiles, block_k, 2, Compression(4, group, False), h100) == tiles
    assert fit_tiles(wide, 128, 4, cfg, None) == wide  # the interpreter: no limit


def test_kernels_keep_fused_multiply_add_whatever_triton_s_default(monkeypatch):
    """The launcher asks for floating-point contraction itself: Triton 3.9 warns that
    3.10 turns its default off, and our kernels were measured and tested with it on. A
    kernel compiled (offline, for sm_90) with the launcher's options under the default
    set off still has its a * b + c as one fma."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    from offload.kernels.launch import _options

    @triton.jit
    def axpy(a_ptr, b_ptr, c_ptr, out_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        a, b, c = tl.load(a_ptr + i), tl.load(b_ptr + i), tl.load(c_ptr + i)
        tl.store(out_ptr + i, a * b + c)

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    source = triton.compiler.ASTSource(
        fn=axpy,
        signature={
            "a_ptr": "*fp32",
            "b_ptr": "*fp32",
            "c_ptr": "*fp32",
            "out_ptr": "*fp32",
            "BLOCK": "constexpr",
        },
        constexprs={"BLOCK": 128},
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=_options(4, None))
    assert compiled.metadata.enable_fp_fusion
    assert "fma.rn.f32" in compiled.asm["ptx"]
