"""The plan for a job: its predicted wall time (load and every block at its own shape),
the search that minimizes it, and the blocks a job really runs (CPU, invented profile)."""

from __future__ import annotations

import dataclasses
import json
import random
from collections import Counter

import pytest
import torch

from offload.api.llm import LLM
from offload.cli.plan import main as plan_main
from offload.cli.run import main as run_main
from offload.io.layout import stage_image_bytes
from offload.kernels.formats import Compression
from offload.policies.caps import Caps
from offload.policies.cost import estimate
from offload.policies.job import MAX_SHAPES, Job, estimate_job, load_estimate, window_requests
from offload.policies.policy import Placement, Policy
from offload.policies.search import by_job_time, ranked, search
from tests.test_policies import PROFILE, cfg_of

GB = 10**9
F16 = torch.float16
# the invented machine, with the load's rates measured
LOADING = dataclasses.replace(
    PROFILE,
    pin_gbps=4.0,
    place_gbps={"dense/gpu": 3.0, "dense/cpu": 2.0, "int4/gpu": 1.5, "int4/cpu": 1.0},
)


def _streamed(block: int, micro: int) -> Policy:
    """Every weight streamed from CPU memory, KV in CPU homes attended on the GPU."""
    return Policy(block // micro, micro, weights=Placement(0, 1, 0), kv_cache=Placement(0, 1, 0))


def test_a_job_of_40_is_planned_as_whole_blocks_not_a_full_one_and_a_sliver():
    """Planned for throughput per block, llama-2-7b at 6 GB of GPU and 24 GB of CPU takes
    blocks of 32, so a job of 40 runs a block of 32 and a block of 8 that streams every
    weight again for 8 rows. Planned for the job, its 40 requests run as whole blocks,
    predicted faster; and for a block of 36 and 4 against 2 x 20 under one placement,
    the job's time says 2 x 20."""
    cfg, caps, job = cfg_of("llama-2-7b"), Caps(6 * GB, 24 * GB, False), Job.uniform(40, 512, 32)
    per_block = search(cfg, F16, 512, 32, LOADING, caps)
    for_job = search(cfg, F16, 512, 32, LOADING, caps, job=job)
    assert job.blocks(per_block.policy.block_size)[-1][0].rows < per_block.policy.block_size
    assert all(
        b.rows == for_job.policy.block_size for b, _ in job.blocks(for_job.policy.block_size)
    )
    seconds = {
        name: estimate_job(cfg, est.policy, F16, job, LOADING).seconds
        for name, est in (("block", per_block), ("job", for_job))
    }
    assert seconds["job"] < seconds["block"]
    sliver, halves = (
        estimate_job(cfg, _streamed(*shape), F16, job, LOADING) for shape in ((36, 2), (40, 2))
    )
    assert [(b.rows, n) for b, n, _ in sliver.blocks] == [(36, 1), (4, 1)]
    assert [(b.rows, n) for b, n, _ in halves.blocks] == [(40, 1)]
    assert halves.seconds < sliver.seconds


def test_the_predicted_job_time_is_its_load_plus_the_sum_of_its_blocks():
    """Each block at its own rows, longest prompt and largest budget (`cost.estimate`),
    counted once per block, plus the load: the weights' pool pinned and every stage
    placed at the profile's rates, and the KV pool pinned once (a streamed plan
    replays no graphs)."""
    cfg, policy = cfg_of("llama-2-7b"), _streamed(16, 2)
    rng = random.Random(0)
    prompts = [rng.randint(20, 300) for _ in range(150)]
    budgets = [rng.choice((8, 16)) for _ in range(150)]
    job = Job(prompts, budgets)
    predicted = estimate_job(cfg, policy, F16, job, LOADING)
    runs = job.blocks(policy.block_size)
    blocks_s = sum(
        times * (e.prefill_s + e.decode_s)
        for block, times in runs
        for e in [estimate(cfg, policy, F16, block.prompt_len, block.gen_len, LOADING, block.rows)]
    )
    load = load_estimate(cfg, policy, F16, LOADING)
    weights = sum(stage_image_bytes(cfg, F16, None))  # every stage placed in CPU memory
    assert load.place_s == pytest.approx(weights / (2.0 * GB))
    assert load.pin_s > 0 and load.store_s == 0 and load.warm_s == 0
    largest_kv_pool = predicted.extra_s * LOADING.pin_gbps * GB
    assert 0 < largest_kv_pool < 30 * GB
    assert predicted.seconds == pytest.approx(load.seconds + blocks_s + predicted.extra_s)
    assert predicted.requests == 150
    assert predicted.tokens == sum(b.rows * b.gen_len * n for b, n in runs)


def test_a_job_is_cut_into_whole_blocks_by_windows_sorted_by_length():
    """Windows of whole blocks (at least 64 requests), each sorted by prompt length; only
    the job's last block is partial."""
    assert (
        window_requests(14) == 14 * 8 and window_requests(4) == 64 and window_requests(100) == 800
    )
    rng = random.Random(1)
    prompts = [rng.randint(1, 500) for _ in range(150)]
    job = Job(prompts, [4] * 150)
    runs = job.blocks(14)  # windows of 112: 8 blocks, then 38 requests: 2 blocks and 10
    rows = [b.rows for b, n in runs for _ in range(n)]
    assert rows == [14] * 8 + [14, 14, 10]
    first = sorted(prompts[:112])
    assert [b.prompt_len for b, n in runs for _ in range(n)][:8] == first[13::14]


def test_a_job_runs_the_blocks_its_prediction_costs(tiny_checkpoints, tmp_path, monkeypatch):
    """offload-run with a --policy and a profile predicts the job; the blocks it then
    generates (rows, longest prompt, largest budget) are the blocks the prediction
    costs, and the summary puts the prediction beside the measured time."""
    directory, _ = tiny_checkpoints["llama-gqa"]  # byte tokens: a prompt's length is its bytes
    rng = random.Random(2)
    lines = [
        json.dumps({"id": f"r{i}", "prompt": "x" * rng.randint(3, 40), "max_tokens": rng.choice((2, 3))})
        for i in range(70)
    ]  # fmt: skip
    jobs, out, stats = tmp_path / "jobs.jsonl", tmp_path / "out.jsonl", tmp_path / "stats.json"
    jobs.write_text("\n".join(lines) + "\n")
    (policy := tmp_path / "policy.json").write_text(Policy(4, 2).to_json())
    (profile := tmp_path / "hw.json").write_text(
        dataclasses.replace(LOADING, has_gpu=False, gpu_context_bytes=0).to_json()
    )
    ran: Counter = Counter()
    generate_ids = LLM.generate_ids

    def spy(self, requests):
        rows, longest = len(requests), max(len(ids) for ids, _ in requests)
        ran[(rows, longest, max(p.max_tokens for _, p in requests))] += 1
        return generate_ids(self, requests)

    monkeypatch.setattr(LLM, "generate_ids", spy)
    argv = ["--model", str(directory), "--device", "cpu", "--policy", str(policy)]
    argv += ["--profile", str(profile), "-i", str(jobs), "-o", str(out), "--stats", str(stats)]
    assert run_main([*argv, "--quiet"]) == 0
    predicted = json.loads(stats.read_text())["predicted"]
    costed = Counter({(b["rows"], b["prompt_len"], b["gen_len"]): b["count"] for b in predicted["blocks"]})  # fmt: skip
    assert costed == ran and sum(ran.values()) == 9  # 70 requests: 8 blocks of 8 and one of 6
    assert predicted["requests"] == 70


def test_the_load_builds_a_store_only_where_none_holds_the_weights():
    cfg = cfg_of("opt-6.7b")
    on_disk = Policy(8, 1, weights=Placement(0, 0.5, 0.5), weight_compression=Compression(4, 64))
    building = load_estimate(cfg, on_disk, F16, LOADING)
    reused = load_estimate(cfg, on_disk, F16, LOADING, store_ready=True)
    assert building.store_s > 0 and reused.store_s == 0
    assert building.place_s == reused.place_s > 0
    read = load_estimate(cfg, on_disk, F16, LOADING, store_ready=True, checkpoint_bytes=13 * GB)
    assert read.read_s == pytest.approx(13 / LOADING.disk_read_gbps)


@pytest.mark.parametrize("count", [7, 40, 1000])
def test_the_search_bounds_a_plans_job_time_without_losing_the_fastest(count):
    """`by_job_time` stops timing plans once their full block's rate bounds their job
    above the best so far: the plan it returns is the fastest of all, timed one by one."""
    cfg, caps = cfg_of("llama-2-13b"), Caps(10 * GB, 40 * GB, False)
    plans = ranked(cfg, F16, 512, 16, LOADING, caps, top=10_000)
    job = Job.uniform(count, 512, 16)
    every = {id(e): estimate_job(cfg, e.policy, F16, job, LOADING).seconds for e in plans}
    fastest = by_job_time(plans, cfg, F16, LOADING, job)[0]
    assert every[id(fastest)] == pytest.approx(min(every.values()))


def test_offload_plan_prints_the_jobs_predicted_time_for_num_prompts(tmp_path, capsys):
    profile = tmp_path / "hw.json"
    profile.write_text(LOADING.to_json())
    argv = ["--model", "llama-2-7b", "--gpu-mem", "6GB", "--cpu-mem", "24GB", "--dtype"]
    argv += ["float16", "--profile", str(profile), "--max-tokens", "32", "--num-prompts", "40"]
    assert plan_main(argv) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("predicted for"))
    assert "for 40 requests and 1280 new tokens" in line
    assert plan_main([*argv, "--json"]) == 0
    job = json.loads(capsys.readouterr().out)["job"]
    assert job["requests"] == 40 and job["load"]["place_s"] > 0
    assert sum(b["rows"] * b["count"] for b in job["blocks"]) == 40
    assert job["seconds"] == pytest.approx(
        job["load"]["seconds"]
        + sum(b["count"] * b["seconds_each"] for b in job["blocks"])
        + job["extra_seconds"]
    )


def test_a_job_of_many_lengths_is_costed_at_a_bounded_number_of_shapes():
    """2000 requests in blocks of 4 are 500 blocks of as many shapes: costed at prompt
    lengths rounded up until at most MAX_SHAPES remain, every request still counted, the
    time never less than the exact one."""
    cfg, policy = cfg_of("llama-2-7b"), _streamed(4, 1)
    rng = random.Random(3)
    job = Job([rng.randint(1, 2000) for _ in range(2000)], [4] * 2000)
    coarse = estimate_job(cfg, policy, F16, job, LOADING)
    assert len(coarse.blocks) <= MAX_SHAPES < len({b for b, _ in job.blocks(4)})
    assert coarse.requests == 2000
    exact = sum(
        n * (e.prefill_s + e.decode_s)
        for b, n in job.blocks(4)
        for e in [estimate(cfg, policy, F16, b.prompt_len, b.gen_len, LOADING, b.rows)]
    )
    assert exact <= coarse.blocks_s - coarse.extra_s <= 1.5 * exact
