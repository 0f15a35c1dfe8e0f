"""The compressed CPU expert kernel (`kernels/cpu_expert_native.py`, C) against the
plain-torch reference: the matrix dequantized (`quant.dequantize`, to the matrix's
dtype), then multiplied in float64 here.

Bound: a float32 sum's reordering error, 2^-23 x (K / 16 + 16) x (|x| @ |W|^T) an
output (the kernel sums K / 16 terms a lane, then 16 lanes): the weights must be the
reference's values to the bit, since a weight off by its dtype's rounding (2^-9 for
bfloat16) is thousands of times that.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offload.kernels import cpu_expert_native
from offload.kernels.cpu_expert import cpu_expert_mlp, expert_mlp_reference
from offload.kernels.formats import Compression
from offload.kernels.quant import QTensor, dequantize, quantize

ROOT = Path(__file__).resolve().parent.parent
runs = pytest.mark.skipif(not cpu_expert_native.available(), reason="no C compiler with OpenMP")

# every path of the kernel: int4 groups of 32 and 64 (AVX-512's table), int8 groups of a
# vector's multiple, and the scalar path's groups (int4 in 16s, 6 and 10: dims that are
# no multiple of the vector); asymmetric, symmetric and zero points
FORMATS = [
    Compression(4, 64),
    Compression(4, 32, symmetric=True),
    Compression(4, 128, zero_point=True),
    Compression(4, 16),
    Compression(4, 6, zero_point=True),
    Compression(8, 64),
    Compression(8, 16, symmetric=True),
    Compression(8, 32, zero_point=True),
    Compression(8, 10),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _matrix(rows: int, cols: int, config: Compression, dtype, gen) -> QTensor:
    w = torch.randn(rows, cols, generator=gen) / cols**0.5
    w[0, : config.group_size] += 3.0  # a group with a large minimum and scale
    return quantize(w.to(dtype), config)


def _bound_violation(got, x, w: QTensor) -> float:
    """The largest error over its bound (module docstring); <= 1 passes."""
    dense = dequantize(w).double()
    truth = x.double() @ dense.T
    scale = x.double().abs() @ dense.abs().T
    bound = 2.0**-23 * (w.shape[1] / 16 + 16) * scale + 1e-30
    return ((got.double() - truth).abs() / bound).max().item()


@runs
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", FORMATS, ids=str)
def test_qlinear_matches_the_dequantized_matmul(config, dtype):
    """y = x W^T over odd shapes: 1, 3 and 17 rows (two passes of 8 rows and one),
    37 output channels (an odd one alone), 5 groups."""
    gen = torch.Generator().manual_seed(config.group_size + config.bits)
    cols = 5 * config.group_size
    w = _matrix(37, cols, config, dtype, gen)
    for rows in (1, 3, 17):
        x = torch.randn(rows, cols, generator=gen)
        got = cpu_expert_native.qlinear(x, w)
        assert got is not None and got.shape == (rows, 37) and got.dtype == torch.float32
        assert _bound_violation(got, x, w) <= 1, (rows, config, dtype)


@runs
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("config", [FORMATS[0], FORMATS[2], FORMATS[4], FORMATS[5]], ids=str)
def test_the_expert_mlp_matches_the_reference_mlp(config, dtype):
    """The fused SwiGLU (gate and up channels paired, silu(gate) x up, then down) against
    `expert_mlp_reference` (float32 over the dequantized weights) and a float64 one."""
    gen = torch.Generator().manual_seed(7)
    hidden, inner = 3 * config.group_size, 5 * config.group_size
    mlp_in = _matrix(2 * inner, hidden, config, dtype, gen)
    mlp_out = _matrix(hidden, inner, config, dtype, gen)
    for rows in (1, 3, 17):
        x = torch.randn(rows, hidden, generator=gen)
        got = cpu_expert_native.expert_mlp(x, mlp_in, mlp_out)
        gate, up = (x.double() @ dequantize(mlp_in).double().T).chunk(2, dim=-1)
        truth = (torch.nn.functional.silu(gate) * up) @ dequantize(mlp_out).double().T
        scale = truth.abs().max()
        assert (got.double() - truth).abs().max() <= 1e-5 * scale, (rows, config, dtype)
        want = expert_mlp_reference(x, mlp_in, mlp_out)
        assert (got - want).abs().max() <= 1e-5 * scale
        # cpu_expert_mlp takes the kernel and returns x's dtype
        assert torch.equal(cpu_expert_mlp(x, mlp_in, mlp_out), got)
        assert cpu_expert_mlp(x.half(), mlp_in, mlp_out).dtype == torch.float16


@runs
def test_one_matrix_compressed_takes_the_kernel_for_it():
    """mlp_in compressed, mlp_out in full precision (an intermediate size that is no
    multiple of the group): the kernel computes mlp_in, torch the rest."""
    gen = torch.Generator().manual_seed(3)
    config = Compression(4, 32)
    mlp_in = _matrix(2 * 40, 64, config, torch.float16, gen)
    mlp_out = (torch.randn(64, 40, generator=gen) / 40**0.5).half()
    x = torch.randn(5, 64, generator=gen).half()
    want = expert_mlp_reference(x, mlp_in, mlp_out).float()
    got = cpu_expert_mlp(x, mlp_in, mlp_out).float()
    torch_err = (expert_mlp_reference(x, dequantize(mlp_in), mlp_out).float() - want).abs()
    assert (got - want).abs().max() <= 2 * torch_err.max() + 1e-3 * want.abs().max()


@runs
def test_the_result_does_not_depend_on_the_threads():
    """Each channel pair is one thread's: one thread and all give the same bits."""
    gen = torch.Generator().manual_seed(5)
    config = Compression(4, 64)
    mlp_in = _matrix(2 * 512, 1024, config, torch.float16, gen)
    mlp_out = _matrix(1024, 512, config, torch.float16, gen)
    x = torch.randn(9, 1024, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu_expert_native.expert_mlp(x, mlp_in, mlp_out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(cpu_expert_native.expert_mlp(x, mlp_in, mlp_out), alone)


def test_where_the_kernel_does_not_run_torch_does(monkeypatch):
    """OFFLOAD_NATIVE=0, codes that are a strided view: None, and `cpu_expert_mlp`
    computes the same MLP in torch (dequantized slices)."""
    gen = torch.Generator().manual_seed(6)
    config = Compression(8, 32)
    mlp_in = _matrix(2 * 64, 64, config, torch.float32, gen)
    mlp_out = _matrix(64, 64, config, torch.float32, gen)
    x = torch.randn(3, 64, generator=gen)
    want = expert_mlp_reference(x, mlp_in, mlp_out)
    strided = QTensor(
        torch.empty(128, 2, 64, dtype=torch.uint8)[:, :, :32].copy_(mlp_in.codes),
        mlp_in.scale, mlp_in.minimum, mlp_in.shape, mlp_in.dtype, config,
    )  # fmt: skip
    assert cpu_expert_native.qlinear(x, strided) is None
    monkeypatch.setenv("OFFLOAD_NATIVE", "0")
    assert cpu_expert_native.expert_mlp(x, mlp_in, mlp_out) is None
    got = cpu_expert_mlp(x, mlp_in, mlp_out)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def _cpu_flags() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


@pytest.mark.skipif(
    " avx512f" not in _cpu_flags() or os.environ.get("OFFLOAD_NATIVE_ARCH") is not None,
    reason="runs the AVX2 build where CI's AVX-512 one runs",
)
@runs
def test_the_avx2_build_matches_too():
    """The kernel's 8-float build (AVX2 machines: int4 without the table), these tests
    again in a subprocess."""
    env = {**os.environ, "OFFLOAD_NATIVE_ARCH": "haswell", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    lib = cpu_expert_native._library()
    assert lib.vector_bits() == 512


def test_the_plan_computes_compressed_experts_on_the_cpu_at_the_kernels_rate():
    """int4 experts in pinned memory: at the plain-torch path's measured rate (2 GB/s,
    the H100 machine's host) the plan computes none on the CPU; at a rate as fast as
    the copies beside it, half of them, in about half the phase."""
    import dataclasses

    from offload.core.config import ModelConfig
    from offload.core.presets import PRESETS
    from offload.policies.cost_moe import cpu_share, expert_layers, expert_phase
    from offload.policies.policy import Placement
    from tests.test_policies import PROFILE

    cfg = ModelConfig.from_hf(PRESETS["mixtral-8x7b"], "mixtral-8x7b")
    int4 = Compression(4, 64)
    x = expert_layers(cfg, torch.float16, int4, Placement(0.0, 1.0, 0.0))
    assert x is not None and x.cpu == 8
    slow = dataclasses.replace(PROFILE, cpu_expert_gbps={"dense": 25.0, "int4": 2.0})
    assert cpu_share(x, slow, int4, 64) == 0.0
    hw = dataclasses.replace(
        PROFILE, cpu_expert_gbps={"int4": 25.0}, h2d_under_cpu_attention_gbps=25.0
    )
    share = cpu_share(x, hw, int4, 64)
    assert share == 0.5
    copied = expert_phase(x, hw, int4, 64).seconds
    assert expert_phase(x, hw, int4, 64, cpu_share=share).seconds < 0.6 * copied
