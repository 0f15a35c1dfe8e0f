"""Batch files: OpenAI Batch lines in and out, every line judged before the model loads,
duplicate ids, exit codes, locks on the output, flags refused before any measurement."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from offload import LLM, SamplingParams
from offload.cli.run import main
from offload.core.errors import UserError
from offload.io.atomic import atomic_write, exclusive

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _line(custom_id, url, body, **extra):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra})


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoints):
    return tiny_checkpoints["llama-gqa"][0]


@pytest.fixture
def no_load(monkeypatch):
    """Any model load fails the test: what is checked must be checked before it."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was judged")

    monkeypatch.setattr(LLM, "_load", refuse)


def test_openai_batch_file_gives_the_batch_api_output(model_dir, tmp_path):
    lines = [
        _line("cmpl", "/v1/completions", {"model": "x", "prompt": "hello there", "max_tokens": 4}),
        _line(
            "chat",
            "/v1/chat/completions",
            {
                "model": "x",
                "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 3,
            },
        ),
        _line(
            "ids",
            "/v1/completions",
            {"prompt": [104, 105, 106], "max_tokens": 2, "n": 2, "temperature": 1.0, "seed": 3},
        ),
        _line("embed", "/v1/embeddings", {"input": "x"}),
        _line("text", "/v1/completions", {"text": "where is my prompt"}),
        _line("logprobs", "/v1/completions", {"prompt": "x", "logprobs": 5}),
        '{"custom_id": "broken", "body": ',
    ]
    batch = tmp_path / "batch.jsonl"
    batch.write_text("\n".join(lines) + "\n")
    out = tmp_path / "results.jsonl"
    args = ["--model", str(model_dir), "-i", str(batch), "-o", str(out), "--quiet"]
    code = main([*args, "--chat-template", TEMPLATE, "--skip-invalid"])
    assert code == 3  # finished with some per-request errors
    rows = _rows(out)
    assert [r["custom_id"] for r in rows] == [
        "cmpl",
        "chat",
        "ids",
        "embed",
        "text",
        "logprobs",
        "line-7",
    ]
    assert all(r["id"].startswith("batch_req_") for r in rows)
    ok = {r["custom_id"]: r for r in rows[:3]}
    for row in ok.values():
        assert row["error"] is None and row["response"]["status_code"] == 200
        usage = row["response"]["body"]["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    body = ok["cmpl"]["response"]["body"]
    assert body["object"] == "text_completion" and body["usage"]["prompt_tokens"] == len(
        b"hello there"
    )
    # the same request through the Python API (the reference): the same text
    with LLM(str(model_dir)) as llm:
        want = llm.generate("hello there", SamplingParams(max_tokens=4))[0].outputs[0]
        chat_prompt = llm.chat(
            [{"role": "user", "content": "hi"}],
            SamplingParams(max_tokens=1),
            chat_template=TEMPLATE,
        )[0]
    assert body["choices"][0]["text"] == want.text
    assert body["choices"][0]["finish_reason"] == want.finish_reason
    chat = ok["chat"]["response"]["body"]
    assert (
        chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    )
    assert (
        chat["usage"]["prompt_tokens"]
        == len(chat_prompt.prompt_token_ids)
        == len(b"<user>hi<assistant>")
    )
    assert chat["usage"]["completion_tokens"] <= 3
    ids = ok["ids"]["response"]["body"]
    assert [c["index"] for c in ids["choices"]] == [0, 1] and ids["usage"]["prompt_tokens"] == 3
    errors = {r["custom_id"]: r for r in rows[3:]}
    for row in errors.values():
        assert row["response"] is None and row["error"]["message"]
    assert "/v1/embeddings" in errors["embed"]["error"]["message"]
    assert (
        "no prompt" in errors["text"]["error"]["message"]
        or "text" in errors["text"]["error"]["message"]
    )
    assert "logprobs" in errors["logprobs"]["error"]["message"]
    assert "not valid JSON" in errors["line-7"]["error"]["message"]


def test_a_chat_without_a_limit_has_one_default_wherever_it_comes_from(model_dir, tmp_path):
    """A Batch chat line, a flat `messages` line, `--chat` and `LLM.chat()` without a
    limit all take the same default: the model's generation_config.json max_new_tokens,
    else SamplingParams' 16 (vLLM's `LLM.chat`). A Batch file runs it to the end."""
    from offload.jobs import job

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    line = json.loads(_line("c", "/v1/chat/completions", chat))
    for defaults in (SamplingParams(), SamplingParams(max_tokens=7)):  # none / the model's
        batch_req = job.make_openai_request(0, line, defaults, 1)
        flat_req = job.make_request(0, chat, defaults)  # (--chat builds the same line)
        assert batch_req.params.max_tokens == flat_req.params.max_tokens == defaults.max_tokens
    batch, out = tmp_path / "batch.jsonl", tmp_path / "o.jsonl"
    batch.write_text(_line("c", "/v1/chat/completions", {**chat, "ignore_eos": True}) + "\n")
    argv = ["--model", str(model_dir), "-i", str(batch), "-o", str(out), "--quiet"]
    assert main([*argv, "--chat-template", TEMPLATE]) == 0
    assert _rows(out)[0]["response"]["body"]["usage"]["completion_tokens"] == 16
    with LLM(str(model_dir), chat_template=TEMPLATE) as llm:
        assert llm.get_default_sampling_params().max_tokens == 16


def test_a_batch_file_of_refused_lines_gets_an_error_line_each(tmp_path, no_load):
    """vLLM's run-batch writes one error line per request of a file whose every line it
    refuses (its `/v1/embeddings` example here); so does offload-run, in input order,
    without loading the model, and exits 1 (every request failed)."""
    batch, out = tmp_path / "batch.jsonl", tmp_path / "o.jsonl"
    batch.write_text(
        _line("a", "/v1/embeddings", {"input": "x"})
        + "\n"
        + _line("b", "/v1/completions", {"text": "x"})
        + "\n"
    )
    assert main(["--model", "demo", "-i", str(batch), "-o", str(out), "--quiet"]) == 1
    rows = _rows(out)
    assert [r["custom_id"] for r in rows] == ["a", "b"]
    assert all(r["response"] is None and r["error"]["code"] == "invalid_request" for r in rows)
    assert "/v1/embeddings" in rows[0]["error"]["message"]
    assert "unknown body field(s): text" in rows[1]["error"]["message"]


def test_duplicate_custom_ids_are_refused_before_the_model_loads(tmp_path, capsys, no_load):
    batch = tmp_path / "batch.jsonl"
    batch.write_text(
        _line("same", "/v1/completions", {"prompt": "x"})
        + "\n"
        + _line("other", "/v1/completions", {"prompt": "y"})
        + "\n"
        + _line("same", "/v1/completions", {"prompt": "z"})
        + "\n"
    )
    assert main(["--model", "demo", "-i", str(batch)]) == 2
    assert "duplicate custom_ids: 'same' on lines 1 and 3" in capsys.readouterr().err


def test_flat_format_checks_before_load(tmp_path, capsys, no_load):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(
        '{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n{"id": "a", "prompt": "z"}\n'
    )
    assert main(["--model", "demo", "-i", str(jobs)]) == 2
    assert "duplicate ids: 'a' on lines 1 and 3" in capsys.readouterr().err
    jobs.write_text('{"id": "t", "text": "where is my prompt"}\n')
    assert main(["--model", "demo", "-i", str(jobs)]) == 2
    err = capsys.readouterr().err
    assert 'no prompt: give "prompt" (raw text) or "messages" (a chat) (found text)' in err


@pytest.mark.parametrize(
    "argv, words",
    [
        (
            ["offload.cli.run", "--prompt", "x", "--gpu-mem", "0"],
            "offload-run: error: --gpu-mem 0 must be more than 0",
        ),
        (
            ["offload.cli.plan", "--gpu-mem", "0"],
            "offload-plan: error: --gpu-mem 0 must be more than 0",
        ),
        (
            ["offload.cli.run", "--prompt", "x", "--gpu-mem", "24"],
            "offload-run: error: size '24' (--gpu-mem) has no unit; write 24GB",
        ),
        (
            ["offload.cli.run", "--prompt", "x", "--batch-size", "0"],
            "offload-run: error: --batch-size must be",
        ),
        (
            ["offload.cli.run", "--prompt", "x", "--kv-compress", "int4-g7"],
            "offload-run: error: --kv-compress",
        ),
        (
            ["offload.cli.run", "--prompt", "x", "--max-tokens", "0"],
            "offload-run: error: max_tokens",
        ),
    ],
)
def test_bad_flags_are_refused_before_any_measurement(argv, words, monkeypatch, capsys):
    import importlib

    import offload.executor.probe as probe
    import offload.policies.choose as choose

    # the two places a plan search measures a machine that has no profile yet
    for caller in (probe, choose):
        monkeypatch.setattr(caller, "measure", lambda *a, **k: pytest.fail("measured the machine"))
    module = importlib.import_module(argv[0])
    monkeypatch.setattr(LLM, "_load", lambda *a, **k: pytest.fail("loaded the model"))
    assert module.main(["--model", "opt-30b", *argv[1:]]) == 2
    assert words in capsys.readouterr().err


def test_every_request_failing_exits_one(model_dir, tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    lines = [{"prompt": "y" * 400}, {"messages": [{"role": "user", "content": "hi"}]}]
    jobs.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    argv = ["--model", str(model_dir), "-i", str(jobs), "-o", str(out), "--quiet"]
    # past the context (without --skip-invalid refused before the load, tests/test_sizing.py)
    # and a chat for a model without a chat template
    assert main([*argv, "--skip-invalid"]) == 1
    errors = [row["error"] for row in _rows(out)]
    assert "context is 256" in errors[0] and "no chat template" in errors[1]


def test_a_second_run_on_the_same_output_is_refused_and_the_first_completes(model_dir, tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(
        "".join(json.dumps({"id": f"r{i}", "prompt": f"prompt {i}"}) + "\n" for i in range(40))
    )
    out = tmp_path / "out.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "offload.cli.run",
        "--model",
        str(model_dir),
        "-i",
        str(jobs),
        "-o",
        str(out),
        "--max-tokens",
        "8",
        "--batch-size",
        "4",
        "--quiet",
    ]
    first = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    partial = tmp_path / "out.jsonl.partial"
    deadline = time.time() + 120
    # the partial file is made under the output's lock, before the model loads: waiting
    # for results instead raced a first job that finished between two looks (CI, 2 cores)
    while time.time() < deadline and not partial.exists():
        time.sleep(0.02)
    # the first is paused mid-job (holding its lock), so the second meets it however
    # fast the first would otherwise finish
    first.send_signal(signal.SIGSTOP)
    try:
        second = subprocess.run(cmd, capture_output=True, text=True, check=False)
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 2
    assert "is in use by another offload process" in second.stderr
    assert first.wait(timeout=600) == 0, first.stderr.read()
    rows = _rows(out)
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(40)]


def test_lock_waits_or_refuses(tmp_path):
    target = tmp_path / "store"
    released = threading.Event()
    with exclusive(target, "thing"):
        with (
            pytest.raises(UserError, match="in use by another offload process"),
            exclusive(target, "thing", wait=False),
        ):
            pass

        def waiter():
            with exclusive(target, "thing"):
                released.set()

        thread = threading.Thread(target=waiter)
        thread.start()
        time.sleep(0.3)
        assert not released.is_set()  # waits while held
    thread.join(timeout=10)
    assert released.is_set()


def test_atomic_write_replaces_whole_files(tmp_path):
    path = tmp_path / "sub" / "profile.json"
    atomic_write(path, '{"a": 1}')
    atomic_write(path, b'{"a": 2}')
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in path.parent.iterdir()] == ["profile.json"]  # no temporary left


def test_atomic_write_gives_new_files_the_umask_mode_and_keeps_an_old_ones(tmp_path):
    """Outputs are the user's files: a new one takes the umask's mode (not the temporary
    file's private 0600), a replaced one keeps its mode."""
    old_umask = os.umask(0o022)
    try:
        fresh = tmp_path / "out.jsonl"
        atomic_write(fresh, "{}\n")
        assert fresh.stat().st_mode & 0o777 == 0o644
        fresh.chmod(0o640)
        atomic_write(fresh, "{}\n{}\n")
        assert fresh.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(old_umask)
