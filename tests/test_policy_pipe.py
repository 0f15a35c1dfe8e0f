"""`--policy <(...)`: a policy from a pipe or FIFO is accepted (any readable file)."""

from __future__ import annotations

import json
import os
import threading

import pytest

from offload.api.args import EngineArgs
from offload.cli.run import main as run_main
from offload.core.errors import UserError
from offload.policies.policy import Policy


def test_a_policy_from_a_fifo_runs_the_job(tiny_checkpoints, tmp_path, capsys):
    """As `offload-run --policy <(cat policy.json)`: the FIFO is read once, and the run
    (whose plan may read its policy more than once) uses it."""
    directory, _ = tiny_checkpoints["llama-gqa"]
    fifo = tmp_path / "policy.fifo"
    os.mkfifo(fifo)
    policy = Policy(2, 2)
    writer = threading.Thread(target=lambda: fifo.write_text(policy.to_json()), daemon=True)
    writer.start()
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
    argv = ["--model", str(directory), "--device", "cpu", "--policy", str(fifo)]
    argv += ["--prompt", "hello", "--max-tokens", "2", "-o", str(out), "--stats", str(stats)]
    assert run_main([*argv, "--quiet"]) == 0
    writer.join(timeout=10)
    assert json.loads(stats.read_text())["policy"] == policy.to_dict()


def test_a_missing_or_unreadable_policy_is_refused_naming_it(tmp_path):
    with pytest.raises(UserError, match="does not exist; check the path"):
        EngineArgs(model="demo", policy=tmp_path / "nope.json")
    with pytest.raises(UserError, match="is a directory"):
        EngineArgs(model="demo", policy=tmp_path)
