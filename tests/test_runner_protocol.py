"""Both runners implement the `Runner` protocol the engine and the CLI use."""

from __future__ import annotations

import inspect

import pytest

from offload.executor.executor import Executor
from offload.executor.runner import PlainRunner, Runner

MEMBERS = [
    name for name in dir(Runner) if not name.startswith("_") and name not in dir(object)
] + list(Runner.__annotations__)


@pytest.mark.parametrize("cls", [PlainRunner, Executor])
def test_runner_implements_the_protocol(cls, tiny_checkpoints):
    assert {"start", "forward", "trace_report", "memory_report", "load_seconds"} <= set(MEMBERS)
    for name in MEMBERS:
        if name in Runner.__annotations__:
            continue  # attributes set in __init__, checked on an instance below
        assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
        proto, impl = getattr(Runner, name), getattr(cls, name)
        if callable(proto) and callable(impl):
            want = list(inspect.signature(proto).parameters)
            got = list(inspect.signature(impl).parameters)
            assert got[: len(want)] == want, f"{cls.__name__}.{name}{got} vs {want}"


def test_plain_runner_instance_is_a_runner(tiny_checkpoints):
    from offload import LLM

    llm = LLM(str(tiny_checkpoints["opt"][0]), device="cpu")
    assert isinstance(llm.runner, Runner)
    assert llm.runner.trace_report() is None and llm.runner.peak_disk_bytes() == 0
