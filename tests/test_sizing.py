"""offload-run sizes its plan for the job, and refuses what cannot run before the load."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from offload.api.llm import LLM
from offload.cli.run import main
from tests.test_policies import PROFILE

# a CPU machine: "GPU" caps bound the executor's device buffers, sized by the plan
CPU_PROFILE = dataclasses.replace(PROFILE, has_gpu=False, gpu_context_bytes=0, process_base_bytes=0)


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoints):
    return tiny_checkpoints["llama-gqa"][0]  # byte tokenizer: a prompt's tokens are its bytes


@pytest.fixture
def caps(tmp_path):
    """Caps for the tiny model (the plan search runs) with a CPU machine's profile."""
    profile = tmp_path / "hw.json"
    profile.write_text(CPU_PROFILE.to_json())
    return ["--device", "cpu", "--cpu-mem", "3GB", "--profile", str(profile)]


@pytest.fixture
def no_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the job was judged")

    monkeypatch.setattr(LLM, "_load", refuse)


def _jobs(path, prompts: dict[str, str], **extra) -> str:
    lines = [json.dumps({"id": rid, "prompt": text, **extra.get(rid, {})}) for rid, text in prompts.items()]  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _last_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err)
    return err[-1]


def test_prompts_longer_than_prompt_len_are_refused_before_loading(
    model_dir, caps, tmp_path, capsys, no_load
):
    jobs = _jobs(tmp_path / "jobs.jsonl", {"short": "hi", "long": "hello there, model"})
    out = tmp_path / "out.jsonl"
    argv = ["--model", str(model_dir), *caps, "--gpu-mem", "2MB", "-i", jobs, "-o", str(out)]
    assert main([*argv, "--prompt-len", "4", "--quiet"]) == 2
    assert _last_error(capsys) == (
        "offload-run: error: request long has a prompt of 18 tokens but --prompt-len is 4; "
        "raise --prompt-len to 18 or omit it (the plan is then sized for the job's longest prompt)"
    )
    assert not out.exists() and not (tmp_path / "out.jsonl.partial").exists()


def test_the_plan_is_sized_for_the_jobs_longest_prompt(model_dir, caps, tmp_path, caplog):
    # the default of 512 prompt tokens would not fit this model's context of 256
    prompts = {"a": "x" * 5, "b": "y" * 30, "c": "z" * 11}
    jobs = _jobs(tmp_path / "jobs.jsonl", prompts, c={"max_tokens": 7})
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
    argv = ["--model", str(model_dir), *caps, "--gpu-mem", "2MB", "-i", jobs, "-o", str(out)]
    with caplog.at_level(logging.INFO, logger="offload"):
        assert main([*argv, "--max-tokens", "3", "--stats", str(stats), "--quiet"]) == 0
    assert "plan sized for prompts of 30 tokens (the job's longest) and 7 new tokens" in caplog.text
    summary = json.loads(stats.read_text())
    assert summary["planned_for"] == {"prompt_tokens": 30, "new_tokens": 7}
    # the job's prediction: one block of its 3 requests, at their longest prompt and
    # largest budget
    blocks = summary["predicted"]["blocks"]
    assert [(b["rows"], b["prompt_len"], b["gen_len"], b["count"]) for b in blocks] == [
        (3, 30, 7, 1)
    ]
    assert "predicted for the job:" in caplog.text
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["completion_tokens"] for r in rows] == [3, 3, 7]


def test_a_prompt_past_the_context_stops_a_file_job_before_loading(
    model_dir, tmp_path, capsys, no_load
):
    jobs = _jobs(tmp_path / "jobs.jsonl", {"ok": "hello", "long": "y" * 300})
    assert main(["--model", str(model_dir), "-i", jobs, "--quiet"]) == 2
    assert _last_error(capsys) == (
        "offload-run: error: request long: a prompt has 300 tokens but the model's context is "
        "256; shorten it, or pass --skip-invalid to record such requests as errors and go on"
    )


def test_a_prompt_too_long_for_the_caps_is_refused_or_skipped(model_dir, caps, tmp_path, capsys):
    # at 1 MB of "GPU" the search fits prompts up to about 128 tokens (+ 4), not 200
    prompts = {"short": "a" * 10, "mid": "b" * 100, "long": "c" * 220}
    jobs = _jobs(tmp_path / "jobs.jsonl", prompts)
    out = tmp_path / "out.jsonl"
    argv = ["--model", str(model_dir), *caps, "--gpu-mem", "1MB", "-i", jobs, "-o", str(out)]
    argv += ["--max-tokens", "4", "--quiet"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LLM, "_load", lambda *a, **k: pytest.fail("loaded the model"))
        assert main(argv) == 2
    assert _last_error(capsys) == (
        "offload-run: error: request long has a prompt of 220 tokens, longer than any plan "
        "fits in the memory caps (of this job's prompts, those up to 100 tokens fit); shorten "
        "it, raise the caps, or pass --skip-invalid to record such requests as errors and go on"
    )
    assert main([*argv, "--skip-invalid"]) == 3  # finished, some requests failed
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["short"]["completion_tokens"] == rows["mid"]["completion_tokens"] == 4
    assert rows["long"]["finish_reason"] == "error"
    assert "220 tokens but the plan fits at most 100" in rows["long"]["error"]


def test_requests_that_fail_before_generation_do_not_size_the_plan(
    model_dir, caps, tmp_path, caplog
):
    # an empty prompt, a chat without a chat template and one past the context (skipped)
    lines = [
        {"id": "ok", "prompt": "hello"},
        {"id": "empty", "prompt": " "},
        {"id": "chat", "messages": [{"role": "user", "content": "hi"}]},
        {"id": "long", "prompt": "y" * 300},
    ]
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    argv = ["--model", str(model_dir), *caps, "--gpu-mem", "2MB", "-i", str(jobs), "-o", str(out)]
    with caplog.at_level(logging.INFO, logger="offload"):
        assert main([*argv, "--max-tokens", "2", "--skip-invalid", "--quiet"]) == 3
    assert "plan sized for prompts of 5 tokens (the job's longest)" in caplog.text
    errors = {r["id"]: r.get("error") for r in map(json.loads, out.read_text().splitlines())}
    assert errors["ok"] is None
    assert "empty prompt" in errors["empty"] and "chat template" in errors["chat"]
    assert "context is 256" in errors["long"]


def test_a_cap_above_the_machine_is_refused_before_the_search(
    model_dir, tmp_path, capsys, no_load, monkeypatch
):
    """A --cpu-mem above what the machine has (its cgroup limit or MemTotal) would be
    planned for and then not kept: the engine's check holds the smaller. Refused at once,
    naming both and where the machine's figure came from."""
    from offload.api import planning
    from offload.policies import caps as caps_module

    def searched(*args, **kwargs):
        raise AssertionError("the search ran for a cap the machine cannot keep")

    monkeypatch.setattr(planning, "_search", searched)
    monkeypatch.setattr(caps_module, "node_memory_limit", lambda: (8 * 10**9, "MemTotal"))
    argv = ["--model", str(model_dir), "--device", "cpu", "--prompt", "hi", "--quiet"]
    assert main([*argv, "--cpu-mem", "120GB"]) == 2
    assert _last_error(capsys) == (
        "offload-run: error: --cpu-mem 120.00 GB is more than this machine has (8.00 GB, "
        "MemTotal); lower it, or leave it out to plan for this machine's memory"
    )
    assert main([*argv, "--cpu-mem", "120GB", "--gpu-mem", "1GB", "--nvme", str(tmp_path)]) == 2
