"""One road from request to plan: offload-plan prints the plan offload-run uses for the
same flags and job, every run is planned (without caps: against this machine's memory),
and the plan explains itself (CPU, invented profile, no timing)."""

from __future__ import annotations

import json
import random

import pytest

from offload.api.llm import LLM
from offload.cli.plan import main as plan_main
from offload.cli.run import main as run_main
from offload.core.errors import UserError
from tests.test_sizing import CPU_PROFILE


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoints):
    return tiny_checkpoints["llama-gqa"][0]  # byte tokenizer: a prompt's tokens are its bytes


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(CPU_PROFILE.to_json())
    return str(path)


@pytest.fixture
def no_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the plan refused it")

    monkeypatch.setattr(LLM, "_load", refuse)


def _job_file(path, count: int, seed: int) -> str:
    rng = random.Random(seed)
    rows = [
        {"id": f"r{i}", "prompt": "x" * rng.randint(3, 60), "max_tokens": rng.choice((2, 3, 5))}
        for i in range(count)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


# (CPU caps of 8 GB: the run's fit check counts this test process's own resident bytes,
# a few GB in a test runner that has run many tests)
INT8 = ["--compress", "int8", "--kv-compress", "int8"]
CASES = {
    "gpu and cpu caps": ["--gpu-mem", "2MB", "--cpu-mem", "8GB"],
    "a cpu cap alone": ["--cpu-mem", "8GB"],
    "int8 weights and KV": ["--gpu-mem", "1GB", "--cpu-mem", "8GB", *INT8],
    "formats to choose among": ["--gpu-mem", "2MB", "--cpu-mem", "8GB", "--compress", "auto"],
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("requests", [7, 45])
def test_offload_plan_prints_the_policy_the_run_records(
    name, requests, model_dir, profile, tmp_path, capsys
):
    """The same flags and job file: offload-plan's policy and prediction are the ones
    offload-run's --stats records."""
    jobs = _job_file(tmp_path / "jobs.jsonl", requests, seed=requests)
    flags = ["--model", str(model_dir), "--device", "cpu", "--profile", profile, *CASES[name]]
    flags += ["-i", jobs, "--max-tokens", "4"]
    assert plan_main([*flags, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    stats = tmp_path / "stats.json"
    out = tmp_path / "out.jsonl"
    assert run_main([*flags, "-o", str(out), "--stats", str(stats), "--quiet"]) == 0
    recorded = json.loads(stats.read_text())
    assert planned["policy"] == recorded["policy"]
    assert planned["job"]["seconds"] == pytest.approx(recorded["predicted"]["seconds"])
    assert sum(c["chosen"] for c in recorded["candidates"]) == 1


def test_offload_plan_takes_a_prompt_as_offload_run_does(model_dir, profile, capsys):
    flags = ["--model", str(model_dir), "--device", "cpu", "--profile", profile]
    flags += ["--gpu-mem", "2MB", "--cpu-mem", "8GB", "--prompt", "hello there", "--json"]
    assert plan_main(flags) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["made"] == "searched" and planned["job"]["requests"] == 1


def test_the_plan_explains_itself(model_dir, profile, tmp_path, capsys):
    """--explain --json: the chosen plan and its ranked neighbours, each with its policy,
    predicted job time (null where it does not fit) and why; one that does not fit names
    the cap it breaks and by how much."""
    jobs = _job_file(tmp_path / "jobs.jsonl", 30, seed=3)
    flags = ["--model", str(model_dir), "--device", "cpu", "--profile", profile, "-i", jobs]
    flags += ["--gpu-mem", "2MB", "--cpu-mem", "8GB", "--compress", "auto", "--explain"]
    assert plan_main([*flags, "--json"]) == 0
    candidates = json.loads(capsys.readouterr().out)["candidates"]
    assert len(candidates) >= 5
    assert all({"policy", "job_seconds", "reason", "bottleneck"} <= set(c) for c in candidates)
    chosen = [c for c in candidates if c["chosen"]]
    assert len(chosen) == 1
    timed = [c["job_seconds"] for c in candidates if c["job_seconds"] is not None]
    assert timed == sorted(timed), "ranked by predicted job time"
    changes = " ".join(c["change"] for c in candidates)
    for words in ("micro-batch", "weights int4", "weights int8"):
        assert words in changes
    unfit = [c for c in candidates if c["job_seconds"] is None]
    assert unfit and any("breaks --gpu-mem by" in c["reason"] for c in unfit)
    assert plan_main(flags) == 0
    assert "why this plan" in capsys.readouterr().out


def test_without_caps_a_model_larger_than_this_machine_is_refused_before_the_load(capsys, no_load):
    """No caps: the caps are this machine's. OPT-30B whole in float32 (120 GB) on a CPU
    with 24 GB is refused in one line with the fix, before anything loads; the kernel
    never kills the run."""
    argv = ["--model", "opt-30b", "--dummy", "--device", "cpu", "--prompt", "hi", "--quiet"]
    assert run_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit this machine whole" in err[0]
    assert "--nvme" in err[0] and "--compress" in err[0]
    with pytest.raises(UserError, match="does not fit this machine whole"):
        LLM("opt-30b", dummy=True, device="cpu")


def test_without_caps_a_model_that_fits_runs_whole_and_the_plan_says_so(model_dir, capsys):
    flags = ["--model", str(model_dir), "--device", "cpu", "--prompt", "hi"]
    assert plan_main([*flags, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["policy"] is None and planned["made"] == "whole"
    assert planned["caps"]["cpu_bytes"] > 0
