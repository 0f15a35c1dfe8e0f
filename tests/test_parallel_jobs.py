"""offload-run --tp / --dp: a job goes the one-GPU road (its prompts sized by
`cli.sizing` on world rank 0, the plan shared, every rank's engine built from it) and a
job that cannot run is refused before any weight loads (CPU, gloo, forked ranks)."""

from __future__ import annotations

import json

import pytest

from offload.cli.run import main
from offload.executor.lanes import read_chrome
from tests.test_sizing import CPU_PROFILE, _jobs


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoints):
    return tiny_checkpoints["llama-gqa"][0]  # 4 heads, 2 KV heads; byte tokenizer


def _argv(model_dir, tmp_path, jobs: str, out, *extra: str) -> list[str]:
    profile = tmp_path / "hw.json"
    profile.write_text(CPU_PROFILE.to_json())
    caps = ["--gpu-mem", "2MB", "--cpu-mem", "3GB", "--profile", str(profile)]
    return ["--model", str(model_dir), "--device", "cpu", *caps, "-i", jobs, "-o", str(out), "--quiet", *extra]  # fmt: skip


def test_tp_and_dp_jobs_are_sized_for_the_job_and_match_one_gpu(model_dir, tmp_path):
    prompts = {"a": "x" * 5, "b": "y" * 30, "c": "z" * 11, "d": "w" * 8}
    jobs = _jobs(tmp_path / "jobs.jsonl", prompts, c={"max_tokens": 5})
    results = {}
    trace = ["--trace", str(tmp_path / "t.json"), "--trace-every", "2"]  # one file a rank
    for name, layout in (("one", []), ("tp2", ["--tp", "2", *trace]), ("dp2", ["--tp", "1", "--dp", "2"])):  # fmt: skip
        out, stats = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.json"
        argv = _argv(model_dir, tmp_path, jobs, out, "--max-tokens", "3", "--stats", str(stats))
        assert main([*argv, *layout]) == 0, name
        summary = json.loads(stats.read_text())
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        results[name] = (summary["planned_for"], [row["text"] for row in rows])
        if layout:  # the node's tokens: every group's
            assert summary["node"]["generated_tokens"] == sum(r["completion_tokens"] for r in rows)
    # the job's longest prompt and largest budget, on every layout; the same text
    assert results["one"][0] == {"prompt_tokens": 30, "new_tokens": 5}
    assert results["tp2"] == results["one"] == results["dp2"]
    for rank in range(2):  # each rank's last traced step, its all-reduces among its lanes
        lanes = {span[0] for span in read_chrome(tmp_path / f"t.rank{rank}.json")}
        assert {"compute", "allreduce"} <= lanes, lanes


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--tp", "1", "--dp", "2"]], ids=["tp2", "dp2"])
def test_a_prompt_past_the_context_is_refused_before_any_rank_loads(
    layout, model_dir, tmp_path, capfd, monkeypatch
):
    from offload.models.resolve import ModelSpec

    def refuse(self):
        raise AssertionError("weights were loaded before the job was judged")

    monkeypatch.setattr(ModelSpec, "open_weights", refuse)  # the forked ranks inherit it
    jobs = _jobs(tmp_path / "jobs.jsonl", {"ok": "hello", "long": "x" * 300})  # context 256
    out = tmp_path / "out.jsonl"
    assert main([*_argv(model_dir, tmp_path, jobs, out), *layout]) == 2
    err = capfd.readouterr().err
    assert "weights were loaded" not in err and "Traceback" not in err, err
    refusals = [line for line in err.splitlines() if "error:" in line]
    assert refusals == [
        "offload-run: error: request long: a prompt has 300 tokens but the model's context "
        "is 256; shorten it, or pass --skip-invalid to record such requests as errors and go on"
    ], err
    assert not out.exists() and not list(tmp_path.glob("out.jsonl.*"))


def test_data_parallel_groups_share_one_pinned_copy_of_the_weights(model_dir, tmp_path):
    """Every layer's weights in CPU memory: the second group makes none of them, it maps
    the first group's copy (`rank.share_weights`), so its tokens equal one process's only
    if it reads what the first group wrote there."""
    policy = tmp_path / "policy.json"
    policy.write_text(
        json.dumps({"gpu_batch_size": 2, "num_gpu_batches": 1, "weights": {"gpu": 0, "cpu": 1, "disk": 0}})
    )  # fmt: skip
    jobs = _jobs(tmp_path / "jobs.jsonl", {f"r{i}": f"tell me {i * 13}" for i in range(6)})
    texts = {}
    for name, layout in (("one", []), ("dp2", ["--tp", "1", "--dp", "2"])):
        out = tmp_path / f"{name}.jsonl"
        argv = ["--model", str(model_dir), "--device", "cpu", "--dtype", "float32", "--quiet"]
        argv += ["--policy", str(policy), "-i", jobs, "-o", str(out), "--max-tokens", "4"]
        assert main([*argv, *layout]) == 0, name
        texts[name] = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    assert texts["dp2"] == texts["one"]
