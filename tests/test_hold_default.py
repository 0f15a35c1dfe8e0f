"""Where the GPU cap holds the caching allocator by default, and where it says it does
not (CPU: the rule, not the allocator; the allocator itself: tests/test_gpu_caps.py)."""

from __future__ import annotations

import logging

import torch

from offload.api.args import EngineArgs
from offload.api.planning import Plan, holds_allocator
from offload.cli.run import build_parser
from offload.policies.caps import Baseline, Caps

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def _plan(gpu_bytes: int | None) -> Plan:
    return Plan(None, Caps(gpu_bytes=gpu_bytes), Baseline(), 8, 16, 4)


def test_a_gpu_cap_holds_the_allocator_by_default_and_the_flag_opts_out(caplog):
    default = EngineArgs(model="demo", gpu_mem="24GB")
    assert default.hold_gpu_mem is None
    assert holds_allocator(default, _plan(24 * 10**9), CUDA, tensor_parallel=False)
    # no --gpu-mem: the plan's caps are the machine's, and the allocator is left free
    uncapped = EngineArgs(model="demo")
    assert not holds_allocator(uncapped, _plan(80 * 10**9), CUDA, tensor_parallel=False)
    assert not holds_allocator(default, _plan(24 * 10**9), CPU, tensor_parallel=False)
    off = EngineArgs(model="demo", gpu_mem="24GB", hold_gpu_mem=False)
    assert not holds_allocator(off, _plan(24 * 10**9), CUDA, tensor_parallel=False)
    with caplog.at_level(logging.WARNING):
        assert not holds_allocator(default, _plan(24 * 10**9), CUDA, tensor_parallel=True)
    assert "not held to --gpu-mem under tensor parallelism" in caplog.text
    flags = build_parser().parse_args
    assert flags(["--model", "demo"]).hold_gpu_mem is None
    assert flags(["--model", "demo", "--no-hold-gpu-mem"]).hold_gpu_mem is False
    assert flags(["--model", "demo", "--hold-gpu-mem"]).hold_gpu_mem is True
