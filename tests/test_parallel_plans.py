"""Plans for several GPUs of one node: a rank's share of the node's rates
(`policies.node.rank_profile`), the wait for the slowest rank at an all-reduce, and the
layouts `offload-plan --gpus N` compares (CPU; no processes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from offload.parallel.shard import rank_config
from offload.policies.cost import estimate
from offload.policies.node import rank_profile
from offload.policies.policy import Placement, Policy
from tests.test_policies import GB, PROFILE, cfg_of

# the test machine with the all-reduce the 2-GPU machine measured (NVLink)
NODE = dataclasses.replace(PROFILE, allreduce_gbps=347.0, allreduce_latency_s=74e-6)


def _speedup(cfg, policy: Policy, hw=NODE) -> tuple[float, float, str, str]:
    """Predicted TP=2 over one GPU for the same policy (each rank: its shard, its share
    of the node), of the whole block and of decode, and both plans' bottlenecks."""
    one = estimate(cfg, policy, torch.float16, 512, 32, hw)
    two = estimate(rank_config(cfg, 2, 0), policy, torch.float16, 512, 32, rank_profile(hw, 2), tp=2)  # fmt: skip
    total, decode = two.total_tok_s / one.total_tok_s, two.decode_tok_s / one.decode_tok_s
    return total, decode, one.bottleneck, two.bottleneck


def test_a_cpu_attention_bound_plan_gains_nothing_from_a_second_rank():
    """Each rank attends half the heads with half the cores: the same time a step."""
    cfg = cfg_of("llama-2-13b")
    policy = Policy(
        48, 2, weights=Placement(1.0, 0.0, 0.0), kv_cache=Placement(0.0, 1.0, 0.0),
        attention_on_cpu=True,
    )  # fmt: skip
    total, decode, one, two = _speedup(cfg, policy)
    assert one == two == "cpu_attn"
    assert decode == pytest.approx(1.0, abs=0.02)
    assert total < 1.1  # (the prefill's matmuls do halve)


def test_a_pcie_bound_plan_runs_about_twice_as_fast_on_two_ranks():
    """Each rank streams half of every layer over its own link."""
    cfg = cfg_of("opt-30b")
    policy = Policy(8, 1, weights=Placement(0.0, 1.0, 0.0))
    total, decode, one, two = _speedup(cfg, policy)
    assert one == two == "h2d"
    assert 1.85 <= total <= 2.0 and 1.85 <= decode <= 2.0, (total, decode)
    # the links measured all at once, where the profile has that figure, bound it
    shared = dataclasses.replace(NODE, h2d_all_gbps=NODE.h2d_gbps * 0.6)
    assert _speedup(cfg, policy, shared)[1] == pytest.approx(0.6 * decode, rel=0.02)


def test_a_rank_s_view_divides_what_the_node_shares_and_keeps_its_own():
    view = rank_profile(dataclasses.replace(NODE, cpu_attention_pair_s={"1": 1e-6}), 4)
    assert view.node_ranks == 4
    assert view.cpu_attention_gbps == NODE.cpu_attention_gbps / 4
    assert view.cpu_attention_pair_s == {"1": 4e-6}
    assert view.disk_read_gbps == NODE.disk_read_gbps / 4
    assert view.cpu_mem_bytes == NODE.cpu_mem_bytes // 4
    assert (view.h2d_gbps, view.hbm_gbps, view.gpu_mem_bytes) == (
        NODE.h2d_gbps, NODE.hbm_gbps, NODE.gpu_mem_bytes,
    )  # fmt: skip
    assert rank_profile(NODE, 1) is NODE


def test_ranks_wait_for_the_slowest_at_the_all_reduces():
    """The measured skew of the host-side work (CPU attention, the executor's issue)
    lengthens every layer of a tensor-parallel step, and only there."""
    cfg = rank_config(cfg_of("llama-2-13b"), 2, 0)
    policy = Policy(
        16, 2, weights=Placement(1.0, 0.0, 0.0), kv_cache=Placement(0.0, 1.0, 0.0),
        attention_on_cpu=True,
    )  # fmt: skip
    even = rank_profile(NODE, 2)
    skewed = dataclasses.replace(even, rank_skew=0.1)
    base = estimate(cfg, policy, torch.float16, 512, 32, even, tp=2)
    paid = estimate(cfg, policy, torch.float16, 512, 32, skewed, tp=2)
    lanes = base.lanes_decode_s
    assert paid.decode_step_s - base.decode_step_s == pytest.approx(
        0.1 * (lanes["cpu_attn"] + lanes["host"]), rel=1e-6
    )
    assert paid.lanes_decode_s["rank_wait"] == pytest.approx(
        paid.decode_step_s - base.decode_step_s
    )
    one_rank = [estimate(cfg, policy, torch.float16, 512, 32, hw) for hw in (even, skewed)]
    assert one_rank[0] == one_rank[1]


def test_shared_nodes_search_blocks_that_overlap_cpu_attention():
    """A rank that shares its node attends on the CPU only in blocks of two or more
    micro-batches (the GPU computes one while the CPU attends the other)."""
    from offload.policies.caps import Caps
    from offload.policies.search import candidates

    cfg = rank_config(cfg_of("llama-2-13b"), 2, 0)
    caps = Caps(10 * GB, 60 * GB, False)
    shared = [p for p in candidates(cfg, torch.float16, rank_profile(NODE, 2), caps, None) if p.attention_on_cpu]  # fmt: skip
    alone = [p for p in candidates(cfg, torch.float16, NODE, caps, None) if p.attention_on_cpu]
    assert shared and min(p.num_gpu_batches for p in shared) == 2
    assert min(p.num_gpu_batches for p in alone) == 1


def test_offload_plan_compares_one_gpu_tp_and_dp_for_the_node(tmp_path, capsys):
    """A node whose CPU attention is slow: the plans stream weights over each GPU's
    link, so two GPUs pay about twice, and the recommendation says which layout and why."""
    import json

    from offload.cli.plan import main as plan_main

    profile = tmp_path / "hw.json"
    profile.write_text(
        dataclasses.replace(NODE, cpu_attention_gbps=1.0, cpu_mem_bytes=256 * GB).to_json()
    )
    argv = ["--model", "opt-6.7b", "--gpu-mem", "8GB", "--profile", str(profile)]
    assert (
        plan_main([*argv, "--prompt-len", "256", "--max-tokens", "16", "--gpus", "2", "--json"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    rows = {row["layout"]: row for row in out["layouts"]}
    assert set(rows) == {"one GPU", "TP=2", "DP=2"}
    one, best = rows["one GPU"], max(rows.values(), key=lambda row: row["node_tok_s"])
    assert rows["DP=2"]["node_tok_s"] == pytest.approx(2 * rows["DP=2"]["rank_tok_s"])
    assert best["node_tok_s"] >= 1.8 * one["node_tok_s"], rows
    assert out["recommendation"].startswith(f"recommended: {best['layout']} ")
    assert "h2d (each GPU's own)" in out["recommendation"]
    assert plan_main([*argv, "--gpus", "1"]) == 2  # one GPU compares nothing


def test_each_rank_takes_its_share_of_its_gpu_s_numa_node():
    from offload.parallel.affinity import cpu_list, rank_cpus

    nodes = {0: list(range(0, 8)), 1: list(range(8, 16))}
    allowed = list(range(16))
    assert cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    # two GPUs on two NUMA nodes: each rank its node's cores
    assert rank_cpus(1, [0, 1], allowed, nodes.get) == list(range(8, 16))
    # four ranks, two a node: each half of its node's cores
    assert rank_cpus(3, [0, 0, 1, 1], allowed, nodes.get) == list(range(12, 16))
    # no NUMA node known (a VM): all allowed cores split evenly, the first ranks one more
    assert rank_cpus(0, [None, None, None], list(range(7)), nodes.get) == [0, 1, 2]
    assert rank_cpus(2, [None, None, None], list(range(7)), nodes.get) == [5, 6]
    # a node whose cores this process may not use: the allowed ones, split
    assert rank_cpus(1, [0, 1], list(range(4)), nodes.get) == [2, 3]


def test_the_search_counts_the_gpu_context_of_the_process_that_runs_the_plan(tmp_path):
    """A rank's NCCL buffers make its CUDA context larger than the profile's: the plan
    the search returns for it fits that rank's own accounting (the run's fit check),
    where a plan for the profile's context alone does not."""
    from offload.policies.caps import Baseline, fit_problem
    from offload.policies.choose import choose_policy

    profile = tmp_path / "hw.json"
    profile.write_text(dataclasses.replace(NODE, gpu_context_bytes=800 * 2**20).to_json())
    cfg = rank_config(cfg_of("opt-30b"), 2, 0)
    rank = Baseline(gpu_context_bytes=1800 * 2**20, process_bytes=NODE.process_base_bytes)
    args = (cfg, torch.float16, 24 * GB, 64 * GB, None, 128, 8, profile)
    for_profile = choose_policy(*args, tp=2)
    for_rank = choose_policy(*args, tp=2, baseline=rank)
    assert fit_problem(for_profile.best.memory, for_profile.caps, rank) is not None
    assert fit_problem(for_rank.best.memory, for_rank.caps, rank) is None
