"""What survives which fault (docs/guarantees.md): real processes, real signals, real
files and a small real file system; every resumed output is compared with a run that
met no fault."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from offload.api.llm import LLM
from offload.cli.run import main
from offload.core.errors import UserError
from offload.jobs.resultlog import ResultLog
from tests.test_guarantees import tmpfs
from tests.test_jobs import _cli, _rows, _wait_for_partial, _write_jobs

ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoints):
    return tiny_checkpoints["llama-gqa"][0]


def _job(model_dir, root: Path, count: int) -> tuple[Path, Path]:
    jobs, reference = root / "jobs.jsonl", root / "reference.jsonl"
    _write_jobs(jobs, count, seed=3)
    assert main(_cli(model_dir, jobs, reference)[3:]) == 0
    return jobs, reference


@pytest.fixture(scope="module")
def job(model_dir, tmp_path_factory):
    """400 requests (a run lasts for some blocks after its 50th result) and their
    results from a run that met no fault."""
    return _job(model_dir, tmp_path_factory.mktemp("job"), 400)


@pytest.fixture(scope="module")
def small_job(model_dir, tmp_path_factory):
    """40 requests and their results from a run that met no fault."""
    return _job(model_dir, tmp_path_factory.mktemp("small_job"), 40)


def _start(model_dir, jobs, out, *more) -> subprocess.Popen:
    return subprocess.Popen(
        _cli(model_dir, jobs, out, *more), stderr=subprocess.PIPE, text=True, env=ENV
    )


def _paused_with_results(proc, partial, lines=50) -> None:
    """Wait for `lines` results in the partial file, then stop the run (SIGSTOP) where
    it is, so what the test does next meets a run that is not finished."""
    assert _wait_for_partial(partial, lines, proc), "the job finished before the fault"
    proc.send_signal(signal.SIGSTOP)


@contextlib.contextmanager
def _small_drive(path: Path, size: int):
    """A drive of `size` bytes at `path`, to fill: a tmpfs, which only root can mount."""
    if os.geteuid() != 0:
        pytest.skip("filling a drive needs a small tmpfs, which only root can mount")
    with tmpfs(path, f"size={size}"):
        yield path


def _resize(path: Path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)


# -- signals ---------------------------------------------------------------------------------
def test_sigterm_stops_after_the_block_and_says_how_to_resume(model_dir, job, tmp_path):
    """SIGTERM (what `kill`, systemd and schedulers send) ended the run at once, exit
    143 and not a word: it is taken as Ctrl-C."""
    jobs, reference = job
    out, partial = tmp_path / "out.jsonl", tmp_path / "out.jsonl.partial"
    proc = _start(model_dir, jobs, out)
    assert _wait_for_partial(partial, 50, proc), "the job finished before the signal"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "SIGTERM: stopping after the current block" in err
    assert "run the same command again to resume" in err and "Traceback" not in err
    assert main(_cli(model_dir, jobs, out)[3:]) == 0  # (resumed in this process)
    assert out.read_text() == reference.read_text()


def test_a_copy_of_standard_input_is_removed_after_an_interrupted_run_and_its_resume(
    model_dir, job, tmp_path
):
    jobs, reference = job
    out, partial = tmp_path / "out.jsonl", tmp_path / "out.jsonl.partial"
    command = _cli(model_dir, "-", out)
    proc = subprocess.Popen(command, stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    proc.stdin.write(jobs.read_bytes())
    proc.stdin.close()
    assert _wait_for_partial(partial, 50, proc)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    assert not list(tmp_path.glob("offload-stdin-*")), "the interrupted run left its copy"
    subprocess.run(command, input=jobs.read_bytes(), check=True, capture_output=True, env=ENV)
    assert not list(tmp_path.glob("offload-stdin-*")), "the resumed run left its copy"
    assert out.read_text() == reference.read_text()


def test_a_pipe_is_read_once_and_checked_like_a_file(model_dir, tmp_path):
    """`-i <(cmd)` names a pipe, which the job read twice (once to check it, once to
    run it) and found empty the second time: it is copied first, like standard input."""
    jobs, out, fifo = tmp_path / "jobs.jsonl", tmp_path / "out.jsonl", tmp_path / "pipe"
    _write_jobs(jobs, 20)
    os.mkfifo(fifo)
    writer = subprocess.Popen(["sh", "-c", f"cat {jobs} > {fifo}"])
    try:
        run = subprocess.run(_cli(model_dir, fifo, out), capture_output=True, text=True,
                             env=ENV, timeout=120)  # fmt: skip
    finally:
        writer.kill()
    assert run.returncode == 0, run.stderr
    assert [r["id"] for r in _rows(out)] == [f"r{i}" for i in range(20)]
    assert not list(tmp_path.glob("offload-stdin-*"))


# -- the result log ----------------------------------------------------------------------------
def test_a_result_log_deleted_during_the_run_is_put_back_and_nothing_is_lost(
    model_dir, job, tmp_path
):
    """The run wrote on into the unlinked file and failed at the end, every result lost:
    it holds the file open, notices the name is gone and writes it back."""
    jobs, reference = job
    out, partial = tmp_path / "out.jsonl", tmp_path / "out.jsonl.partial"
    proc = _start(model_dir, jobs, out)
    _paused_with_results(proc, partial)
    partial.unlink()
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "out.jsonl.partial was deleted during the run; written again" in err
    assert out.read_text() == reference.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


def test_a_result_log_replaced_during_the_run_stops_it_with_its_results_kept(
    model_dir, job, tmp_path
):
    jobs, reference = job
    out, partial = tmp_path / "out.jsonl", tmp_path / "out.jsonl.partial"
    proc = _start(model_dir, jobs, out)
    _paused_with_results(proc, partial)
    other = tmp_path / "other"
    other.write_text("someone else's file\n")
    os.replace(other, partial)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert f"{partial} was replaced by another file during the run; stopped" in line
    kept = tmp_path / f"out.jsonl.partial.{proc.pid}"
    assert f"results kept in {kept}" in line
    assert partial.read_text() == "someone else's file\n", "the other file was touched"
    os.replace(kept, partial)
    assert main(_cli(model_dir, jobs, out)[3:]) == 0  # (resumed in this process)
    assert out.read_text() == reference.read_text()


def test_the_lock_is_on_the_open_file_and_no_lock_file_is_left(model_dir, job, tmp_path):
    """Every run left `<output>.lock` behind; deleting it (a stale lock, it seemed) let a
    second run share the first one's partial file. The lock is the partial file's own."""
    jobs, _ = job
    out, partial = tmp_path / "out.jsonl", tmp_path / "out.jsonl.partial"
    first = _start(model_dir, jobs, out)
    _paused_with_results(first, partial)
    try:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl.partial"]
        second = subprocess.run(_cli(model_dir, jobs, out), capture_output=True, text=True, env=ENV)
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 2
    assert f"--output {out} is in use by another offload process" in second.stderr
    first.send_signal(signal.SIGINT)
    assert first.wait(timeout=120) == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl.partial"]


def test_a_lock_file_goes_when_its_holder_ends(tmp_path):
    from offload.io.atomic import exclusive

    with exclusive(tmp_path / "store", "weight store directory"):
        assert (tmp_path / "store.lock").exists()
    assert list(tmp_path.iterdir()) == []


def _result_log_with_damage(model_dir, jobs, reference, tmp_path, damage, monkeypatch):
    """The partial file a run leaves (its real header, its results as the reference run
    wrote them), then damaged: `damage(lines)` returns the lines to write."""
    out = tmp_path / "out.jsonl"
    with monkeypatch.context() as patch:  # stops after the header, before any weight loads
        patch.setattr(LLM, "_load", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
        assert main(_cli(model_dir, jobs, out)[3:]) == 130
    header = (tmp_path / "out.jsonl.partial").read_text().splitlines()[0]
    rows = [json.dumps({"_index": i, **row}) for i, row in enumerate(_rows(reference))]
    (tmp_path / "out.jsonl.partial").write_text("\n".join(damage([header, *rows])) + "\n")
    return out


@pytest.mark.parametrize(
    "damage, line",
    [
        (lambda lines: [*lines[:7], '{"_index": 6, "text": "cut', *lines[8:30]], 8),
        (lambda lines: [*lines[:12], "", *lines[12:30]], 13),
        (lambda lines: [*lines[:5], '{"no": "index"}', *lines[5:30]], 6),
    ],
    ids=["bad line", "blank line", "no index"],
)
def test_a_damaged_result_log_names_the_line_and_keeps_the_results_before_it(
    model_dir, small_job, tmp_path, monkeypatch, caplog, damage, line
):
    jobs, reference = small_job
    out = _result_log_with_damage(model_dir, jobs, reference, tmp_path, damage, monkeypatch)
    assert main(_cli(model_dir, jobs, out)[3:]) == 0
    message = f"out.jsonl.partial line {line} is damaged"
    assert [r.message for r in caplog.records if message in r.message], caplog.text
    assert f"kept the {line - 2} results before it" in caplog.text
    assert out.read_text() == reference.read_text()


def test_a_damaged_header_is_named_not_taken_for_another_job(
    model_dir, small_job, tmp_path, monkeypatch, capsys
):
    jobs, reference = small_job
    cut = lambda lines: [lines[0][:30], *lines[1:10]]  # noqa: E731
    out = _result_log_with_damage(model_dir, jobs, reference, tmp_path, cut, monkeypatch)
    partial = (tmp_path / "out.jsonl.partial").read_text()
    capsys.readouterr()
    assert main(_cli(model_dir, jobs, out)[3:]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "out.jsonl.partial line 1 (the job's settings) is damaged" in err
    assert "different" not in err and "--restart" in err
    assert (tmp_path / "out.jsonl.partial").read_text() == partial, "the results were touched"
    assert main([*_cli(model_dir, jobs, out)[3:], "--restart"]) == 0
    assert out.read_text() == reference.read_text()


def test_a_result_line_past_the_job_is_damaged_not_a_crash(tmp_path):
    log = ResultLog(tmp_path / "out.jsonl", {"input_sha256": "x"}, restart=False, total=3)
    log.append([{"_index": 0, "id": "a"}, {"_index": 1, "id": "b"}])
    log.close()
    with open(tmp_path / "out.jsonl.partial", "a") as f:
        f.write('{"_index": 7, "id": "h"}\n')
    resumed = ResultLog(tmp_path / "out.jsonl", {"input_sha256": "x"}, restart=False, total=3)
    assert resumed.done_count == 2 and not resumed.done(2)
    resumed.close()
    assert (tmp_path / "out.jsonl.partial").read_text().count("\n") == 3


# -- a full disk -------------------------------------------------------------------------------
def test_a_full_disk_is_one_line_and_the_same_command_resumes(model_dir, job, tmp_path, capsys):
    """Three chained ENOSPC tracebacks became one line naming the path, the space it
    needs and the fix; what was written stays, and the same command finishes the job
    once there is room: first the results' drive fills, then the final copy's."""
    jobs, reference = job
    size = reference.stat().st_size
    with _small_drive(tmp_path / "small", 16 * 1024) as drive:
        out = drive / "out.jsonl"
        argv = _cli(model_dir, jobs, out)[3:]
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err
        line = err.strip().splitlines()[-1]
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert line.startswith(
            f"offload-run: error: no space left for {out}.partial: it needs about "
        )
        assert "run the same command again: the" in line and "results written are kept" in line
        kept = (drive / "out.jsonl.partial").read_text()
        assert kept.endswith("\n") and kept.count("\n") > 1, "nothing kept, or a torn line"
        _resize(drive, (int(size * 1.7) // 4096 + 1) * 4096)  # the results fit, not the copy
        assert main(argv) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith(f"offload-run: error: no space left for {out}: it needs about ")
        assert f"the results are kept in {out}.partial" in line
        assert not out.exists()
        _resize(drive, 4 * size)
        assert main(argv) == 0
        assert out.read_text() == reference.read_text()
        assert sorted(p.name for p in drive.iterdir()) == ["out.jsonl"]


# -- several processes ----------------------------------------------------------------------
def test_dp_without_an_output_and_bad_input_are_refused_before_any_rank_starts(
    model_dir, tmp_path, capsys, monkeypatch
):
    from offload.parallel import launch

    monkeypatch.setattr(launch, "launch", lambda *a, **k: pytest.fail("ranks were started"))
    base = ["--model", str(model_dir), "--device", "cpu", "--quiet"]
    assert main([*base, "--prompt", "hi", "--dp", "2"]) == 2
    assert "--dp needs --output FILE" in capsys.readouterr().err
    assert main([*base, "--prompt", "hi", "--dp", "2", "-o", "-"]) == 2
    assert "--dp needs --output FILE" in capsys.readouterr().err
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"prompt": oops}\n')
    assert main([*base, "-i", str(jobs), "--tp", "2", "-o", str(tmp_path / "o")]) == 2
    assert "jobs.jsonl:1: not valid JSON" in capsys.readouterr().err
    assert main([*base, "--prompt", "hi", "--tp", "3"]) == 2
    assert "--tp 3 does not divide llama-gqa's 4 attention heads" in capsys.readouterr().err


def test_the_demo_runs_on_three_ranks_as_on_one(tmp_path, capsys):
    """The demo's --tp 3 failed every time ("its message is above", and nothing above):
    the ranks sharded the preset's config, not the GGUF file's own."""
    argv = ["--model", "demo", "--device", "cpu", "--prompt", "The capital of France is"]
    argv += ["--max-tokens", "4", "--quiet", "--output"]
    assert main([*argv, "-"]) == 0
    one = capsys.readouterr()
    three = subprocess.run(
        [sys.executable, "-m", "offload.cli.run", *argv, str(tmp_path / "o.jsonl"), "--tp", "3"],
        capture_output=True, text=True, env=ENV, timeout=300,
    )  # fmt: skip
    assert three.returncode == 0, three.stderr
    assert _rows(tmp_path / "o.jsonl")[0]["text"] == json.loads(one.out)["text"]


def _refusing_rank(argv: list[str]) -> int:
    from offload.parallel.launch import report_failure

    rank = int(os.environ["RANK"])
    if rank == 1:
        report_failure("offload-run[rank 1]: error: the cause", "the cause, and its fix")
        return 2
    time.sleep(30)  # the launcher stops it
    return 0


def _raising_rank(argv: list[str]) -> int:
    if int(os.environ["RANK"]) == 1:
        raise RuntimeError("an invariant broke")
    time.sleep(30)
    return 0


@pytest.mark.parametrize(
    "rank_main, cause",
    [
        (_refusing_rank, "rank 1 of 2 refused the run: the cause, and its fix"),
        (_raising_rank, "rank 1 of 2 failed: RuntimeError: an invariant broke; all ranks were"),
    ],
)
def test_a_failed_rank_is_named_by_its_own_cause_through_the_launcher(
    rank_main, cause, monkeypatch
):
    """A rank that stopped on an error was reported as "its message is above", with
    nothing above, and every failure advised running the same command again."""
    from offload.parallel.launch import launch

    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "2"))

    with pytest.raises(UserError) as failed:
        launch("offload-run", rank_main, [], 2, fork=True)
    assert str(failed.value).startswith(cause), failed.value
    assert "above" not in str(failed.value) and "same command again" not in str(failed.value)
