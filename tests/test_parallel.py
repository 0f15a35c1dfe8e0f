"""Tensor parallelism over gloo on the CPU: every family and policy, TP=2 and TP=4,
gives TP=1's greedy tokens, and logits within LOGITS_RTOL (fp32; the ranks sum partial
products in another order than one device does).

Each case spawns its ranks once (torch.multiprocessing) and runs every family and policy
inside them, so the file starts few processes."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from offload.api.llm import LLM
from offload.core.errors import UserError
from offload.core.sampling import SamplingParams
from offload.parallel.shard import RankShard, rank_config, split_sizes
from offload.policies.policy import Compression, Placement, Policy
from tests.tiny_models import CASES, decode_logits, prefill_logits

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34], [7, 8], [9] * 9]
PARAMS = SamplingParams(max_tokens=5)
LOGITS_RTOL = 1e-5  # relative norm error of the logits, TP=N against TP=1
POLICIES = {
    "one-tier": Policy(gpu_batch_size=3, num_gpu_batches=2),
    "weights-3-ways": Policy(gpu_batch_size=3, num_gpu_batches=2, weights=Placement(0.3, 0.4, 0.3)),
    "kv-cpu-cpu-attention": Policy(
        gpu_batch_size=3, num_gpu_batches=2, kv_cache=Placement(0, 1, 0), attention_on_cpu=True
    ),
    # groups of 16: whole groups in every rank's row-parallel matrices at TP=4
    "int4-weights-and-kv": Policy(
        gpu_batch_size=3,
        num_gpu_batches=2,
        weight_compression=Compression(4, 16),
        kv_compression=Compression(4, 16),
    ),
}
FAMILIES = ["llama-gqa", "llama-tied", "qwen2-bias", "mistral-window", "bloom", "opt"]
# (family, policy) pairs per TP size: every family at TP=2 and at TP=4, every policy at
# both (llama-gqa under all four at each); llama-gqa (2 KV heads) and mistral-window (1)
# have fewer KV heads than ranks at TP=4.
_ROTATION = list(POLICIES)
RUNS = {
    tp: [("llama-gqa", p) for p in POLICIES]
    + [(f, _ROTATION[(i + tp) % 4]) for i, f in enumerate(FAMILIES[1:])]
    for tp in (2, 4)
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _generate(directory: Path, policy: Policy, nvme: Path, parallel=None):
    with LLM(
        str(directory), device="cpu", dtype="float32", policy=policy, nvme=nvme, parallel=parallel
    ) as llm:
        outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS], PARAMS)
        tokens = [o.outputs[0].token_ids for o in outs]
        prefill, _ = prefill_logits(llm, PROMPTS[: policy.block_size])
        decode = decode_logits(llm, PROMPTS[: policy.block_size], 2)
    return {"tokens": tokens, "prefill": prefill, "decode": decode}


def _rank_main(rank: int, tp: int, port: int, runs, dirs, out: Path, scratch: Path) -> None:
    """One rank: join the group from the launcher's environment, run every case."""
    from offload.parallel.comm import Topology

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(tp),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(tp),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    topo = Topology.from_env(tp, 1, torch.device("cpu"))
    results = {}
    for family, policy_name in runs:
        parallel = topo.tensor_parallel(_config_of(dirs[family]))
        nvme = scratch / f"{family}-{policy_name}-rank{rank}"
        results[family, policy_name] = _generate(
            dirs[family], POLICIES[policy_name], nvme, parallel
        )
    if rank == 0:
        torch.save(results, out)
    topo.close()


def _config_of(directory: Path):
    from offload.models.resolve import resolve_model

    return resolve_model(str(directory)).config


@pytest.fixture(scope="module")
def tp1(tiny_checkpoints, tmp_path_factory):
    """TP=1 results of every (family, policy) pair any TP size runs."""
    scratch = tmp_path_factory.mktemp("tp1")
    pairs = sorted({pair for runs in RUNS.values() for pair in runs})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs
    try:
        return {
            (f, p): _generate(tiny_checkpoints[f][0], POLICIES[p], scratch / f"{f}-{p}")
            for f, p in pairs
        }
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("tp", sorted(RUNS))
def test_tensor_parallel_matches_one_rank(tp, tiny_checkpoints, tp1, tmp_path):
    dirs = {f: tiny_checkpoints[f][0] for f in FAMILIES}
    out = tmp_path / "results.pt"
    mp.start_processes(
        _rank_main,
        args=(tp, _free_port(), RUNS[tp], dirs, out, tmp_path),
        nprocs=tp,
        # fork: the ranks inherit this process's imports (a spawned rank spends
        # seconds importing torch on 2 busy cores)
        start_method="fork",
    )
    got = torch.load(out)
    for pair in RUNS[tp]:
        want, have = tp1[pair], got[pair]
        assert have["tokens"] == want["tokens"], f"TP={tp} {pair}: tokens differ from TP=1"
        for kind in ("prefill", "decode"):
            ref = want[kind]
            err = ((have[kind] - ref).norm() / ref.norm()).item()
            assert err <= LOGITS_RTOL, f"TP={tp} {pair}: {kind} logits differ by {err:.1e}"
    # each rank built its own weight store under its own directory
    family = next(f for f, p in RUNS[tp] if p == "weights-3-ways")
    assert any((tmp_path / f"{family}-weights-3-ways-rank{tp - 1}").iterdir())


# -- sharding, without processes ---------------------------------------------------------------
def test_rank_config_shares_heads_mlp_and_vocab(tiny_checkpoints):
    cfg = _config_of(tiny_checkpoints["mistral-window"][0])  # 4 heads, 1 KV head
    parts = [rank_config(cfg, 4, r) for r in range(4)]
    assert [(p.num_heads, p.num_kv_heads) for p in parts] == [(1, 1)] * 4
    assert sum(p.vocab_size for p in parts) == cfg.vocab_size
    assert sum(p.intermediate_size for p in parts) == cfg.intermediate_size
    assert split_sizes(200, 3, 64) == [67, 67, 66]  # 200 is no multiple of 64: columns
    assert split_sizes(320, 3, 64) == [128, 128, 64]
    shard = RankShard.of(_config_of(tiny_checkpoints["llama-gqa"][0]), 4, 3)
    assert (shard.heads, shard.kv_heads) == (slice(3, 4), slice(1, 2))


def test_head_counts_that_do_not_divide_are_refused(tiny_checkpoints):
    cfg = _config_of(tiny_checkpoints["bloom-5-heads"][0])
    with pytest.raises(UserError, match=r"--tp 2 does not divide .* 5 attention heads"):
        rank_config(cfg, 2, 0)
    gqa = _config_of(tiny_checkpoints["llama-gqa"][0])  # 4 heads, 2 KV heads
    with pytest.raises(UserError, match="2 KV heads"):
        rank_config(gqa.__class__(**{**_fields(gqa), "num_heads": 6, "num_kv_heads": 2}), 3, 0)


def _fields(cfg) -> dict:
    import dataclasses

    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}


def test_uneven_mlp_split_sums_to_the_full_mlp():
    """Row-parallel partial sums over an MLP width the ranks share unevenly."""
    from offload.core.config import ModelConfig
    from offload.models.shapes import stage_shapes
    from offload.models.weights import DummySource

    full = ModelConfig("odd", "opt", 64, 48, 1, 6, 6, 8, 100, 64, 1e-5)
    w = DummySource(full).layer(0, torch.float64, torch.device("cpu"))
    x = torch.randn(5, 48, dtype=torch.float64)
    want = torch.relu(x @ w["mlp_in.weight"].T + w["mlp_in.bias"]) @ w["mlp_out.weight"].T
    want += w["mlp_out.bias"]
    total = torch.zeros_like(want)
    for rank in range(3):
        shard = RankShard.of(full, 3, rank)
        part = shard.stage("layer", w)
        for name, shape in stage_shapes(shard.config, "layer").items():
            assert tuple(part[name].shape) == shape, name
        hidden = torch.relu(x @ part["mlp_in.weight"].T + part["mlp_in.bias"])
        total += hidden @ part["mlp_out.weight"].T + part["mlp_out.bias"]
    assert [RankShard.of(full, 3, r).config.intermediate_size for r in range(3)] == [34, 33, 33]
    torch.testing.assert_close(total, want)


assert set(FAMILIES) <= set(CASES)


# -- data parallel through the CLI: two groups, a killed rank, a resume -------------------------
def _cli(directory: Path, prompts: Path, output: Path, *extra: str) -> list[str]:
    return [
        *("--model", str(directory), "--device", "cpu", "--dtype", "float32"),
        *("-i", str(prompts), "--output", str(output)),
        *("--max-tokens", "6", "--batch-size", "2", "--quiet", *extra),
    ]


def test_data_parallel_groups_merge_in_order_and_resume_after_kill(tiny_checkpoints, tmp_path):
    import json
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from offload.cli.run import main as run_main

    directory = tiny_checkpoints["opt"][0]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "".join(json.dumps({"id": f"r{i}", "prompt": f"tell {i * 7}"}) + "\n" for i in range(32))
    )
    reference = tmp_path / "one-group.jsonl"
    assert run_main(_cli(directory, prompts, reference)) == 0
    output = tmp_path / "two-groups.jsonl"
    command = [sys.executable, "-m", "offload.cli.run", *_cli(directory, prompts, output)]
    command += ["--tp", "1", "--dp", "2"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    launcher = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    partial = tmp_path / "two-groups.jsonl.dp1of2.partial"
    deadline = time.monotonic() + 120
    while not (partial.exists() and partial.read_text().count("\n") >= 2):
        assert launcher.poll() is None, launcher.stderr.read()
        assert time.monotonic() < deadline, "no results from group 1 in 120 s"
        time.sleep(0.02)
    # the rank that writes group 1's results (it holds that file open), not another child
    workers = psutil.Process(launcher.pid).children(recursive=True)
    writer = [w for w in workers if any(f.path == str(partial) for f in _open_files(w))]
    os.kill((writer or workers[-1:])[0].pid, signal.SIGKILL)
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode != 0 and not output.exists(), "the job finished before the kill"
    # one line ends every rank; which rank it blames is a race (the killed one, or a peer
    # whose collective broke first), so the test holds it to naming a rank, and to the
    # advice to run again where the blamed rank was killed or lost from outside
    assert "all ranks were stopped" in stderr, stderr
    blamed = re.search(r"rank \d of 2 (was killed by SIGKILL|failed|lost contact)", stderr)
    assert blamed, stderr
    if blamed.group(1) != "failed":
        assert "run the same command again" in stderr, stderr
    kept = sum(p.read_text().count("\n") - 1 for p in tmp_path.glob("two-groups.jsonl.dp*"))
    assert 0 < kept < 32
    resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"r{i}" for i in range(32)], "ids not once each, in order"
    assert output.read_text() == reference.read_text(), "two groups differ from one group"
    assert not list(tmp_path.glob("two-groups.jsonl.*")), "partial files left behind"


def test_node_memory_limit_prefers_the_cgroup_limit(tmp_path):
    from offload.policies.memory_limit import node_memory_limit, rank_cpu_bytes

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32505856 kB\nMemFree: 1 kB\n")  # 31 GiB
    v2, v1 = tmp_path / "memory.max", tmp_path / "limit_in_bytes"
    v2.write_text(f"{256 * 2**30}\n")  # a machine whose RAM grows as it is used
    limit, where = node_memory_limit(v2, v1, meminfo)
    assert limit == 256 * 2**30 and str(v2) in where
    v2.write_text("max\n")
    v1.write_text(f"{8 * 2**30}\n")  # a container below the machine
    limit, where = node_memory_limit(v2, v1, meminfo)
    assert limit == 8 * 2**30 and "below MemTotal" in where
    v1.write_text("9223372036854771712\n")  # cgroup v1's "no limit"
    limit, where = node_memory_limit(v2, v1, meminfo)
    assert limit == 32505856 * 1024 and "MemTotal" in where
    assert rank_cpu_bytes(100, 4) == 25


def _open_files(process) -> list:
    import psutil

    try:
        return process.open_files()
    except psutil.Error:  # it ended meanwhile
        return []
