"""vLLM's offline-inference examples run unchanged but for the import (and a hub model
name, which becomes "demo"), on the built-in demo model; and the API they rely on.

The examples are vLLM's own files (Apache-2.0, copyright the vLLM contributors), read
from vLLM's source distributions on PyPI, pinned by sha256, and kept in the user cache
like the demo model: this repository holds no copy of them. Each runs as its own
process, with its own flags keeping the token counts small where it has them.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

import pytest
import torch

from offload import LLM, EngineArgs, SamplingParams
from offload.core.errors import UserError
from offload.models.demo import cache_dir

ROOT = Path(__file__).resolve().parent.parent
# vLLM's source distributions on PyPI: (path under files.pythonhosted.org/packages, sha256)
SDISTS = {
    "0.33.0": (
        "f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz",
        "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
    ),
    "0.7.1": (
        "c1/9d/151eba20b6959913d05df917cb53d5adb5d2e3dd8a19fea365d48b2b2bf3/vllm-0.7.1.tar.gz",
        "f3f40980c0940d56d9c5a31c48c441a7746bac285478ecf848ab237a5c7bc155",
    ),
}
# (vLLM version, the example in its sdist, its flags, lines of output it prints per prompt)
EXAMPLES = {
    "basic": ("0.33.0", "examples/basic/offline_inference/basic.py", [], "Output:", 4),
    "basic_with_model_default_sampling": (
        "0.7.1", "examples/offline_inference/basic_with_model_default_sampling.py", [],
        "Generated text:", 4,
    ),
    "generate": (
        "0.33.0", "examples/basic/offline_inference/generate.py",
        ["--model", "demo", "--max-tokens", "2", "--temperature", "0.5", "--top-k", "20"],
        "Generated text:", 4,
    ),
    "chat": (
        "0.33.0", "examples/basic/offline_inference/chat.py",
        ["--model", "demo", "--max-tokens", "2", "--temperature", "0.7", "--top-p", "0.9"],
        "Generated text:", 11,
    ),
    # the sampling-params one: SamplingParams(n=, temperature=, top_p=, top_k=, max_tokens=)
    # from flags, EngineArgs.from_cli_args, LLM(**asdict(engine_args)), `vllm.utils`
    "cli": (
        "0.7.1", "examples/offline_inference/cli.py",
        ["--model", "demo", "--max-tokens", "2", "--n", "2", "--num-prompts", "2"],
        "Generated text:", 2,
    ),
    "basic_0.7.1": ("0.7.1", "examples/offline_inference/basic.py", [], "Generated text:", 4),
    "chat_0.7.1": ("0.7.1", "examples/offline_inference/chat.py", [], "Generated text:", 11),
    # LLM(profiler_config=...) / VLLM_TORCH_PROFILER_DIR, start_profile(), stop_profile()
    "simple_profiling": (
        "0.33.0", "examples/features/profiling/simple_profiling_offline.py", [],
        "Generated text:", 4,
    ),
    "simple_profiling_0.7.1": (
        "0.7.1", "examples/offline_inference/simple_profiling.py", [], "Generated text:", 4,
    ),
    # LLM(disable_log_stats=False), get_metrics(), `vllm.v1.metrics.reader`
    "metrics": ("0.33.0", "examples/observability/metrics/offline.py", [], "Generated text:", 4),
    # LLM(enable_prefix_caching=True): accepted, the same tokens
    "automatic_prefix_caching": (
        "0.33.0",
        "examples/features/automatic_prefix_caching/automatic_prefix_caching_offline.py",
        [], "Output:", 2,
    ),
    # two engines in one process (`vllm.distributed.cleanup_dist_env_and_memory`), each
    # with gpu_memory_utilization=0.4: a GPU's share, refused where there is no GPU
    "prefix_caching": (
        "0.33.0", "examples/features/automatic_prefix_caching/prefix_caching_offline.py", [],
        "Generated text:", 8,
    ),
    "prefix_caching_0.7.1": (
        "0.7.1", "examples/offline_inference/prefix_caching.py", [], "Generated text:", 8,
    ),
}  # fmt: skip
# what an example leaves besides its output: files under its directory, a line it prints
LEAVES = {
    "simple_profiling": ("vllm_profile/*.pt.trace.json", None),
    "simple_profiling_0.7.1": ("vllm_profile/*.pt.trace.json", None),
    "metrics": (None, "vllm:time_to_first_token_seconds (histogram)"),
    "prefix_caching": (None, "Generated answers are the same: True"),
    "prefix_caching_0.7.1": (None, "Generated answers are the same: True"),
}
GPU_ONLY = {"prefix_caching", "prefix_caching_0.7.1"}


def _example_source(version: str, member: str) -> str:
    """vLLM's example file, fetched once from its sdist on PyPI (sha256-checked)."""
    target = cache_dir() / "vllm-examples" / version / member
    if not target.is_file():
        url_path, sha256 = SDISTS[version]
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            sdist = Path(tmp) / "sdist.tar.gz"
            url = f"https://files.pythonhosted.org/packages/{url_path}"
            try:
                with urllib.request.urlopen(url, timeout=60) as src, sdist.open("wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
            except OSError as exc:  # (URLError is one)
                pytest.fail(
                    f"could not fetch {url} ({exc}); on a machine without the network, copy "
                    f"{cache_dir() / 'vllm-examples'} from one that ran this test"
                )
            assert hashlib.sha256(sdist.read_bytes()).hexdigest() == sha256, url
            with tarfile.open(sdist) as tar:
                for name in {m for _, m, *_ in EXAMPLES.values()} | {"LICENSE"}:
                    path = f"vllm-{version}/{name}"
                    if path in tar.getnames():
                        data = tar.extractfile(path).read()
                        out = cache_dir() / "vllm-examples" / version / name
                        out.parent.mkdir(parents=True, exist_ok=True)
                        out.with_suffix(".part").write_bytes(data)
                        os.replace(out.with_suffix(".part"), out)
    return target.read_text()


def _as_offload(source: str) -> tuple[str, list[str]]:
    """The example with `vllm` imports made `offload` ones and a hub model name made
    "demo"; the changed lines (nothing else changes)."""
    lines, changed = source.splitlines(keepends=True), []
    for i, line in enumerate(lines):
        new = re.sub(r"^(from|import) vllm(?=[.\s])", r"\1 offload", line)
        new = re.sub(r'(LLM\(.*model=)"[^"]+"', r'\1"demo"', new)
        new = re.sub(r'^(\s+model=)"[^"]+",\s*$', r'\1"demo",\n', new)  # (LLM(\n model=...)
        if new != line:
            lines[i] = new
            changed.append(new.strip())
    return "".join(lines), changed


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.gpu] if n in GPU_ONLY else []) for n in EXAMPLES]
)
def test_vllms_example_runs_with_only_the_import_changed(name, tmp_path):
    version, member, flags, marker, per_prompt = EXAMPLES[name]
    source, changed = _as_offload(_example_source(version, member))
    assert changed and all("offload" in c or 'model="demo"' in c for c in changed), changed
    script = tmp_path / Path(member).name
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script), *flags],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count(marker) == per_prompt, done.stdout
    # generate and chat draw vLLM's progress bar by default: plain lines off a terminal
    assert "Processed prompts:" in done.stderr, done.stderr[-2000:]
    files, line = LEAVES.get(name, (None, None))
    assert files is None or list(tmp_path.glob(files)), f"no {files} in {tmp_path}"
    assert line is None or line in done.stdout, done.stdout[-2000:]


@pytest.fixture(scope="module")
def llm():
    return LLM(model="demo")


def test_basic_generate_example(llm):
    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    outputs = llm.generate(prompts, sampling_params)
    assert [output.prompt for output in outputs] == prompts
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt: {prompt!r}, Generated text: {generated_text!r}")
        assert isinstance(generated_text, str) and generated_text
        assert 1 <= len(output.outputs[0].token_ids) <= 16  # vLLM's default max_tokens
        assert output.outputs[0].finish_reason in ("stop", "length")
        # a raw prompt is never templated: its ids are the tokenizer's encoding of the text
        assert output.prompt_token_ids == llm.get_tokenizer().encode(prompt)


def test_one_string_is_one_prompt_and_token_prompts_match_text(llm):
    outputs = llm.generate("The capital of France is", SamplingParams(max_tokens=6))
    assert len(outputs) == 1 and len(outputs[0].outputs) == 1
    ids = outputs[0].prompt_token_ids
    again = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=6))
    assert again[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    assert again[0].prompt is None


def test_one_sampling_params_per_prompt(llm):
    prompts = ["The capital of France is", "The capital of Italy is"]
    params = [SamplingParams(max_tokens=2), SamplingParams(max_tokens=5, ignore_eos=True)]
    outputs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 5]
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(prompts, params[:1] * 3)


def test_chat_example(llm):
    sampling_params = SamplingParams(temperature=0.5, seed=0, max_tokens=24)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    outputs = llm.chat(conversation, sampling_params=sampling_params, use_tqdm=False)
    assert len(outputs) == 1
    assert "Paris" in outputs[0].outputs[0].text, outputs[0].outputs[0].text
    assert "<|im_start|>assistant" in outputs[0].prompt  # the model's own template
    conversations = [conversation for _ in range(3)]
    outputs = llm.chat(messages=conversations, sampling_params=sampling_params, use_tqdm=True)
    assert len(outputs) == 3
    # the same seed, the same conversation: the same sample
    assert len({o.outputs[0].text for o in outputs}) == 1


def test_chat_with_a_custom_template(llm):
    chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    outputs = llm.chat(
        [{"role": "user", "content": "Hi"}],
        SamplingParams(max_tokens=2),
        use_tqdm=False,
        chat_template=chat_template,
    )
    assert outputs[0].prompt == "user: Hi\nassistant:"


def test_sampling_params_fields(llm):
    prompt = "The capital of France is"
    base = llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))[0].outputs[0]
    # n samples, each with its own seeded generator
    samples = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8))
    assert [c.index for c in samples[0].outputs] == [0, 1, 2]
    # a stop string cuts the text before it and is named
    word = base.text.split()[0]
    cut = llm.generate(prompt, SamplingParams(max_tokens=8, stop=[word]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == word and word not in cut.text
    # a stop token id ends the sequence at that token
    token = base.token_ids[2]
    stopped = llm.generate(prompt, SamplingParams(max_tokens=8, stop_token_ids=[token]))[0]
    assert stopped.outputs[0].token_ids == base.token_ids[:3]
    assert stopped.outputs[0].stop_reason == token
    # min_tokens: no stop before it
    late = llm.generate(prompt, SamplingParams(max_tokens=8, min_tokens=5, stop_token_ids=[token]))
    assert len(late[0].outputs[0].token_ids) >= 5


def test_max_memory_that_cannot_take_effect_is_an_error():
    with pytest.raises(UserError, match="disk"):
        LLM("demo", max_memory={"cpu": "8GB", "disk": "100GB"})
    with pytest.raises(UserError, match="not a device"):
        LLM("demo", max_memory={"mps": "8GB"})


def test_vllm_constructor_arguments_map_or_are_refused_naming_the_fix():
    """A vLLM script's `LLM(...)` arguments: those with a meaning here are mapped, those at
    vLLM's defaults pass, the rest are refused before anything loads, each naming what to
    do instead (`docs/compat.md`); an argument neither knows is Python's TypeError."""
    from offload.api.args import from_vllm_arguments

    cpu = torch.device("cpu")
    mapped, gpu = from_vllm_arguments(
        {"max_num_seqs": 3, "quantization": "int4", "dtype": "float32",
         "tensor_parallel_size": 1, "trust_remote_code": False, "enforce_eager": False},
        cpu, None,
    )  # fmt: skip
    assert mapped == {"batch_size": 3, "compress": "int4", "dtype": "float32"} and gpu is None
    refused = {
        "quantization": ("fp8", "quantization='int4'"),
        "gpu_memory_utilization": (0.9, "has none"),
        "cpu_offload_gb": (4, "max_memory"),
        "swap_space": (4, "max_memory"),
        "tensor_parallel_size": (2, "--tp N"),
        "trust_remote_code": (True, "no remote code"),
        "enforce_eager": (True, "CUDA graphs"),
        "max_model_len": (2048, "longest prompt"),
        "tokenizer": ("other", "own tokenizer"),
    }
    for name, (value, fix) in refused.items():
        with pytest.raises(UserError, match=fix):
            LLM("demo", device="cpu", **{name: value})
    with pytest.raises(UserError, match="not a share"):
        from_vllm_arguments({"gpu_memory_utilization": 1.5}, cpu, None)
    with pytest.raises(UserError, match="give one"):
        from_vllm_arguments({"gpu_memory_utilization": 0.5}, cpu, "24GB")
    with pytest.raises(UserError, match="not both"):
        LLM("demo", max_num_seqs=4, batch_size=4)
    with pytest.raises(UserError, match="HF_HUB_CACHE"):
        LLM("demo", download_dir="/tmp")
    with pytest.raises(TypeError, match="hf_overrides"):
        LLM("demo", hf_overrides={})


def test_an_llms_seed_makes_its_sampled_requests_repeat(tmp_path):
    """vLLM's `LLM(seed=...)`: sampled requests without a seed of their own draw one from
    it in order, so the same calls sample the same text again; another seed samples other
    text; a request's own seed and greedy requests are left as they are."""
    from tests import tiny_models

    directory, _ = tiny_models.save("llama-gqa", tmp_path / "m")
    prompts = [[5, 6, 7, 8], [20, 21, 22], [300, 1, 2]]
    hot = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    def sampled(seed, params=hot):
        with LLM(str(directory), device="cpu", dtype="float32", seed=seed) as llm:
            first = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            second = llm.generate([{"prompt_token_ids": prompts[0]}], params)
        return [o.outputs[0].token_ids for o in (*first, *second)]

    seven = sampled(7)
    assert sampled(7) == seven
    assert sampled(8) != seven
    assert seven[0] != seven[3], "a later call draws new seeds"
    own = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3)
    assert sampled(7, own) == sampled(None, own)
    with pytest.raises(UserError, match="not an integer"):
        LLM("demo", seed="7")


def test_default_sampling_params_are_a_fresh_copy_to_edit_and_judged_at_use(llm, capsys):
    """vLLM's examples edit what `get_default_sampling_params()` returns: each call gives a
    new object; an edit applies to the next call and no other; a bad edit is refused
    (ValueError naming the field) before any work, the progress bar included."""
    params = llm.get_default_sampling_params()
    assert params is not llm.get_default_sampling_params()
    params.max_tokens, params.ignore_eos = 3, True
    out = llm.generate("The capital of France is", params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    assert llm.get_default_sampling_params().max_tokens == 16  # the model's default is kept
    params.top_p = 1.5
    capsys.readouterr()
    with pytest.raises(ValueError, match="top_p"):
        llm.generate("The capital of France is", params)
    assert "Processed prompts" not in capsys.readouterr().err


def test_request_ids_are_unique_for_the_engines_life_and_samples_say_finished(llm):
    first = llm.generate(["a b", "c d"], SamplingParams(max_tokens=1), use_tqdm=False)
    second = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1))
    ids = [int(o.request_id) for o in (*first, *second)]
    assert len(set(ids)) == 3 and ids == sorted(ids), ids
    assert all(c.finished() for o in (*first, *second) for c in o.outputs)


def test_use_tqdm_draws_progress_and_false_draws_none(llm, capsys):
    """vLLM shows a bar by default; off a terminal (here) it is a plain line, not a bar
    redrawn with carriage returns; `use_tqdm` may also be a tqdm-like class."""
    from tqdm import tqdm

    prompts, params = ["a b", "c d"], SamplingParams(max_tokens=1)
    llm.generate(prompts, params, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err
    llm.generate(prompts, params)
    err = capsys.readouterr().err
    assert "Processed prompts: 2/2 (100%)" in err and "\r" not in err
    drawn = io.StringIO()
    llm.generate(prompts, params, use_tqdm=functools.partial(tqdm, file=drawn))
    assert "Processed prompts" in drawn.getvalue() and "2/2" in drawn.getvalue()


def test_engine_args_cli_flags_as_vllms_examples_build_them():
    """`EngineArgs.add_cli_args` on a parser or an argument group (with the group's
    `set_defaults`), vLLM's parser from both of its import paths (`--flag_name` taken
    for `--flag-name`), `from_cli_args`, and vLLM's engine flags mapped or refused with
    the fix once `LLM(**vars(args))` gets them."""
    from offload.engine.arg_utils import EngineArgs as FromEnginePath
    from offload.utils import FlexibleArgumentParser
    from offload.utils.argparse_utils import FlexibleArgumentParser as FromNewerPath

    assert FromNewerPath is FlexibleArgumentParser and FromEnginePath is EngineArgs
    parser = FlexibleArgumentParser()
    group = parser.add_argument_group("Engine arguments")
    EngineArgs.add_cli_args(group)
    group.set_defaults(model="someone/model")
    args = parser.parse_args(["--max_num_seqs", "3", "--dtype", "float32", "-q", "int4"])
    given = vars(args)
    assert given["model"] == "someone/model" and given["max_num_seqs"] == 3
    assert "tensor_parallel_size" not in given and "seed" not in given  # only what was typed
    engine = EngineArgs.from_cli_args(args)
    assert (engine.batch_size, engine.compress, engine.dtype) == (3, "int4", "float32")
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    # LLM(**vars(args)) gets every field's flag at its default beside the vLLM flags typed
    from offload.api.args import from_vllm_arguments

    kwargs = vars(parser.parse_args(["--model", "m", "-q", "int4", "--max-num-seqs", "3"]))
    for name in ("model", "gpu_mem", "cpu_mem"):  # (LLM takes these itself)
        kwargs.pop(name)
    mapped, _ = from_vllm_arguments(kwargs, torch.device("cpu"), None)
    assert (mapped["compress"], mapped["batch_size"]) == ("int4", 3)
    for flags, fix in (
        (["--cpu-offload-gb", "4"], "max_memory"),
        (["--max-model-len", "2048"], "longest prompt"),
        (["--tensor-parallel-size", "2"], "--tp N"),
        (["--trust-remote-code"], "no remote code"),
        (["--kv-cache-dtype", "fp8"], "kv_compress='int8'"),
    ):
        with pytest.raises(UserError, match=fix):
            LLM(**vars(parser.parse_args(["--model", "demo", *flags])))
    with pytest.raises(UserError, match="not both"):
        EngineArgs.from_cli_args(
            parser.parse_args(["--model", "m", "-q", "int4", "--compress", "int8"])
        )
