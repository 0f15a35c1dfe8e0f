"""offload-run end to end, and its answers to bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from offload.cli.run import main


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "no error message"
    assert "Traceback" not in "\n".join(err)
    return err[-1]


def test_jsonl_in_jsonl_out(tiny_checkpoints, tmp_path, capsys):
    directory, _ = tiny_checkpoints["llama-gqa"]
    prompts = tmp_path / "jobs.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hello"}\n\n{"prompt": "hi there, model"}\n')
    out = tmp_path / "out.jsonl"
    code = main(
        [
            "--model",
            str(directory),
            "--prompts",
            str(prompts),
            "--output",
            str(out),
            "--max-new-tokens",
            "5",
            "--quiet",
        ]
    )
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "3"]
    for row in rows:
        assert set(row) == {
            "id",
            "prompt",
            "text",
            "prompt_tokens",
            "completion_tokens",
            "finish_reason",
        }
        assert row["completion_tokens"] <= 5 and row["finish_reason"] in ("stop", "length")
    assert rows[0]["prompt_tokens"] == len(b"hello")  # byte tokenizer: no tokenizer shipped
    assert "tok/s" in capsys.readouterr().err


def test_plain_text_prompts_and_stdout(tiny_checkpoints, tmp_path, capsys):
    directory, _ = tiny_checkpoints["opt"]
    prompts = tmp_path / "jobs.txt"
    prompts.write_text("first prompt\nsecond prompt\n")
    assert (
        main(
            [
                "--model",
                str(directory),
                "--prompts",
                str(prompts),
                "--output",
                "-",
                "--max-new-tokens",
                "3",
                "--quiet",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in rows] == ["first prompt", "second prompt"]


def test_preset_runs_with_dummy_weights(capsys):
    # the smallest preset with random weights, so no download is needed
    code = main(
        [
            "--model",
            "smollm2-135m-instruct",
            "--dummy",
            "--prompt",
            "x",
            "--max-new-tokens",
            "2",
            "--quiet",
            "--output",
            "-",
        ]
    )
    assert code == 0
    assert json.loads(capsys.readouterr().out)["completion_tokens"] == 2


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--model", "/no/such/model", "--prompt", "x"], "does not exist"),
        (["--model", "no-such-preset", "--prompt", "x"], "unknown model"),
        (
            ["--model", "someone/not-cached-model", "--prompt", "x"],
            "not in the local Hugging Face cache",
        ),
        (["--model", "demo", "--prompts", "/no/such/prompts.jsonl"], "does not exist"),
        (["--model", "demo", "--prompt", "x", "--top-p", "2"], "top_p"),
        (["--model", "demo", "--prompt", "x", "--hold-gpu-mem"], "give --gpu-mem"),
        (
            [
                "--model",
                "demo",
                "--prompt",
                "x",
                "--device",
                "cpu",
                "--gpu-mem",
                "2GB",
                "--hold-gpu-mem",
            ],
            "has no GPU",
        ),
        (
            ["--model", "demo", "--prompt", "x", "--output", "/no/such/dir/out.jsonl"],
            "cannot write",
        ),
    ],
)
def test_user_mistakes_give_one_line(args, expected, capsys):
    assert main(args) == 2
    assert expected in _error_line(capsys)


def test_malformed_jsonl_line_is_named(tmp_path, capsys):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"prompt": "ok"}\n{"prompt": oops}\n')
    assert main(["--model", "demo", "--prompts", str(prompts)]) == 2
    assert "bad.jsonl:2: not valid JSON" in _error_line(capsys)


def test_truncated_safetensors(tiny_checkpoints, tmp_path, capsys):
    import shutil

    directory, _ = tiny_checkpoints["bloom"]
    broken = tmp_path / "broken"
    shutil.copytree(directory, broken)
    shard = sorted(broken.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    assert main(["--model", str(broken), "--prompt", "x", "--quiet"]) == 2
    assert "the file is truncated" in _error_line(capsys)  # (found by its header)


def test_prompt_longer_than_context(tiny_checkpoints, tmp_path, capsys):
    directory, model = tiny_checkpoints["opt"]
    out = tmp_path / "out.jsonl"
    out.write_text("earlier results\n")
    long_prompt = "y" * (model.config.max_position_embeddings + 5)
    # --restart: the earlier output is kept even where a run would replace it, since the
    # job is refused before anything is written
    args = ["--model", str(directory), "--prompt", long_prompt, "--output", str(out), "--quiet"]
    assert main([*args, "--restart"]) == 2
    assert "context is 256" in _error_line(capsys)
    assert out.read_text() == "earlier results\n", "an earlier output was lost"


def test_console_script_exits_nonzero_without_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "offload.cli.run", "--model", "/no/such/dir", "--prompt", "x"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        == "offload-run: error: model path /no/such/dir does not exist; check the path"
    )
