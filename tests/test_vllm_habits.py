"""What a vLLM user expects: the model named as given (`served_model_name`), vLLM's
`quantization` names for pre-quantized checkpoints, `LLM.chat`'s content parts and
template arguments, logging without set-up and on every CLI, progress within a block,
`--stats` while a job runs, request metrics and the profiler."""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from offload import LLM, SamplingParams
from offload.cli import run
from offload.core.errors import UserError
from tests import quantized_checkpoints, tiny_models

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_models.save("llama-gqa", tmp_path_factory.mktemp("habits") / "m")[0]


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(str(model_dir), device="cpu", dtype="float32", chat_template=TEMPLATE) as llm:
        yield llm


def _batch(path: Path) -> Path:
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                 "max_tokens": 2},
    }  # fmt: skip
    path.write_text(json.dumps(line) + "\n")
    return path


# -- the model's name -----------------------------------------------------------------
def test_results_name_the_model_as_given_not_its_snapshot(model_dir, tmp_path, monkeypatch):
    """A hub model resolves to a snapshot directory named by its hash: the log and the
    Batch output's `model` say the repo id as given, or --served-model-name."""
    import shutil

    from offload.models import resolve

    snapshot = tmp_path / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(model_dir, snapshot)
    monkeypatch.setattr(resolve, "_from_hub", lambda repo, revision=None: snapshot)
    batch = _batch(tmp_path / "in.jsonl")
    flags = ["--model", "someone/tiny-llama", "-i", str(batch), "--device", "cpu"]
    flags += ["--chat-template", TEMPLATE, "--quiet"]
    assert run.main([*flags, "-o", str(tmp_path / "a.jsonl")]) == 0
    row = json.loads((tmp_path / "a.jsonl").read_text())
    assert row["response"]["body"]["model"] == "someone/tiny-llama"
    served = [*flags, "-o", str(tmp_path / "b.jsonl"), "--served-model-name", "tiny"]
    assert run.main(served) == 0
    assert json.loads((tmp_path / "b.jsonl").read_text())["response"]["body"]["model"] == "tiny"
    with LLM("someone/tiny-llama", device="cpu", served_model_name="mine") as named:
        assert named.model_name == "mine" and "model mine (" in named.provenance()
        assert snapshot.name not in named.model_name


# -- vLLM's quantization names ----------------------------------------------------------
def test_vllms_quantization_names_the_checkpoints_own_method(tmp_path):
    """`quantization="gptq"` (`-q gptq`) on a GPTQ checkpoint reads it as it is, the same
    tokens as without; a method the checkpoint does not declare, or one on a checkpoint
    that is not pre-quantized, is refused in one line naming what it is."""
    gptq, _ = tmp_path / "gptq", None
    quantized_checkpoints.write(tiny_models.build("llama-gqa"), gptq, "gptq", True)
    params, prompt = SamplingParams(max_tokens=4), {"prompt_token_ids": [5, 6, 7]}
    with LLM(str(gptq), device="cpu", dtype="float32") as plain:
        want = plain.generate(prompt, params, use_tqdm=False)[0].token_ids
    for name in ("gptq", "gptq_marlin"):
        with LLM(str(gptq), device="cpu", dtype="float32", quantization=name) as named:
            assert named.generate(prompt, params, use_tqdm=False)[0].token_ids == want
    with pytest.raises(UserError, match=r"quantized with gptq .*give gptq"):
        LLM(str(gptq), device="cpu", quantization="awq")
    plain_dir = tiny_models.save("llama-gqa", tmp_path / "plain")[0]
    with pytest.raises(UserError, match="not pre-quantized"):
        LLM(str(plain_dir), device="cpu", quantization="compressed-tensors")
    with pytest.raises(UserError, match=r"not a format offload reads.*gptq"):
        LLM(str(plain_dir), device="cpu", quantization="fp8")


def test_cli_quantization_is_checked_before_the_load(tmp_path, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were judged")

    monkeypatch.setattr(LLM, "_load", refuse)
    plain_dir = tiny_models.save("llama-gqa", tmp_path / "plain")[0]
    capsys.readouterr()
    assert run.main(["--model", str(plain_dir), "--prompt", "x", "-q", "awq"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "quantization awq (-q)" in err[0] and "not pre-quantized" in err[0]


# -- LLM.chat --------------------------------------------------------------------------
def test_chat_takes_openai_content_parts_and_refuses_others_by_type(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]  # fmt: skip
    out = llm.chat(parts, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt == "<user>a\nb</><assistant>"  # joined as vLLM's string format
    same = llm.chat([{"role": "user", "content": "a\nb"}], SamplingParams(max_tokens=1))[0]
    assert same.prompt_token_ids == out.prompt_token_ids
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(UserError, match="message 0: a content part of type 'image_url'"):
        llm.chat(image)
    with pytest.raises(UserError, match="role"):
        llm.chat([{"content": "no role"}])


def test_chat_passes_vllms_template_arguments(llm):
    params = SamplingParams(max_tokens=1)
    turn = [{"role": "user", "content": "hi"}]
    off = llm.chat(turn, params, chat_template_kwargs={"enable_thinking": False})[0]
    assert off.prompt == "<user>hi</><assistant><no-think>"
    bare = llm.chat(turn, params, add_generation_prompt=False)[0]
    assert bare.prompt == "<user>hi</>"
    prefix = [*turn, {"role": "assistant", "content": "The answer is"}]
    going = llm.chat(prefix, params, add_generation_prompt=False, continue_final_message=True)
    assert going[0].prompt.endswith("<assistant>The answer is")  # left open
    with pytest.raises(UserError, match="add_generation_prompt=False"):
        llm.chat(prefix, params, continue_final_message=True)
    with pytest.raises(UserError, match="chat_template_kwargs"):
        llm.chat(turn, params, chat_template_kwargs=["enable_thinking"])


def test_batch_lines_read_content_parts_as_chat_does():
    from offload.jobs.openai_batch import chat_messages

    got = chat_messages([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "text", "text": "b"}]}])  # fmt: skip
    assert got == [{"role": "user", "content": "a\nb"}]
    with pytest.raises(ValueError, match="'input_audio' is not text"):
        chat_messages([{"role": "user", "content": [{"type": "input_audio"}]}])


# -- logging ---------------------------------------------------------------------------
def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("OFFLOAD_LOGGING")}
    full |= {"PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        [sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=300
    )


def test_the_python_apis_load_line_shows_without_set_up_at_the_envs_level(
    model_dir, monkeypatch, capsys, request
):
    """A script that sets up no logging sees the load's provenance line on stderr (a
    fresh process: as a user's); OFFLOAD_LOGGING_LEVEL sets the level; a program with a
    handler of its own gets the line once, through it."""
    code = f"from offload import LLM\nLLM({str(model_dir)!r}, device='cpu').close()"
    shown = _python(code)
    assert shown.returncode == 0, shown.stderr
    assert re.search(rf"INFO [0-9:]+ model {re.escape(str(model_dir))} \(safetensors", shown.stderr)
    assert "loaded in" in shown.stderr
    from offload.core import logs

    root, logger = logging.getLogger(), logging.getLogger("offload")
    monkeypatch.setattr(root, "handlers", [])  # (pytest's own: as a program without set-up)
    request.addfinalizer(functools.partial(logger.setLevel, logger.level))
    monkeypatch.setenv("OFFLOAD_LOGGING_LEVEL", "WARNING")
    logs.configure_package_logger()
    capsys.readouterr()
    LLM(str(model_dir), device="cpu", progress=False).close()
    assert "loaded in" not in capsys.readouterr().err
    monkeypatch.setenv("OFFLOAD_LOGGING_LEVEL", "INFO")
    logs.configure_package_logger()
    LLM(str(model_dir), device="cpu", progress=False).close()
    err = capsys.readouterr().err
    assert err.count("loaded in") == 1 and err.startswith("INFO "), err
    own = logging.StreamHandler(sys.stderr)
    own.setFormatter(logging.Formatter("MINE %(message)s"))
    monkeypatch.setattr(root, "handlers", [own])
    LLM(str(model_dir), device="cpu", progress=False).close()
    err = capsys.readouterr().err
    assert err.count("loaded in") == 1 and err.startswith("MINE model"), err
    assert len([h for h in logger.handlers if isinstance(h, logs._UnlessConfigured)]) == 1


@pytest.mark.parametrize("prog", ["run", "plan", "profile", "convert"])
def test_every_cli_takes_verbose_and_the_envs_level(prog, monkeypatch, capsys, request):
    import importlib

    from offload.cli import common

    module = importlib.import_module(f"offload.cli.{prog}")
    with pytest.raises(SystemExit):
        module.main(["--help"])
    assert "-v, --verbose" in capsys.readouterr().out
    # as a command run alone: no logging set up before (pytest's handlers put aside)
    root, logger = logging.getLogger(), logging.getLogger("offload")
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(root, "level", root.level)
    request.addfinalizer(functools.partial(logger.setLevel, logger.level))
    for env, flags, want in (
        (None, {"verbose": 1}, logging.DEBUG),
        ("error", {}, logging.ERROR),
        ("error", {"quiet": True}, logging.WARNING),
        (None, {}, logging.INFO),
    ):
        if env is None:
            monkeypatch.delenv("OFFLOAD_LOGGING_LEVEL", raising=False)
        else:
            monkeypatch.setenv("OFFLOAD_LOGGING_LEVEL", env)
        root.handlers = []
        common.setup_logging(**{"quiet": False, **flags})
        assert logger.level == want, (env, flags)
    monkeypatch.setenv("OFFLOAD_LOGGING_LEVEL", "loud")
    with pytest.raises(SystemExit):
        common.setup_logging(quiet=False)
    assert "OFFLOAD_LOGGING_LEVEL='loud' is not a level" in capsys.readouterr().err


# -- progress within a block, --stats while the job runs --------------------------------
@pytest.fixture
def every_step(monkeypatch):
    """Progress and --stats at every chance (their spacing 0 s): no timing in the tests."""
    from offload.cli import report
    from offload.core import progress

    monkeypatch.setattr(progress, "TICK_S", 0.0)
    monkeypatch.setattr(progress, "PLAIN_EVERY_S", 0.0)
    monkeypatch.setattr(report, "STATS_EVERY_S", 0.0)


def test_generates_bar_moves_within_a_block(llm, every_step, capsys):
    """One block of 2 prompts and 6 steps: the bar shows the tokens so far at each step,
    before any prompt is done (off a terminal: a plain line each time here)."""
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8, 9]}], params)
    lines = capsys.readouterr().err.splitlines()
    within = [line for line in lines if line.startswith("Processed prompts: 0/2")]
    tokens = [int(line.split(", ")[1].split()[0]) for line in within if "steps/s" in line]
    assert tokens == [2, 4, 6, 8, 10, 12], lines
    assert any(line.startswith("Processed prompts: 2/2 (100%), 12 tok") for line in lines)


def test_a_jobs_progress_and_stats_move_within_a_block(model_dir, tmp_path, every_step,
                                                       monkeypatch, capsys):  # fmt: skip
    """offload-run: the bar shows tokens, the step rate and the ETA at each decode step;
    --stats is rewritten (whole, atomically) during the block, and at the end says what
    produced it and on what machine."""
    import dataclasses

    from offload.cli import report
    from offload.policies.policy import Policy
    from tests.test_job_plan import LOADING

    written = []
    write_stats = report.write_stats

    def spy(path, info):
        write_stats(path, info)
        written.append(json.loads(path.read_text()))  # a whole file at every write

    monkeypatch.setattr(report, "write_stats", spy)
    lines = [json.dumps({"id": f"r{i}", "prompt": "hello", "max_tokens": 5, "ignore_eos": True})
             for i in range(3)]  # fmt: skip
    (jobs := tmp_path / "jobs.jsonl").write_text("\n".join(lines) + "\n")
    (policy := tmp_path / "policy.json").write_text(Policy(4, 1).to_json())
    (profile := tmp_path / "hw.json").write_text(
        dataclasses.replace(LOADING, has_gpu=False, gpu_context_bytes=0).to_json()
    )
    stats = tmp_path / "stats.json"
    argv = ["--model", str(model_dir), "--device", "cpu", "--policy", str(policy), "--profile",
            str(profile), "-i", str(jobs), "-o", str(tmp_path / "out.jsonl"), "--stats",
            str(stats), "--served-model-name", "tiny"]  # fmt: skip
    assert run.main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    steps = [line for line in err if line.startswith("Requests: 0/3") and "steps/s" in line]
    assert len(steps) >= 3 and all("ETA" in line for line in steps), err
    running = [w for w in written if w["run"]["state"] == "running"]
    mid_block = [w["generated_tokens"] for w in running if w["done_now"] == 0]
    assert len(set(mid_block) - {0}) >= 3, [w["generated_tokens"] for w in written]
    final = json.loads(stats.read_text())
    assert final == written[-1] and final["run"]["state"] == "finished"
    run_info = final["run"]
    assert run_info["model"] == "tiny" and run_info["argv"] and run_info["started"]
    assert run_info["offload_version"] and run_info["updated"] >= run_info["started"]
    machine = run_info["machine"]
    assert machine["hostname"] and machine["cpu_count"] >= 1 and machine["ram_bytes"] > 0
    assert final["generated_tokens"] == 15 and final["done_now"] == 3


def test_llm_shows_its_loads_progress(model_dir, capsys):
    """As vLLM's: `LLM(...)` draws the load's bar (plain lines off a terminal)."""
    LLM(str(model_dir), device="cpu").close()
    assert "loading layers: 3/3 (100%)" in capsys.readouterr().err
    LLM(str(model_dir), device="cpu", progress=False).close()
    assert "loading layers" not in capsys.readouterr().err


# -- metrics, profiler, prefix caching ------------------------------------------------
def test_request_metrics_and_get_metrics(model_dir):
    """vLLM's RequestOutput.metrics times, in order; a later block is scheduled after the
    earlier one's requests finished; get_metrics counts them in vLLM's shapes."""
    from offload.v1.metrics.reader import Counter, Gauge, Histogram

    params = SamplingParams(max_tokens=3, ignore_eos=True)
    with LLM(str(model_dir), device="cpu", dtype="float32", batch_size=1) as one:
        outs = one.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8, 9]}],
                            params, use_tqdm=False)  # fmt: skip
        for out in outs:
            m = out.metrics
            assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
            assert m.first_token_time <= m.last_token_time == m.finished_time
            assert m.time_in_queue == m.first_scheduled_time - m.arrival_time
        first, second = sorted(outs, key=lambda o: o.metrics.first_scheduled_time)
        assert second.metrics.first_scheduled_time >= first.metrics.finished_time
        metrics = {(m.name, tuple(m.labels.items())): m for m in one.get_metrics()}
    assert metrics["vllm:generation_tokens", ()].value == 6
    assert metrics["vllm:prompt_tokens", ()].value == 5
    assert metrics["vllm:request_success", (("finished_reason", "length"),)].value == 2
    ttft = metrics["vllm:time_to_first_token_seconds", ()]
    assert isinstance(ttft, Histogram) and ttft.count == 2 and ttft.buckets["+Inf"] == 2
    lengths = metrics["vllm:request_generation_tokens", ()]
    assert lengths.buckets["2"] == 0 and lengths.buckets["5"] == 2 and lengths.sum == 6
    assert isinstance(metrics["vllm:num_requests_running", ()], Gauge)
    assert isinstance(metrics["vllm:prompt_tokens", ()], Counter)


def test_start_and_stop_profile_write_a_torch_trace(model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("OFFLOAD_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    params = SamplingParams(max_tokens=2)
    config = {"profiler": "torch", "torch_profiler_dir": str(tmp_path / "given")}
    with LLM(str(model_dir), device="cpu", profiler_config=config) as llm:
        llm.start_profile()
        llm.generate({"prompt_token_ids": [5, 6]}, params, use_tqdm=False)
        trace = llm.stop_profile()
        assert trace.parent == tmp_path / "given" and trace.name.startswith("offload_")
        names = {e.get("name", "") for e in json.loads(trace.read_text())["traceEvents"]}
        assert any("linear" in n or "mm" in n for n in names), sorted(names)[:20]
        with pytest.raises(UserError, match="not running"):
            llm.stop_profile()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "env"))
    with LLM(str(model_dir), device="cpu") as llm:
        llm.start_profile("mine")
        assert llm.stop_profile().parent == tmp_path / "env"
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR")
    with (
        LLM(str(model_dir), device="cpu") as llm,
        pytest.raises(UserError, match="OFFLOAD_TORCH_PROFILER_DIR"),
    ):
        llm.start_profile()
    with pytest.raises(UserError, match=r"torch\.profiler traces only"):
        LLM(str(model_dir), device="cpu", profiler_config={"profiler": "cuda"})


def test_prefix_caching_is_accepted_with_a_log_line_and_changes_nothing(model_dir, caplog):
    params = SamplingParams(max_tokens=4)
    prompt = {"prompt_token_ids": [5, 6, 7]}
    with LLM(str(model_dir), device="cpu") as plain:
        want = plain.generate(prompt, params, use_tqdm=False)[0].token_ids
    with (
        caplog.at_level(logging.INFO, logger="offload"),
        LLM(str(model_dir), device="cpu", enable_prefix_caching=True) as cached,
    ):
        assert cached.generate(prompt, params, use_tqdm=False)[0].token_ids == want
    assert caplog.text.count("enable_prefix_caching: each prompt is prefilled whole") == 1
