"""What offload-run and `LLM` check before the load, and the messages that name the
mistake (docs/guarantees.md). A test that must prove nothing loads patches the loader
to fail; faults that need real processes, signals and disks are in test_faults.py."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offload.api.llm import LLM
from offload.cli.run import main
from offload.core.errors import UserError
from offload.core.sampling import SamplingParams
from tests.test_sizing import CPU_PROFILE


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoints):
    return tiny_checkpoints["llama-gqa"][0]  # a byte-level tokenizer: ids are the bytes


@pytest.fixture
def no_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was judged")

    monkeypatch.setattr(LLM, "_load", refuse)


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err)
    return err[-1]


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _cli(model_dir, *args) -> subprocess.CompletedProcess:
    """offload-run as its own process (its log lines on its stderr, as a user sees them)."""
    command = [sys.executable, "-m", "offload.cli.run", "--model", str(model_dir)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    return subprocess.run(
        [*command, *map(str, args)], capture_output=True, text=True, env=env, timeout=300
    )


def _batch_line(custom_id: str, prompt) -> str:
    body = {"model": "m", "prompt": prompt, "max_tokens": 3}
    line = {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}
    return json.dumps(line)


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A small file system of its own at `path`, mounted with `options` (root only)."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def read_only_dir(path: Path):
    """A directory this process cannot write: a read-only tmpfs as root (who writes
    through permissions), else one without write permission."""
    if os.geteuid() == 0:
        with tmpfs(path, "ro,size=64k"):
            yield path
        return
    path.mkdir()
    path.chmod(0o555)
    try:
        yield path
    finally:
        path.chmod(0o755)


# -- token ids ------------------------------------------------------------------------------
def test_token_ids_outside_the_vocabulary_are_refused_before_the_load(
    model_dir, tmp_path, capsys, monkeypatch
):
    """An id at or past the vocabulary, or negative, failed the whole job mid-run (an
    IndexError at the same block on every resume): it is judged before the load, and
    --skip-invalid records it as an error result."""
    jobs, out = tmp_path / "batch.jsonl", tmp_path / "out.jsonl"
    jobs.write_text(
        "\n".join([_batch_line("ok", [5, 6, 7]), _batch_line("past", [5, 320]),
                   _batch_line("negative", [-1, 5])]) + "\n"
    )  # fmt: skip
    args = ["--model", str(model_dir), "-i", str(jobs), "-o", str(out), "--quiet"]
    with monkeypatch.context() as patch:
        patch.setattr(
            LLM, "_load", lambda *a, **k: pytest.fail("loaded before the ids were judged")
        )
        assert main(args) == 2
    line = _error(capsys)
    assert "request past: prompt token id(s) 320 are not in the model's vocabulary of 320" in line
    assert "--skip-invalid" in line
    assert not out.exists() and not (tmp_path / "out.jsonl.partial").exists()
    assert main([*args, "--skip-invalid"]) == 3  # finished, some requests failed
    rows = {row["custom_id"]: row for row in _rows(out)}
    assert rows["ok"]["response"]["status_code"] == 200
    assert (
        "320" in rows["past"]["error"]["message"] and "-1" in rows["negative"]["error"]["message"]
    )


def test_llm_generate_refuses_token_ids_outside_the_vocabulary(model_dir, monkeypatch):
    with LLM(str(model_dir), device="cpu") as llm:
        monkeypatch.setattr(llm, "generate_ids", lambda *a: pytest.fail("generated"))
        for ids in ([1, 320], [-1], [1, True], "12"):
            with pytest.raises(UserError, match=r"prompt_token_ids|vocabulary"):
                llm.generate({"prompt_token_ids": ids})
        with pytest.raises(UserError, match="vocabulary of 320"):
            llm.generate([[1, 2], [3, 999]])


# -- format detection -----------------------------------------------------------------------
def test_the_format_comes_from_the_content_and_the_first_log_line_says_it(
    model_dir, tmp_path, capsys
):
    """A JSON lines file with a UTF-8 byte-order mark and a .txt name ran each line as a
    raw text prompt, with exit 0: the mark is whitespace, the content decides, and the
    first log line states the format."""
    jobs, out = tmp_path / "jobs.txt", tmp_path / "out.jsonl"
    lines = [json.dumps({"id": "a", "prompt": "hello"}), json.dumps({"id": "b", "prompt": "hi"})]
    jobs.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n")
    run = _cli(model_dir, "-i", jobs, "-o", out, "--max-tokens", "2")
    assert run.returncode == 0, run.stderr
    first = run.stderr.splitlines()[0]
    assert first == f"input {jobs}: JSON lines in offload's format, detected from its content"
    assert [(r["id"], r["prompt"]) for r in _rows(out)] == [("a", "hello"), ("b", "hi")]
    batch = tmp_path / "batch.data"  # an OpenAI Batch file under any name
    batch.write_bytes(b"\xef\xbb\xbf" + _batch_line("q", "hello").encode() + b"\n")
    run = _cli(model_dir, "-i", batch, "--output", "-")
    assert run.stderr.splitlines()[0].endswith(": OpenAI Batch lines, detected from its content")
    assert json.loads(run.stdout)["custom_id"] == "q"
    text = tmp_path / "prompts.jsonl"  # a .jsonl name whose lines are not JSON: named
    text.write_text("just words\n")
    assert main(["--model", str(model_dir), "-i", str(text), "--quiet"]) == 2
    assert "prompts.jsonl:1: not valid JSON" in _error(capsys)


# -- a checkpoint without a tokenizer ----------------------------------------------------------
def test_a_checkpoint_without_a_tokenizer_is_refused_unless_bytes_are_asked_for(
    model_dir, tmp_path, capsys, monkeypatch
):
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    args = ["--model", str(bare), "--prompt", "hello", "--max-tokens", "2", "--quiet"]
    with monkeypatch.context() as patch:
        patch.setattr(LLM, "_load", lambda *a, **k: pytest.fail("loaded"))
        assert main(args) == 2
        line = _error(capsys)
        assert f"model directory {bare} has no tokenizer (tokenizer.json" in line
        assert "--byte-tokenizer" in line
        with pytest.raises(UserError, match="has no tokenizer"):
            LLM(str(bare), device="cpu")
        assert main(["--model", str(model_dir), *args[2:], "--byte-tokenizer"]) == 2
        assert "ships a tokenizer" in _error(capsys)
    assert main([*args, "--byte-tokenizer", "--output", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_tokens"] == len(b"hello")
    with LLM(str(bare), device="cpu", byte_tokenizer=True) as llm:
        assert llm.encode_prompt("hello") == list(b"hello")


# -- ids ----------------------------------------------------------------------------------
def test_json_scalar_ids_are_kept_exactly_and_others_refused(model_dir, tmp_path):
    """Ids were turned into Python's str(): 7 became "7", null "None". A JSON scalar is
    written back as given; an object or a list is an error result naming the id."""
    ids = [7, "7", None, 1.5, True, "x"]
    lines = [json.dumps({"id": {"a": 1}, "prompt": "hi"}), json.dumps({"id": [1], "prompt": "hi"})]
    lines += [json.dumps({"id": rid, "prompt": "hi"}) for rid in ids]
    jobs, out = tmp_path / "jobs.jsonl", tmp_path / "out.jsonl"
    jobs.write_text("\n".join(lines) + "\n")
    args = [
        "--model",
        str(model_dir),
        "-i",
        str(jobs),
        "-o",
        str(out),
        "--quiet",
        "--max-tokens",
        "2",
    ]
    assert main(args) == 3
    rows = _rows(out)
    for row in rows[:2]:  # (named by their line numbers)
        assert (
            row["finish_reason"] == "error" and '"id" must be a string or a number' in row["error"]
        )
    assert [row["id"] for row in rows[2:]] == ids
    assert [type(row["id"]) for row in rows[2:]] == [int, str, type(None), float, bool, str]


def test_an_id_repeated_is_refused_but_7_and_the_string_7_are_two(model_dir, tmp_path, capsys):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("\n".join(json.dumps({"id": i, "prompt": "hi"}) for i in (7, "7", 7)) + "\n")
    assert main(["--model", str(model_dir), "-i", str(jobs), "--quiet"]) == 2
    assert "duplicate ids: 7 on lines 1 and 3" in _error(capsys)


# -- output paths -------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--stats", "--trace", "--output"])
def test_an_unwritable_output_path_is_refused_before_the_load(
    model_dir, tmp_path, capsys, no_load, flag
):
    """An unwritable --trace failed after the whole job and skipped the final output; an
    unwritable --stats turned a successful job into exit 1: each is judged first."""
    with read_only_dir(tmp_path / "ro") as ro:
        args = ["--model", str(model_dir), "--prompt", "hi", "--quiet", flag, str(ro / "f.json")]
        assert main(args) == 2
        line = _error(capsys)
        assert f"cannot write {flag} {ro / 'f.json'}: directory {ro} is read-only" in line


def test_a_read_only_nvme_and_an_input_that_is_no_file_are_refused(
    model_dir, tmp_path, capsys, no_load
):
    with read_only_dir(tmp_path / "ro") as ro:
        args = ["--model", str(model_dir), "--prompt", "hi", "--quiet", "--gpu-mem", "1GB"]
        assert main([*args, "--nvme", str(ro / "store")]) == 2
        assert f"cannot write --nvme {ro / 'store'}: directory {ro} is read-only" in _error(capsys)
        with pytest.raises(UserError, match="--nvme"):
            LLM(str(model_dir), device="cpu", offload_folder=ro, max_memory={"cpu": "1GB"})
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert main([*args, "--nvme", str(a_file)]) == 2
    assert f"--nvme {a_file} is not a directory" in _error(capsys)
    assert main(["--model", str(model_dir), "-i", str(tmp_path), "--quiet"]) == 2
    assert f"prompts file {tmp_path} is a directory" in _error(capsys)


# -- the messages that contradicted themselves --------------------------------------------
def test_user_error_is_a_value_error():
    """vLLM's callers catch ValueError for bad arguments."""
    assert issubclass(UserError, ValueError)
    with pytest.raises(ValueError, match="not a device"):
        LLM("demo", device="nowhere")


def test_generate_names_none_and_a_closed_engine(model_dir):
    llm = LLM(str(model_dir), device="cpu")
    with pytest.raises(UserError, match=r"generate\(\) got no prompts \(None\)"):
        llm.generate(None)
    with pytest.raises(UserError, match=r"chat\(\) got no conversation"):
        llm.chat(None)
    assert llm.generate("hi", SamplingParams(max_tokens=1))[0].outputs[0].token_ids
    llm.close()
    for call in (lambda: llm.generate("hi"), lambda: llm.chat([{"role": "user", "content": "hi"}])):
        with pytest.raises(UserError, match="this LLM was closed"):
            call()


@pytest.mark.skipif(torch.cuda.is_available(), reason="plans for a machine without a GPU")
def test_a_cpu_cap_alone_plans_a_machine_without_a_gpu(model_dir, tmp_path, capsys):
    """On a machine without a GPU a memory cap was refused for lacking --gpu-mem, and
    `gpu_memory_utilization`'s message suggested max_memory={'cpu': ...}, which was
    then refused too: a CPU cap alone plans a CPU-only run."""
    profile = tmp_path / "hw.json"
    profile.write_text(CPU_PROFILE.to_json())
    args = [
        "--model",
        str(model_dir),
        "--prompt",
        "hi",
        "--device",
        "cpu",
        "--profile",
        str(profile),
    ]
    assert main([*args, "--cpu-mem", "8GB", "--max-tokens", "2", "--quiet", "--output", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["completion_tokens"] == 2
    with pytest.raises(UserError, match=r"max_memory=\{'cpu': '8GB'\}"):
        LLM(str(model_dir), device="cpu", gpu_memory_utilization=0.5)
    cpu_only = {"max_memory": {"cpu": "8GB"}, "profile": profile, "prompt_len": 16}
    with LLM(str(model_dir), device="cpu", **cpu_only) as llm:
        assert llm.policy is not None
        assert llm.caps.gpu_bytes + llm.caps.cpu_bytes == 8 * 10**9
        assert llm.generate("hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
