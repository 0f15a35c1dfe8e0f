"""What a new user meets on the edges in the first hour (docs/guarantees.md): a one-line
refusal where a traceback was, a refusal where a wrong value was silently taken, a
refusal before the long work rather than after it, a path check that agrees with its
writer, and the dependencies that are declared being the ones imported."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from offload.api.front import MAX_TOKEN_BYTES
from offload.api.llm import LLM
from offload.cli.plan import main as plan_main
from offload.cli.profile import main as profile_main
from offload.cli.run import main
from offload.core.errors import UserError
from offload.core.sampling import SamplingParams
from offload.jobs.job_loop import ERROR_PROMPT_CHARS
from offload.models.resolve import ModelSpec, resolve_model
from offload.policies.caps import HOST_SLACK_BYTES, Baseline, cpu_only_caps
from tests import tiny_models
from tests.test_guarantees import read_only_dir
from tests.test_sizing import CPU_PROFILE

ROOT = Path(__file__).resolve().parents[1]
CONTEXT = 256  # the tiny llama's max_position_embeddings
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny llama (byte-level tokenizer, 7 shards), saved once for this module."""
    return tiny_models.save("llama-gqa", tmp_path_factory.mktemp("ckpt") / "llama")[0]


@pytest.fixture
def copy_of(model_dir, tmp_path):
    """A copy of the tiny checkpoint to damage."""
    target = tmp_path / "model"
    shutil.copytree(model_dir, target)
    return target


@pytest.fixture
def no_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was judged")

    monkeypatch.setattr(LLM, "_load", refuse)


def _error(capsys) -> str:
    """The last line on stderr, which must be the only error line and no traceback."""
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "Traceback" not in "\n".join(err), err
    assert sum("error:" in line for line in err) == 1, err
    return err[-1]


def _jobs(path: Path, lines: list[str]) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- 1. a one-line refusal where a traceback was ---------------------------------------------
def test_a_cpu_cap_below_what_the_process_holds_is_refused_naming_both(model_dir, capsys, no_load):
    """`--cpu-mem 1GB` on the CPU device ended in "memory cap gpu_bytes=0 must be
    positive": it names the cap, what the process holds and the fix, on the command
    line, in `LLM(max_memory=...)` and where the split is computed."""
    argv = ["--model", str(model_dir), "--device", "cpu", "--prompt", "hi", "--cpu-mem", "1GB"]
    assert main(argv) == 2
    line = _error(capsys)
    assert line.startswith("offload-run: error: the CPU cap (--cpu-mem, max_memory['cpu']) 1.00")
    assert "this process already holds" in line and "raise the cap above" in line
    with pytest.raises(UserError, match=r"this process already holds .* raise the cap above"):
        LLM(str(model_dir), device="cpu", max_memory={"cpu": "1GB"})
    held = 2 * 10**9
    with pytest.raises(UserError, match=r"already holds 2\.00 GB"):
        cpu_only_caps(held + HOST_SLACK_BYTES, Baseline(0, held))
    assert cpu_only_caps(held + HOST_SLACK_BYTES + 2, Baseline(0, held))[0] == 1


def test_a_config_without_a_required_field_names_the_field_and_the_file(copy_of, capsys):
    config = json.loads((copy_of / "config.json").read_text())
    del config["hidden_size"]
    (copy_of / "config.json").write_text(json.dumps(config))
    assert main(["--model", str(copy_of), "--prompt", "hi"]) == 2
    line = _error(capsys)
    assert f"{copy_of / 'config.json'} lacks the field 'hidden_size'" in line, line
    with pytest.raises(UserError, match="lacks the field 'hidden_size'"):
        LLM(str(copy_of))


def test_a_gguf_without_a_required_key_names_the_key_and_the_file(tmp_path, capsys):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_uint32("llama.attention.head_count", 4)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert main(["--model", str(path), "--prompt", "hi"]) == 2
    line = _error(capsys)
    assert f"GGUF file {path} lacks the metadata key 'llama.embedding_length'" in line, line


def test_a_lone_surrogate_is_an_invalid_line_and_a_refused_prompt(model_dir, tmp_path, capsys):
    """ "\\ud800" reached the tokenizer, which raised TypeError: in a file it is a bad
    line (named; an error result with --skip-invalid, the rest generated), on the
    command line and in `LLM.generate`/`chat` a one-line refusal."""
    jobs = _jobs(tmp_path / "jobs.jsonl", ['{"id": "a", "prompt": "hi"}', '{"id": "b", "prompt": "x\\ud800y"}'])  # fmt: skip
    argv = ["--model", str(model_dir), "-i", jobs, "--max-tokens", "2", "--quiet"]
    assert main(argv) == 2
    line = _error(capsys)
    assert ":2: the request holds a lone surrogate (\\ud800)" in line, line
    out = tmp_path / "out.jsonl"
    assert main([*argv, "--skip-invalid", "-o", str(out)]) == 3  # some failed
    rows = {row["id"]: row for row in _rows(out)}
    assert rows["a"]["finish_reason"] == "length"
    assert rows["b"]["finish_reason"] == "error" and "lone surrogate" in rows["b"]["error"]
    assert main(["--model", str(model_dir), "--prompt", "x\udcff", "--quiet"]) == 2
    assert "prompt 1: the request holds a lone surrogate (\\udcff)" in _error(capsys)
    with LLM(str(model_dir)) as llm:
        for prompt in ("\ud800", {"prompt": "ok \udc80"}, ["fine", "a\ud800"]):
            with pytest.raises(UserError, match=r"lone surrogate \(\\ud[8c]"):
                llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
        with pytest.raises(UserError, match="lone surrogate"):
            llm.chat([{"role": "user", "content": "\ud800"}], chat_template=TEMPLATE)


@pytest.mark.parametrize("bad", [123, 4.5, object()], ids=["int", "float", "object"])
def test_generate_refuses_what_is_no_prompt_naming_the_accepted_types(model_dir, bad):
    accepted = r'a prompt must be text, a token-id list, \{"prompt"'
    with LLM(str(model_dir)) as llm, pytest.raises(UserError, match=accepted):
        llm.generate(bad, use_tqdm=False)


def test_num_prompts_past_the_bound_is_refused_at_once(tmp_path, capsys):
    """10^12 raised MemoryError, 10^8 took minutes: past `MAX_NUM_PROMPTS`, refused
    before any search."""
    profile = tmp_path / "hw.json"
    profile.write_text(CPU_PROFILE.to_json())
    argv = ["--model", "llama-2-7b", "--gpu-mem", "6GB", "--profile", str(profile)]
    for count in ("1000000000000", "10000001"):
        assert plan_main([*argv, "--num-prompts", count]) == 2
        line = _error(capsys)
        assert "--num-prompts must be from 1 to 10,000,000" in line, line


def test_profile_nvme_on_a_read_only_folder_is_refused_before_measuring(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(
        "offload.cli.profile.measure_profile",
        lambda *a, **k: pytest.fail("measured before the folder was judged"),
    )
    with read_only_dir(tmp_path / "ro") as folder:
        assert profile_main(["--nvme", str(folder), "--quick"]) == 2
    assert "cannot write --nvme" in _error(capsys)


# -- 2. silent acceptance ----------------------------------------------------------------------
@pytest.mark.parametrize("flag", [["--tp", "0"], ["--dp", "-1"], ["-tp", "0"], ["--dp", "0"]])
def test_ranks_below_one_are_refused(model_dir, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--model", str(model_dir), "--prompt", "hi", *flag])
    assert exit_.value.code == 2
    assert "must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_main(["--model", "llama-2-7b", "--gpu-mem", "6GB", "--tp", "0"])


def test_byte_tokenizer_is_refused_for_a_gguf_which_holds_its_tokenizer(model_dir, tmp_path):
    """--byte-tokenizer was ignored for a GGUF model (its own tokenizer ran): refused, as
    for a directory that ships a tokenizer. The refusal comes before the file is read."""
    config = resolve_model(str(model_dir)).config
    spec = ModelSpec("m", config, "gguf", tmp_path / "m.gguf")
    with pytest.raises(UserError, match=r"ships its tokenizer in the GGUF file; drop --byte"):
        spec.tokenizer(byte_tokenizer=True)


def test_offload_plan_does_not_say_the_demo_ships_no_tokenizer(tmp_path, capsys):
    profile = tmp_path / "hw.json"
    profile.write_text(CPU_PROFILE.to_json())
    argv = ["--model", "demo", "--gpu-mem", "1GB", "--cpu-mem", "3GB", "--profile", str(profile)]
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    assert "prompt 512, generate" in out and "ships no tokenizer" not in out, out


# -- 3. refusals before the long work ----------------------------------------------------------
def test_a_missing_shard_is_called_missing_before_the_load(copy_of, capsys, no_load):
    (copy_of / "model-00003-of-00007.safetensors").unlink()
    assert main(["--model", str(copy_of), "--prompt", "hi"]) == 2
    line = _error(capsys)
    assert "is missing model-00003-of-00007.safetensors (1 of 7 files named by" in line, line
    assert "damaged" not in line and "truncated" not in line


def test_a_truncated_shard_is_found_by_its_header_before_the_load(copy_of, capsys, no_load):
    shard = copy_of / "model-00006-of-00007.safetensors"
    size = shard.stat().st_size
    os.truncate(shard, size - 10)
    assert main(["--model", str(copy_of), "--prompt", "hi"]) == 2
    line = _error(capsys)
    assert f"{shard} is {size - 10} bytes but its header describes {size}" in line, line
    assert "truncated" in line
    with pytest.raises(UserError, match="truncated"):
        LLM(str(copy_of))


def test_a_prompt_past_any_tokenization_of_the_context_is_refused_untokenized(
    model_dir, tmp_path, capsys, monkeypatch
):
    """A 50 MB line was tokenized (87 s, 6.5 GB) before its refusal, and its error row
    copied it whole: its bytes alone refuse it, and the row keeps a prefix."""
    from offload.models.tokenizer import Tokenizer

    seen: list[int] = []
    encode = Tokenizer.encode
    monkeypatch.setattr(Tokenizer, "encode", lambda self, text, **k: seen.append(len(text)) or encode(self, text, **k))  # fmt: skip
    huge = "x" * (CONTEXT * MAX_TOKEN_BYTES + 1)
    jobs = _jobs(tmp_path / "jobs.jsonl", [json.dumps({"id": "ok", "prompt": "hi"}), json.dumps({"id": "huge", "prompt": huge})])  # fmt: skip
    argv = ["--model", str(model_dir), "-i", jobs, "--max-tokens", "2", "--quiet"]
    assert main(argv) == 2
    line = _error(capsys)
    assert f"request huge: a prompt has {len(huge)} bytes of text, more than the model's" in line
    out = tmp_path / "out.jsonl"
    assert main([*argv, "--skip-invalid", "-o", str(out)]) == 3
    row = next(r for r in _rows(out) if r["id"] == "huge")
    assert row["finish_reason"] == "error" and row["prompt"] == "x" * ERROR_PROMPT_CHARS + "..."
    assert max(seen) < len(huge)  # never tokenized
    with LLM(str(model_dir)) as llm, pytest.raises(UserError, match="bytes of text, more than"):
        llm.generate(huge, use_tqdm=False)


def test_pipes_under_data_parallel_reach_every_rank_as_their_copies(model_dir, tmp_path, capfd):
    """`-i <(cmd)` and `--policy <(cmd)` with --dp: the checks read each pipe once and the
    ranks were handed the drained pipes; they are handed the copies, which are removed
    after the run (CPU, gloo, forked ranks)."""
    pipes = []

    def pipe(text: str) -> str:
        read, write = os.pipe()
        os.write(write, text.encode())
        os.close(write)
        pipes.append(read)
        return f"/dev/fd/{read}"

    jobs = pipe('{"id": "a", "prompt": "hello"}\n{"id": "b", "prompt": "world"}\n')
    policy = {"gpu_batch_size": 1, "num_gpu_batches": 1, "weights": {"gpu": 0, "cpu": 1, "disk": 0}}  # fmt: skip
    out = tmp_path / "out.jsonl"
    argv = ["--model", str(model_dir), "--device", "cpu", "-i", jobs, "--policy", pipe(json.dumps(policy))]  # fmt: skip
    try:
        code = main([*argv, "--dp", "2", "-o", str(out), "--max-tokens", "2", "--quiet"])
    finally:
        for fd in pipes:
            os.close(fd)
    assert code == 0, capfd.readouterr().err
    assert [row["id"] for row in _rows(out)] == ["a", "b"]
    assert not list(tmp_path.glob("offload-stdin-*"))  # the copy of -i is gone


# -- 4. one rule for a report's path, the check's and the writer's ----------------------------
def test_trace_and_stats_under_missing_folders_are_written_there(model_dir, tmp_path, capsys):
    """The check passed them (the writer makes folders) and the trace's writer did not:
    both writers make the folders, as the check assumes."""
    trace, stats = tmp_path / "a" / "b" / "t.json", tmp_path / "c" / "s.json"
    argv = ["--model", str(model_dir), "--device", "cpu", "--cpu-mem", "8GB", "--prompt", "hi"]
    argv += ["--max-tokens", "2", "--quiet", "--trace", str(trace), "--stats", str(stats)]
    assert main(argv) == 0
    assert "could not write" not in capsys.readouterr().err
    assert json.loads(trace.read_text())["traceEvents"] and json.loads(stats.read_text())
    assert (trace.parent / "t_prefill.json").is_file()


# -- 5. dependencies ----------------------------------------------------------------------------
def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def test_the_declared_dependencies_are_the_imported_ones():
    """filelock was declared and imported nowhere, jinja2 imported and not declared:
    every third-party module the package imports is declared (a dependency, or an extra
    for what is imported only where it is there), and every dependency is imported."""
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11 on)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dist = re.compile(r"[A-Za-z0-9_.-]+")
    required = {_normal(dist.match(d)[0]) for d in project["dependencies"]}
    extras = {_normal(dist.match(d)[0]) for ds in project["optional-dependencies"].values() for d in ds}  # fmt: skip
    imported = set()
    for path in (ROOT / "offload").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {_normal(m) for m in imported - set(sys.stdlib_module_names) - {"offload"}}
    assert third_party - required - extras == set(), "imported but not declared"
    assert required - third_party == set(), "declared but imported nowhere"
