"""offload-run as a job runner: durable, resumable, streaming, never crashing on input."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from offload.cli.run import main


def _write_jobs(path, count, seed=0, extra=None):
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    with path.open("w") as f:
        for i in range(count):
            prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
            f.write(json.dumps({"id": f"r{i}", "prompt": prompt}) + "\n")
        for line in extra or []:
            f.write(line + "\n")


def _cli(model_dir, jobs, out, *more):
    return [
        sys.executable,
        "-m",
        "offload.cli.run",
        "--model",
        str(model_dir),
        "--prompts",
        str(jobs),
        "--output",
        str(out),
        "--max-new-tokens",
        "6",
        "--batch-size",
        "8",
        "--quiet",
        *more,
    ]


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoints):
    return tiny_checkpoints["llama-gqa"][0]


def _wait_for_partial(partial, lines, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if partial.exists() and partial.read_text().count("\n") > lines:
            return True
        time.sleep(0.02)
    return False


def test_sigkill_then_resume_loses_and_repeats_nothing(model_dir, tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    _write_jobs(jobs, 1500)
    reference = tmp_path / "reference.jsonl"
    subprocess.run(_cli(model_dir, jobs, reference), check=True, capture_output=True)
    out = tmp_path / "out.jsonl"
    partial = tmp_path / "out.jsonl.partial"
    proc = subprocess.Popen(_cli(model_dir, jobs, out), stderr=subprocess.DEVNULL)
    assert _wait_for_partial(partial, 100, proc), "the job finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists() and partial.exists()
    done_before = partial.read_text().count("\n") - 1
    result = subprocess.run(
        _cli(model_dir, jobs, out, "--quiet"), capture_output=True, text=True, check=True
    )
    assert "resuming" not in result.stdout
    rows = _rows(out)
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(1500)], (
        "ids lost, repeated or out of order"
    )
    assert rows == _rows(reference)
    assert not partial.exists()
    assert 0 < done_before < 1500


def test_sigint_stops_cleanly_and_says_how_to_resume(model_dir, tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    _write_jobs(jobs, 1500, seed=1)
    out = tmp_path / "out.jsonl"
    partial = tmp_path / "out.jsonl.partial"
    proc = subprocess.Popen(_cli(model_dir, jobs, out), stderr=subprocess.PIPE, text=True)
    assert _wait_for_partial(partial, 50, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "run the same command again to resume" in err
    assert "Traceback" not in err
    subprocess.run(_cli(model_dir, jobs, out), check=True, capture_output=True)
    assert [r["id"] for r in _rows(out)] == [f"r{i}" for i in range(1500)]


def test_changed_input_is_refused_and_restart_starts_over(model_dir, tmp_path, capsys):
    jobs = tmp_path / "jobs.jsonl"
    _write_jobs(jobs, 30)
    out = tmp_path / "out.jsonl"
    partial = tmp_path / "out.jsonl.partial"
    header = {"_job": {"input_sha256": "something else"}}
    done = {"_index": 0, "id": "r0", "text": " kept", "finish_reason": "length"}
    partial.write_text(json.dumps(header) + "\n" + json.dumps(done) + "\n")
    args = [
        "--model",
        str(model_dir),
        "--prompts",
        str(jobs),
        "--output",
        str(out),
        "--quiet",
        "--max-new-tokens",
        "3",
    ]
    assert main(args) == 2
    assert "--restart" in capsys.readouterr().err
    assert partial.read_text() == json.dumps(header) + "\n" + json.dumps(done) + "\n", (
        "an unfinished job's results were touched"
    )
    assert main([*args, "--restart"]) == 0
    assert len(_rows(out)) == 30


def test_a_finished_jobs_output_is_kept_unless_restart(model_dir, tmp_path, capsys):
    """Run again after it finished, a job's command is refused before anything loads and
    its results stay as they are; --restart runs it again."""
    jobs, out = tmp_path / "jobs.jsonl", tmp_path / "out.jsonl"
    _write_jobs(jobs, 5)
    args = ["--model", str(model_dir), "-i", str(jobs), "-o", str(out), "--quiet"]
    args += ["--max-tokens", "3"]
    assert main(args) == 0
    finished = out.read_bytes()
    capsys.readouterr()
    assert main(args) == 2
    assert "already holds a finished job's results; add --restart" in capsys.readouterr().err
    assert out.read_bytes() == finished
    assert main([*args, "--restart"]) == 0
    assert len(_rows(out)) == 5


def test_a_job_that_wrote_no_result_does_not_block_the_next_command(model_dir, tmp_path):
    """A run that stopped before its first result (a full disk, a wrong flag found late)
    leaves only the partial file's header: the next command starts over whatever its
    settings, since nothing would be lost."""
    jobs, out = tmp_path / "jobs.jsonl", tmp_path / "out.jsonl"
    _write_jobs(jobs, 4)
    partial = tmp_path / "out.jsonl.partial"
    partial.write_text(json.dumps({"_job": {"input_sha256": "another", "sampling": {}}}) + "\n")
    args = ["--model", str(model_dir), "-i", str(jobs), "-o", str(out), "--quiet"]
    args += ["--max-tokens", "3"]
    assert main(args) == 0
    assert [r["id"] for r in _rows(out)] == ["r0", "r1", "r2", "r3"]
    assert not partial.exists()


def test_a_job_resumes_only_in_the_formats_it_began_with(tmp_path):
    """The formats the plan computes with are part of a job's settings: a job begun with
    int4 weights is not finished in full precision (every placement gives the same
    tokens, so the rest of the policy may change). A header from before a setting was
    recorded is not compared on it."""
    from offload.api.llm import EngineArgs
    from offload.cli.common import fingerprint as _fingerprint
    from offload.core.errors import UserError
    from offload.core.sampling import SamplingParams
    from offload.jobs.resultlog import ResultLog
    from offload.kernels.formats import Compression
    from offload.policies.policy import Policy

    args = SimpleNamespace(skip_invalid=False)
    engine, params = EngineArgs(model="demo"), SamplingParams()
    int4 = Policy(weight_compression=Compression(4, 64, False))
    began = _fingerprint(args, engine, params, "sha", int4)
    assert (began["compress"], began["kv_compress"]) == ("int4", "none")
    assert _fingerprint(args, engine, params, "sha", None)["compress"] == "none"
    out = tmp_path / "out.jsonl"
    log = ResultLog(out, began, restart=False)
    log.append([{"_index": 0, "id": "r0", "text": " a", "finish_reason": "length"}])
    log.close()
    with pytest.raises(UserError, match=r"compress \('int4' then, 'none' now\)"):
        ResultLog(out, _fingerprint(args, engine, params, "sha", Policy()), restart=False)
    older = {k: v for k, v in began.items() if k not in ("compress", "kv_compress")}
    partial = tmp_path / "out.jsonl.partial"
    rows = partial.read_text().splitlines()[1:]
    partial.write_text("\n".join([json.dumps({"_job": older}), *rows]) + "\n")
    resumed = ResultLog(out, began, restart=False)
    assert resumed.done(0) and resumed.done_count == 1
    resumed.close()


def test_compression_without_caps_is_planned_within_this_machine(model_dir, tmp_path, capsys):
    """--compress chooses a plan's formats; with no caps, --nvme or --policy the run is
    planned within this machine's memory (`planning.plan`), so the flag takes effect
    rather than being ignored or refused."""
    from tests.test_sizing import CPU_PROFILE

    profile = tmp_path / "hw.json"
    profile.write_text(CPU_PROFILE.to_json())
    stats = tmp_path / "stats.json"
    args = ["--model", str(model_dir), "--prompt", "hello", "--quiet", "--compress", "int4"]
    args += ["--device", "cpu", "--profile", str(profile), "--stats", str(stats)]
    assert main(args) == 0
    policy = json.loads(stats.read_text())["policy"]
    assert policy["weight_compression"]["bits"] == 4


def _peak_rss_of_job(model_dir, tmp_path, count):
    jobs = tmp_path / f"jobs{count}.jsonl"
    _write_jobs(jobs, count, seed=count)
    out = tmp_path / f"out{count}.jsonl"
    stats = tmp_path / f"stats{count}.json"
    subprocess.run(
        _cli(model_dir, jobs, out, "--stats", str(stats), "--max-new-tokens", "4"),
        check=True,
        capture_output=True,
    )
    rows = _rows(out)
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(count)], "order not kept"
    return json.loads(stats.read_text())["peak_memory"]["cpu_rss_bytes"]


def test_memory_stays_flat_with_the_number_of_requests(model_dir, tmp_path):
    small = _peak_rss_of_job(model_dir, tmp_path, 1000)
    large = _peak_rss_of_job(model_dir, tmp_path, 4000)
    assert large - small < 25e6, (
        f"peak RSS grew {(large - small) / 1e6:.0f} MB from 1000 to 4000 requests"
    )


def test_malformed_line_stops_before_generation(model_dir, tmp_path, capsys):
    jobs = tmp_path / "jobs.jsonl"
    _write_jobs(jobs, 5, extra=['{"prompt": "fine"}', '{"prompt": oops}'])
    out = tmp_path / "out.jsonl"
    assert (
        main(["--model", str(model_dir), "--prompts", str(jobs), "--output", str(out), "--quiet"])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "jobs.jsonl:7: not valid JSON" in err and "--skip-invalid" in err
    assert not out.exists() and not (tmp_path / "out.jsonl.partial").exists()


def test_per_request_errors_are_results_and_the_job_goes_on(model_dir, tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    lines = [
        '{"id": "ok", "prompt": "hello"}',
        '{"id": "empty", "prompt": "   "}',
        '{"id": "long", "prompt": "' + "x" * 300 + '"}',
        '{"id": "unknown", "prompt": "hi", "colour": "red"}',
        '{"id": "badtemp", "prompt": "hi", "temperature": "hot"}',
        '{"id": "badtopp", "prompt": "hi", "top_p": 7}',
        '{"id": "both", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}',
        '{"prompt": broken',
        '{"id": "last", "prompt": "bye", "max_new_tokens": 2}',
    ]
    jobs.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    code = main(
        [
            "--model",
            str(model_dir),
            "--prompts",
            str(jobs),
            "--output",
            str(out),
            "--quiet",
            "--skip-invalid",
        ]
    )
    assert code == 3  # finished, some requests failed
    rows = {r["id"]: r for r in _rows(out)}
    assert list(rows) == [
        "ok",
        "empty",
        "long",
        "unknown",
        "badtemp",
        "badtopp",
        "both",
        "8",
        "last",
    ]
    assert rows["ok"]["finish_reason"] in ("stop", "length")
    assert rows["last"]["completion_tokens"] <= 2
    expected = {
        "empty": "empty prompt",
        "long": "context is 256",
        "unknown": "unknown field(s): colour",
        "badtemp": "temperature",
        "badtopp": "top_p",
        "both": "exactly one of",
        "8": "not valid JSON",
    }
    for rid, words in expected.items():
        assert rows[rid]["finish_reason"] == "error" and words in rows[rid]["error"], rows[rid]


def test_stdin_and_plain_text(model_dir, tmp_path):
    out = tmp_path / "out.jsonl"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "offload.cli.run",
            "--model",
            str(model_dir),
            "--prompts",
            "-",
            "--output",
            str(out),
            "--quiet",
            "--max-new-tokens",
            "3",
        ],
        input="first line\n\nsecond line\n",
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.returncode == 0
    rows = _rows(out)
    assert [(r["id"], r["prompt"]) for r in rows] == [("1", "first line"), ("3", "second line")]
