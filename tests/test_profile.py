"""The measured profile and what the cost model makes of it (CPU): the code-version stamp,
the executor's fixed costs, the all-reduce, invented profiles moving the search's choice
the way the roofline says, and `offload-plan --verify`'s probes."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from offload.cli.plan import main as plan_main
from offload.executor.fixed_costs import elementwise, overheads
from offload.executor.probe import _turns, probe_plan
from offload.kernels.formats import Compression
from offload.kernels.kv_cache import kv_row_bytes
from offload.policies import measure_cpu_attention
from offload.policies.caps import Caps
from offload.policies.cost import _layer_bytes, estimate
from offload.policies.hardware import HardwareProfile, code_version, load_profile, save_profile
from offload.policies.measure_cpu_attention import (
    CPU_ATTENTION_GROUPS,
    cpu_attention_call,
    cpu_attention_rates,
    fit_cpu_attention,
)
from offload.policies.measure_disk import kv_disk_read_rate
from offload.policies.measure_kernels import fit_attention
from offload.policies.policy import Placement, Policy
from offload.policies.search import ranked, search
from offload.policies.timers import fit_call
from tests.test_policies import GB, PROFILE, cfg_of

INT4 = Compression(4, 64, False)


def test_a_profile_of_other_code_is_measured_again(tmp_path):
    path = tmp_path / "hw.json"
    current = dataclasses.replace(PROFILE, code_version=code_version())
    save_profile(current, path)
    assert load_profile(path) == current
    save_profile(dataclasses.replace(PROFILE, code_version="an older kernel"), path)
    assert load_profile(path) is None
    path.write_text("{not json")
    assert load_profile(path) is None


def test_unmeasured_figures_may_be_zero_rates_may_not():
    assert PROFILE.layer_fixed_s == 0.0  # not measured: the term is left out
    with pytest.raises(ValueError, match="h2d_gbps"):
        dataclasses.replace(PROFILE, h2d_gbps=0.0)
    with pytest.raises(ValueError, match=r"matmul_gbps\[int4\]"):
        dataclasses.replace(PROFILE, matmul_gbps={"int4": 0.0})
    with pytest.raises(ValueError, match="micro_fixed_s"):
        dataclasses.replace(PROFILE, micro_fixed_s=-1.0)


def test_slow_int4_matmul_moves_the_search_to_dense_weights():
    """int4 halves the bytes that cross PCIe; a dequantizing matmul slower than PCIe
    makes that saving worthless, and the search must see it."""
    cfg, caps = cfg_of("opt-30b"), Caps(24 * GB, 100 * GB, False)
    both = (None, INT4)
    fast = search(cfg, torch.float16, 512, 32, PROFILE, caps, compressions=both)
    assert fast.policy.weight_compression == INT4
    slow_hw = dataclasses.replace(PROFILE, matmul_gbps={"int4": 1.0, "dense": 2000.0})
    slow = search(cfg, torch.float16, 512, 32, slow_hw, caps, compressions=both)
    assert slow.policy.weight_compression is None
    # and a plan's estimate follows the measured rate, not the HBM's
    est = estimate(cfg, fast.policy, torch.float16, 512, 32, slow_hw)
    assert est.decode_step_s > 2 * fast.decode_step_s


def test_prefill_pays_dequantization_attention_and_elementwise_as_measured():
    """Prefill's terms: a compressed weight is dequantized once a matmul call from
    qmatmul.DENSE_ROWS rows (`cost._prefill_matmul_s`) and multiplied by the fused
    kernel below; attention at its own measured rate; the non-matmul time per token and
    hidden unit."""
    cfg = cfg_of("opt-30b")
    compressed = Policy(4, 2, weight_compression=INT4)  # 4 x 512 rows a micro-batch
    dense = Policy(4, 2)

    def prefill(policy: Policy, prompt_len: int = 512, **figures) -> float:
        hw = dataclasses.replace(PROFILE, **figures)
        return estimate(cfg, policy, torch.float16, prompt_len, 32, hw).prefill_s

    # 2 micro-batches of 2048 rows (one MLP chunk): each dequantizes the layer once
    stored = _layer_bytes(cfg, compressed, torch.float16)[3]
    slow, fast = ({"int4": 10.0}, {"int4": 1e9})
    extra = prefill(compressed, dequant_gbps=slow) - prefill(compressed, dequant_gbps=fast)
    assert extra == pytest.approx(cfg.num_layers * 2 * stored / 10e9, rel=1e-3)
    assert prefill(dense, dequant_gbps=slow) == prefill(dense)
    # 4 x 128 rows run the fused kernel: no dequantization, its own measured rate
    assert prefill(compressed, 128, dequant_gbps=slow) == prefill(compressed, 128)
    fused_slow = {"int4": PROFILE.prefill_tflops / 10}
    slow_fused = prefill(compressed, 128, prefill_format_tflops=fused_slow)
    assert slow_fused > 5 * prefill(compressed, 128)
    # attention at its own rate; the elementwise term per token and hidden unit
    assert prefill(dense, prefill_attention_tflops=1.0) > 1.5 * prefill(dense)
    extra = prefill(dense, prefill_elementwise_s={"opt": 1e-12, "llama": 1.0}) - prefill(dense)
    assert extra == pytest.approx(cfg.num_layers * 8 * 512 * cfg.hidden_size * 1e-12, rel=1e-6)


def test_cpu_attention_pays_its_fixed_cost_a_micro_batch():
    cfg = cfg_of("llama-3.1-8b")
    on_cpu = Placement(0, 1, 0)
    costly = dataclasses.replace(PROFILE, cpu_attention_fixed_s=0.01)
    steps = {}
    for micro in (1, 8):
        policy = Policy(64 // micro, micro, weights=on_cpu, kv_cache=on_cpu, attention_on_cpu=True)
        base, paid = (estimate(cfg, policy, torch.float16, 512, 32, hw) for hw in (PROFILE, costly))
        steps[micro] = paid.decode_step_s - base.decode_step_s
        assert paid.lanes_decode_s["cpu_attn"] - base.lanes_decode_s["cpu_attn"] == (
            pytest.approx(cfg.num_layers * micro * 0.01)
        )
    assert steps[8] > steps[1] >= 0  # one micro-batch: hidden behind the weight copy
    on_gpu = Policy(16, 4, weights=on_cpu, kv_cache=on_cpu)
    assert estimate(cfg, on_gpu, torch.float16, 512, 32, costly).decode_step_s == (
        estimate(cfg, on_gpu, torch.float16, 512, 32, PROFILE).decode_step_s
    )


def test_the_weight_copy_beside_the_cpu_attention_runs_at_the_shared_rate():
    """With attention on the CPU the weight copy and the attention both read DRAM: the
    copy runs at the rate measured beside the attention while the first micro-batch's
    attention runs, then at its own (W1u's trace: 0.93 GB a layer in 18.4-19.3 ms, 17.5
    at the alone rate). Unmeasured (0), the alone rate; GPU attention never pays it."""
    cfg = cfg_of("opt-30b")
    branches = set()
    for on_gpu in (0.25, 0.9):  # the copy outlasting the attention, and not
        policy = Policy(
            88,
            1,
            weights=Placement(on_gpu, 1 - on_gpu, 0),
            kv_cache=Placement(0, 1, 0),
            attention_on_cpu=True,
        )
        branches |= _check_the_shared_copy_rate(cfg, policy)
    assert branches == {True, False}


def _check_the_shared_copy_rate(cfg, policy) -> set[bool]:
    """Checks the h2d lane of `policy` against the shared rate's formula at two shared
    rates; whether the copy outlasted the attention at each."""
    off_w, _, ends, _ = _layer_bytes(cfg, policy, torch.float16)
    alone = estimate(cfg, policy, torch.float16, 512, 32, PROFILE)
    assert alone.lanes_decode_s["h2d"] == pytest.approx(
        (cfg.num_layers * off_w + ends) / (PROFILE.h2d_gbps * GB)
    )
    attention_s = alone.lanes_decode_s["cpu_attn"] / cfg.num_layers  # one micro-batch
    seen = set()
    for shared_gbps in (PROFILE.h2d_gbps / 2, PROFILE.h2d_gbps / 20):
        hw = dataclasses.replace(PROFILE, h2d_under_cpu_attention_gbps=shared_gbps)
        shared = shared_gbps * GB
        outlasts = off_w > shared * attention_s
        if outlasts:  # the rest at the alone rate
            layer = attention_s + (off_w - shared * attention_s) / (PROFILE.h2d_gbps * GB)
        else:
            layer = off_w / shared
        contended = estimate(cfg, policy, torch.float16, 512, 32, hw)
        assert contended.lanes_decode_s["h2d"] == pytest.approx(
            cfg.num_layers * layer + ends / (PROFILE.h2d_gbps * GB)
        )
        # the step grows only where the copy comes to outlast the attention
        assert (contended.decode_step_s > alone.decode_step_s) == outlasts
        seen.add(outlasts)
    on_gpu = dataclasses.replace(policy, attention_on_cpu=False)
    assert estimate(cfg, on_gpu, torch.float16, 512, 32, hw).decode_step_s == (
        estimate(cfg, on_gpu, torch.float16, 512, 32, PROFILE).decode_step_s
    )
    return seen


def test_the_host_issue_after_each_cpu_attention_is_serial_with_compute():
    """Attended on the CPU, each micro-batch's rest of a layer is issued only after its
    attention: micro_fixed_s a micro-batch is added to the layer, not hidden beside its
    compute as it is where attention stays on the GPU. With weights on the GPU (a
    compute-bound layer) the step grows by exactly layers x micro-batches x the cost,
    which moves the search off a plan that attends a few sequences on the CPU."""
    cfg = cfg_of("opt-30b")
    w4 = INT4
    # (decode graphs replayed where every weight is on the GPU: their own host cost)
    base_hw = dataclasses.replace(PROFILE, graph_layer_s=1e-5)
    costly = dataclasses.replace(base_hw, micro_fixed_s=base_hw.micro_fixed_s + 0.002)
    for micro in (1, 4):
        mixed = Policy(
            16 // micro,
            micro,
            kv_cache=Placement(0.875, 0.125, 0),
            attention_on_cpu=True,
            weight_compression=w4,
            kv_compression=w4,
        )
        base, paid = (estimate(cfg, mixed, torch.float16, 512, 32, hw) for hw in (base_hw, costly))
        assert paid.decode_step_s - base.decode_step_s == pytest.approx(
            cfg.num_layers * micro * 0.002
        )
    on_gpu = Policy(16, 1, weight_compression=w4, kv_compression=w4)
    assert estimate(cfg, on_gpu, torch.float16, 512, 32, costly).decode_step_s == (
        estimate(cfg, on_gpu, torch.float16, 512, 32, base_hw).decode_step_s
    )


def test_the_cpu_attention_rate_follows_the_query_heads_a_kv_head():
    """Between measured groups the time a KV byte is linear in the group; past the
    largest it keeps the last slope; a profile without grouped figures (older, or
    another machine's) uses the MHA figure for every group."""
    hw = dataclasses.replace(
        PROFILE,
        cpu_attention_gbps=100.0,
        cpu_attention_grouped_gbps={"4": 50.0, "8": 25.0},
        cpu_quant_attention_grouped_gbps={"4": 5.0},
    )
    assert hw.cpu_attention_rate(1, compressed=False) == 100.0
    assert hw.cpu_attention_rate(4, compressed=False) == pytest.approx(50.0)
    assert hw.cpu_attention_rate(2, compressed=False) == pytest.approx(1 / (0.01 + 0.01 / 3))
    assert hw.cpu_attention_rate(6, compressed=False) == pytest.approx(1 / 0.03)
    assert hw.cpu_attention_rate(16, compressed=False) == pytest.approx(12.5)
    # compressed: PROFILE's 10 at one head a KV head, 5 at four, the slope past them
    assert hw.cpu_attention_rate(8, compressed=True) == pytest.approx(1 / (0.2 + 0.1 * 4 / 3))
    assert PROFILE.cpu_attention_rate(8, compressed=False) == PROFILE.cpu_attention_gbps


def test_a_slow_grouped_cpu_attention_moves_a_gqa_model_to_gpu_attention():
    """Llama-3.1-8B (4 query heads a KV head) under a 10 GB cap attends on the CPU when
    the grouped shape reads as fast as the MHA one; measured 16x slower there, the
    search attends on the GPU, and its CPU lane is priced at the grouped rate. An MHA
    model's plans do not change."""
    caps = Caps(10 * GB, 100 * GB, False)
    fast = dataclasses.replace(PROFILE, cpu_attention_gbps=160.0)
    slow = dataclasses.replace(fast, cpu_attention_grouped_gbps={"4": 10.0, "8": 5.0})
    llama = cfg_of("llama-3.1-8b")
    assert search(llama, torch.float16, 512, 32, fast, caps).policy.attention_on_cpu
    assert not search(llama, torch.float16, 512, 32, slow, caps).policy.attention_on_cpu
    on_cpu = Policy(
        64, 2, weights=Placement(0, 1, 0), kv_cache=Placement(0, 1, 0), attention_on_cpu=True
    )
    lanes = [
        estimate(llama, on_cpu, torch.float16, 512, 32, hw).lanes_decode_s for hw in (fast, slow)
    ]
    kv_s = [
        lane["cpu_attn"] - llama.num_layers * 2 * PROFILE.cpu_attention_fixed_s for lane in lanes
    ]
    assert kv_s[1] == pytest.approx(16 * kv_s[0])
    mha = cfg_of("llama-2-13b")
    assert search(mha, torch.float16, 512, 32, fast, caps) == search(
        mha, torch.float16, 512, 32, slow, caps
    )


def test_the_profile_times_the_cpu_attention_at_each_group(monkeypatch):
    """`measure` times the executor's CPU attention (full-precision and compressed
    caches) at one query head a KV head and at each of CPU_ATTENTION_GROUPS, over the
    same (sequence, KV head) pairs at two context lengths, and fits a rate and a time a
    pair for each; the calls compute grouped attention."""
    calls = {g: cpu_attention_call(torch.float32, False, g) for g in (1, *CPU_ATTENTION_GROUPS)}
    assert len({nbytes for _, nbytes in calls.values()}) == 1
    out = calls[4][0]()  # [rows, 1, heads x dim]
    assert out.shape == (64, 1, 32 * 128)
    short = cpu_attention_call(torch.float32, False, 4, slots=256)
    assert short[1] * 4 == calls[4][1]
    monkeypatch.setattr(measure_cpu_attention, "CPU_ATTENTION_PAIRS", 64)  # (a quicker profile)
    rates = cpu_attention_rates(torch.float32)
    groups = {str(g) for g in (1, *CPU_ATTENTION_GROUPS)}
    for figures in (rates.gbps, rates.quant_gbps):
        assert set(figures) == groups and all(rate > 0 for rate in figures.values())
    for figures in (rates.pair_s, rates.quant_pair_s):
        assert set(figures) == groups and all(0 <= s < 1e-3 for s in figures.values())


def test_the_cpu_attention_pays_its_time_a_sequence_and_kv_head():
    """Each (sequence, KV head) attended on the CPU costs the profile's time a pair at
    the model's group beyond its bytes (Llama-3.1-8B's 88 x 8 x 528 slots read 57.6 GB/s
    where the profile's 64 x 8 x 1024 read 80.5, H100 c103); GPU attention never pays it."""
    cfg = cfg_of("llama-3.1-8b")
    paid_hw = dataclasses.replace(PROFILE, cpu_attention_pair_s={"1": 1e-6, "8": 5e-6})
    assert paid_hw.cpu_attention_pair(4, compressed=False) == pytest.approx(1e-6 + 4e-6 * 3 / 7)
    assert paid_hw.cpu_attention_pair(16, compressed=False) == pytest.approx(5e-6 + 4e-6 * 8 / 7)
    assert paid_hw.cpu_attention_pair(4, compressed=True) == 0.0  # not measured
    on_cpu = Policy(
        64, 2, weights=Placement(0, 1, 0), kv_cache=Placement(0, 1, 0), attention_on_cpu=True
    )
    base, paid = (estimate(cfg, on_cpu, torch.float16, 512, 32, hw) for hw in (PROFILE, paid_hw))
    pairs = 128 * cfg.num_kv_heads
    assert paid.lanes_decode_s["cpu_attn"] - base.lanes_decode_s["cpu_attn"] == pytest.approx(
        cfg.num_layers * pairs * paid_hw.cpu_attention_pair(4, compressed=False)
    )
    on_gpu = dataclasses.replace(on_cpu, attention_on_cpu=False)
    assert estimate(cfg, on_gpu, torch.float16, 512, 32, paid_hw).decode_step_s == (
        estimate(cfg, on_gpu, torch.float16, 512, 32, PROFILE).decode_step_s
    )


def test_the_next_micro_batchs_compute_hides_behind_the_cpu_attention():
    """Attended on the CPU, micro-batch k + 1's GPU work runs while the CPU attends k
    (`Executor._one_behind`): where each micro-batch's attention outlasts its compute,
    more compute lengthens the layer by the last micro-batch's share only; where the
    compute is the longer, by all of it."""
    cfg = cfg_of("llama-3.1-8b")
    policy = Policy(
        64, 8, weights=Placement(0, 1, 0), kv_cache=Placement(0, 1, 0), attention_on_cpu=True
    )
    for extra, hidden in ((1e-4, True), (0.05, False)):
        more = dataclasses.replace(PROFILE, decode_elementwise_s={"llama": extra})
        base, paid = (estimate(cfg, policy, torch.float16, 512, 32, hw) for hw in (PROFILE, more))
        grown = (paid.decode_step_s - base.decode_step_s) / cfg.num_layers
        per_micro = base.lanes_decode_s["cpu_attn"] / cfg.num_layers / 8
        s0, s1 = (e.lanes_decode_s["compute"] / cfg.num_layers / 8 for e in (base, paid))
        assert (s1 < per_micro) == hidden and s0 < per_micro
        if hidden:  # the last micro-batch's share only
            assert grown == pytest.approx(s1 - s0)
        else:  # every micro-batch after the first waits for its compute
            assert grown == pytest.approx(8 * s1 - 7 * per_micro - s0)


def test_a_measured_profile_keeps_w1c_attention_on_the_gpu():
    """H100 run 233323's own profile (its C kernel attends an int4 cache on the CPU at
    172 GB/s of fp16-sized K/V): the search put 2 of 16 sequences' KV in CPU memory and
    attended them there, predicted 264 tok/s; the run measured 100.6 (68 ms a step
    against 38). With the host's issue after each CPU attention counted, it keeps the
    12 x 1 all-GPU plan (297.5 tok/s measured on the same machine, run 181458)."""
    hw = HardwareProfile.from_file(Path(__file__).parent / "data" / "profile_h100_233323.json")
    best = search(
        cfg_of("opt-30b"),
        torch.float16,
        512,
        32,
        hw,
        Caps(24 * 10**9, hw.default_cpu_cap, False),
        compressions=[INT4],
        kv_compressions=[INT4],
    )
    assert not best.policy.attention_on_cpu
    assert best.policy.kv_cache.gpu == 1.0 and best.policy.weights.gpu == 1.0


def test_the_decode_matmul_rate_follows_the_micro_batch_rows():
    """Measured at 16 and at 64 rows (a profile without the 32-row figure): between
    them a byte's time is linear in the rows."""
    hw = dataclasses.replace(
        PROFILE, matmul_gbps={"int4": 1000.0}, matmul_gbps_wide={"int4": 250.0}
    )
    assert hw.matmul_rate(INT4, 1) == hw.matmul_rate(INT4, 16) == 1000.0
    assert hw.matmul_rate(INT4, 40) == pytest.approx(1 / (0.5 / 1000 + 0.5 / 250))
    assert hw.matmul_rate(INT4, 64) == hw.matmul_rate(INT4, 512) == 250.0
    assert hw.matmul_rate(None, 64) == PROFILE.hbm_gbps  # not measured: HBM's rate
    # measured at the kernel's middle tile too: each row count at its tile's rate
    tiles = dataclasses.replace(hw, matmul_gbps_mid={"int4": 400.0})
    assert [tiles.matmul_rate(INT4, m) for m in (16, 17, 32, 33, 64, 96)] == [
        1000.0, 400.0, 400.0, 250.0, 250.0, 250.0
    ]  # fmt: skip
    cfg = cfg_of("llama-3.1-8b")
    for rows, slower in ((16, False), (48, True)):
        policy = Policy(rows, 1, weight_compression=INT4, kv_compression=INT4)
        base, wide = (
            estimate(cfg, policy, torch.float16, 512, 32, p).lanes_decode_s["compute"]
            for p in (dataclasses.replace(hw, matmul_gbps_wide={}), hw)
        )
        assert (wide > 1.5 * base) == slower


def test_a_call_fixed_time_and_rate_are_fitted_from_two_calls():
    # 5 us + bytes at 2 TB/s, seen at 8 MB and 120 MB
    rate, fixed = fit_call((8e6, 5e-6 + 8e6 / 2e12), (120e6, 5e-6 + 120e6 / 2e12))
    assert rate == pytest.approx(2000.0) and fixed == pytest.approx(5e-6)
    # the small call no slower a byte than the large: no fixed time, the large call's rate
    assert fit_call((8e6, 4e-6), (120e6, 80e-6)) == (pytest.approx(1500.0), 0.0)


def test_an_implausible_cpu_attention_fit_falls_back_to_the_long_calls_rate():
    """A fit whose time a call explains most of the long call's time is the two timings'
    noise: 3.0 and 3.3 ms for 67 and 268 MB would fit 670 GB/s. The long call's rate
    stands, with no time a pair. A fixed share like the executor shapes' (43%, H100 c103:
    140 GB/s and 2.8 us a pair) is kept."""
    short, long = (67e6, 3.0e-3), (268e6, 3.3e-3)
    assert fit_call(short, long)[0] > 600
    assert fit_cpu_attention(short, long) == (pytest.approx(268e6 / 3.3e-3 / GB), 0.0)
    fixed, rate = 1.4e-3, 140e9
    rate_gbps, fixed_s = fit_cpu_attention(
        (67e6, fixed + 67e6 / rate), (268e6, fixed + 268e6 / rate)
    )
    assert rate_gbps == pytest.approx(140.0) and fixed_s == pytest.approx(fixed)


@pytest.mark.parametrize("compressed", [False, True])
def test_the_cpu_attention_calls_take_copies_of_their_cache_in_turn(monkeypatch, compressed):
    """Given pool memory, a timed call's cache is one of as many copies as the memory
    holds, taken in turn, so no call finds it in the CPU's last-level cache (as the
    executor's CPU homes never are); every copy holds the same cache."""
    seen: list[int] = []

    def dense(q, k, v, bias):
        seen.append(k.data_ptr())

    def quant(q, cache, bias, slots):
        seen.append(cache.k_codes.data_ptr())

    monkeypatch.setattr(measure_cpu_attention, "attend", dense)
    monkeypatch.setattr(measure_cpu_attention, "decode_attention_cpu", quant)
    monkeypatch.setattr(measure_cpu_attention, "CPU_ATTENTION_PAIRS", 64)
    one = cpu_attention_call(torch.float32, compressed, 4, slots=256)
    home = torch.zeros(64 * 2**20, dtype=torch.uint8)
    call, nbytes = cpu_attention_call(torch.float32, compressed, 4, home, slots=256)
    assert nbytes == one[1] == 2 * 64 * 256 * 128 * 4
    seen.clear()
    for _ in range(24):
        call()
    copies = len(set(seen))
    assert copies == len(set(seen[:copies])) > 2 and seen[copies:] == seen[:-copies]
    stride = (seen[1] - seen[0]) if seen[1] > seen[0] else seen[0] - seen[1]
    assert torch.equal(home[:stride], home[stride : 2 * stride])


def test_attention_calls_fixed_pair_and_byte_terms_are_fitted_from_three_calls():
    # 4 us a call, 20 ns a (sequence, KV head), bytes at 2 TB/s: seen at 128 and 1024
    # pairs of a short context and 1024 of a long one
    def seconds(pairs: int, nbytes: float) -> float:
        return 4e-6 + pairs * 20e-9 + nbytes / 2e12

    shapes = [(128, 9e6), (1024, 72e6), (1024, 270e6)]
    rate, fixed, pair = fit_attention([(p, b, seconds(p, b)) for p, b in shapes])
    assert rate == pytest.approx(2000.0)
    assert fixed == pytest.approx(4e-6) and pair == pytest.approx(20e-9)
    # a pair's time that comes out negative (the many-pair call fast for its bytes) is 0
    noisy = [(128, 9e6, 9e-6), (1024, 72e6, 30e-6), (1024, 270e6, 130e-6)]
    assert fit_attention(noisy)[2] == 0.0
    # the long call no slower than the short: its rate alone
    flat = [(128, 9e6, 9e-6), (1024, 72e6, 140e-6), (1024, 270e6, 135e-6)]
    assert fit_attention(flat) == (pytest.approx(270e6 / 135e-6 / 1e9), 0.0, 0.0)


def test_a_decode_attention_pays_its_pairs_time_for_every_sequence_and_kv_head():
    """The pair term counts every sequence attended on the GPU times the KV heads, each
    layer; with attention on the CPU, only the GPU rows' sequences."""
    cfg = cfg_of("llama-3.1-8b")
    pair = {"pair": {"int4": 1e-6}}

    def compute(policy: Policy, **figures) -> float:
        hw = dataclasses.replace(PROFILE, attention_pair_s=figures.get("pair", {}))
        return estimate(cfg, policy, torch.float16, 512, 32, hw).lanes_decode_s["compute"]

    gpu = Policy(12, 2, weight_compression=INT4, kv_compression=INT4)
    added = compute(gpu, **pair) - compute(gpu)
    assert added == pytest.approx(cfg.num_layers * 24 * cfg.num_kv_heads * 1e-6)
    half = Policy(
        12, 2, kv_cache=Placement(0.5, 0.5, 0), attention_on_cpu=True,
        weight_compression=INT4, kv_compression=INT4,
    )  # fmt: skip
    added = compute(half, **pair) - compute(half)
    assert added == pytest.approx(cfg.num_layers * 12 * cfg.num_kv_heads * 1e-6)


def test_a_gpu_resident_decode_step_pays_each_kernel_call_and_the_layers_other_kernels():
    """All on the GPU the step is its kernels' time: each micro-batch's four matmul
    calls and its attention call pay their fixed time beside their bytes, and the
    layer's other kernels (norms, activations, the KV write, the gaps) their measured
    time a micro-batch."""
    cfg = cfg_of("opt-30b")
    policy = Policy(6, 2, weight_compression=INT4, kv_compression=INT4)

    def compute(**figures) -> float:
        hw = dataclasses.replace(PROFILE, **figures)
        return estimate(cfg, policy, torch.float16, 512, 32, hw).lanes_decode_s["compute"]

    base = compute()
    per_micro = {"matmul_call_s": 4 * 1e-5, "attention_call_s": 2e-5, "decode_elementwise_s": 3e-5}
    for name, added in per_micro.items():
        figure = {"int4": added / 4 if name == "matmul_call_s" else added}
        if name == "decode_elementwise_s":
            figure = {"opt": added, "llama": 1.0}  # another family's figure is not OPT's
        assert compute(**{name: figure}) - base == pytest.approx(cfg.num_layers * 2 * added)
    assert compute(matmul_call_s={"dense": 1.0}) == base  # another format's figure


def test_costly_gpu_kernel_calls_move_the_search_to_fewer_micro_batches():
    """The same sequences in fewer, larger micro-batches make fewer kernel calls: a
    machine where a call costs much moves the search there."""
    cfg, caps = cfg_of("opt-30b"), Caps(12 * GB, 64 * GB, False)
    formats = {"compressions": (INT4,), "kv_compressions": (INT4,)}
    base = search(cfg, torch.float16, 512, 32, PROFILE, caps, **formats)
    assert base.policy.num_gpu_batches > 1
    costly = dataclasses.replace(PROFILE, decode_elementwise_s={"opt": 0.02})
    chosen = search(cfg, torch.float16, 512, 32, costly, caps, **formats)
    assert chosen.policy.num_gpu_batches < base.policy.num_gpu_batches


def test_a_costly_micro_batch_moves_the_search_to_fewer_micro_batches():
    cfg, caps = cfg_of("opt-30b"), Caps(12 * GB, 64 * GB, False)
    formats = {"compressions": (INT4,), "kv_compressions": (INT4,)}
    base = search(cfg, torch.float16, 512, 32, PROFILE, caps, **formats)
    assert base.policy.num_gpu_batches > 1
    costly = dataclasses.replace(PROFILE, micro_fixed_s=0.05)
    chosen = search(cfg, torch.float16, 512, 32, costly, caps, **formats)
    assert chosen.policy.num_gpu_batches < base.policy.num_gpu_batches
    assert chosen.lanes_decode_s["host"] > 0


def test_the_off_gpu_kv_chain_is_compute_time_and_favours_fewer_micro_batches():
    """A micro-batch's off-GPU KV chain (attention over the scratch, the merge, the
    store) runs between the micro-batch's matmuls: it adds to the compute lane, once a micro-batch
    and layer, not to the host lane, so a costly chain makes fewer, larger micro-batches
    the faster plan for the same sequences."""
    cfg = cfg_of("opt-30b")
    kv = Placement(0.25, 0.75, 0)
    many = Policy(2, 16, kv_cache=kv, weight_compression=INT4, kv_compression=INT4)
    few = Policy(8, 4, kv_cache=kv, weight_compression=INT4, kv_compression=INT4)
    chain = dataclasses.replace(PROFILE, offgpu_kv_s=0.002)
    for policy in (many, few):
        free = estimate(cfg, policy, torch.float16, 512, 32, PROFILE)
        costly = estimate(cfg, policy, torch.float16, 512, 32, chain)
        added = cfg.num_layers * policy.num_gpu_batches * 0.002
        assert costly.lanes_decode_s["compute"] == pytest.approx(
            free.lanes_decode_s["compute"] + added
        )
        assert costly.lanes_decode_s["host"] == pytest.approx(free.lanes_decode_s["host"])
    assert (
        estimate(cfg, few, torch.float16, 512, 32, chain).decode_step_s
        < estimate(cfg, many, torch.float16, 512, 32, chain).decode_step_s
    )


def test_the_off_gpu_chain_is_the_graph_paths_where_every_weight_stays_on_the_gpu():
    """Plans whose decode replays graphs (every weight on the GPU) pay the chain
    measured on that path; plans with streamed weights run eagerly and pay the other."""
    cfg = cfg_of("opt-30b")
    w4 = {"weight_compression": INT4, "kv_compression": INT4}
    resident = Policy(8, 2, kv_cache=Placement(0, 1, 0), **w4)
    streamed = Policy(8, 2, weights=Placement(0.5, 0.5, 0), kv_cache=Placement(0, 1, 0), **w4)
    eager_only = dataclasses.replace(PROFILE, offgpu_kv_s=0.001, offgpu_kv_graph_s=0.0)
    both = dataclasses.replace(eager_only, offgpu_kv_graph_s=0.003)
    for policy, extra in ((resident, 0.002), (streamed, 0.0)):
        before = estimate(cfg, policy, torch.float16, 512, 32, eager_only).lanes_decode_s
        after = estimate(cfg, policy, torch.float16, 512, 32, both).lanes_decode_s
        added = cfg.num_layers * policy.num_gpu_batches * extra
        assert after["compute"] == pytest.approx(before["compute"] + added)
    # a disk home's chain likewise, on the disk lane
    on_disk = dataclasses.replace(resident, kv_cache=Placement(0, 0.875, 0.125))
    eager_disk = dataclasses.replace(both, disk_kv_s=0.001, disk_kv_graph_s=0.0)
    graph_disk = dataclasses.replace(eager_disk, disk_kv_graph_s=0.004)
    before = estimate(cfg, on_disk, torch.float16, 512, 32, eager_disk).lanes_decode_s
    after = estimate(cfg, on_disk, torch.float16, 512, 32, graph_disk).lanes_decode_s
    assert after["disk"] == pytest.approx(before["disk"] + cfg.num_layers * 2 * 0.003)


def test_each_disk_home_pays_its_chain_on_the_disk_lane():
    """Micro-batches with KV rows on disk pay the measured chain (the read's and the
    write-back's latency) once a layer each, on the disk lane; rows in CPU homes do not."""
    cfg = cfg_of("opt-30b")
    w4 = {"weight_compression": INT4, "kv_compression": INT4}
    chain = dataclasses.replace(PROFILE, disk_kv_s=0.003)
    on_disk = Policy(8, 2, kv_cache=Placement(0, 0.875, 0.125), **w4)
    free, paid = (estimate(cfg, on_disk, torch.float16, 512, 32, hw) for hw in (PROFILE, chain))
    added = paid.lanes_decode_s["disk"] - free.lanes_decode_s["disk"]
    assert added == pytest.approx(cfg.num_layers * 2 * 0.003)
    assert paid.decode_step_s > free.decode_step_s
    in_cpu = Policy(8, 2, kv_cache=Placement(0, 1, 0), **w4)
    assert estimate(cfg, in_cpu, torch.float16, 512, 32, chain) == estimate(
        cfg, in_cpu, torch.float16, 512, 32, PROFILE
    )


def test_a_layers_disk_homes_chain_follows_its_compute_and_disk_weights_run_ahead():
    """Attended on the GPU, a layer's disk homes are read, crossed, attended, stored and
    written back in a chain with the layer's compute (the H200 trace of c111): the step
    grows with the compute even where the disk lane is the busiest. Weights read from
    disk run ahead of the compute: there the disk lane alone bounds the layer."""
    cfg = cfg_of("opt-30b")
    w4 = {"weight_compression": INT4, "kv_compression": INT4}
    kv_on_disk = Policy(8, 2, kv_cache=Placement(0, 0.875, 0.125), **w4)
    w_on_disk = Policy(8, 2, weights=Placement(0.2, 0.3, 0.5), kv_cache=Placement(0, 1, 0), **w4)
    slow = dataclasses.replace(PROFILE, disk_kv_s=0.02)  # 20 ms a home: disk the busiest
    costly = dataclasses.replace(slow, decode_elementwise_s={"opt": 0.001})
    for policy, follows in ((kv_on_disk, True), (w_on_disk, False)):
        before, after = (estimate(cfg, policy, torch.float16, 512, 32, hw) for hw in (slow, costly))
        lanes = before.lanes_decode_s
        assert lanes["disk"] > max(lanes["compute"], lanes["h2d"], lanes["host"]), policy
        added = after.lanes_decode_s["compute"] - lanes["compute"]
        assert added > 0
        grown = after.decode_step_s - before.decode_step_s
        assert grown == pytest.approx(added if follows else 0.0, abs=1e-9), policy


def test_disk_kv_homes_are_read_at_their_own_rate_and_disk_weights_at_the_streams():
    """KV homes on disk cross at the rate measured for whole-home reads beside the host
    thread; weights on disk keep the sequential rate; 0 (not measured) falls back to it."""
    cfg = cfg_of("opt-30b")
    w4 = {"weight_compression": INT4, "kv_compression": INT4}
    on_disk = Policy(8, 2, kv_cache=Placement(0, 0.875, 0.125), **w4)
    assert PROFILE.disk_kv_read_gbps == 0.0
    slow = dataclasses.replace(PROFILE, disk_kv_read_gbps=PROFILE.disk_read_gbps / 2)
    same = dataclasses.replace(PROFILE, disk_kv_read_gbps=PROFILE.disk_read_gbps)
    base, paid, unchanged = (
        estimate(cfg, on_disk, torch.float16, 512, 32, hw) for hw in (PROFILE, slow, same)
    )
    assert unchanged == base
    # the lane is linear in 1 / rate: its KV term is the homes' bytes a step (2 rows,
    # one a micro-batch, at the generation's mean context) over the rate
    third = dataclasses.replace(PROFILE, disk_kv_read_gbps=PROFILE.disk_read_gbps / 3)
    lane = [
        estimate(cfg, on_disk, torch.float16, 512, 32, hw).lanes_decode_s["disk"]
        for hw in (PROFILE, slow, third)
    ]
    slots = 512 + 32
    kv_tok = kv_row_bytes(cfg.num_kv_heads, cfg.head_dim, slots, torch.float16, INT4) / slots
    kv_bytes = cfg.num_layers * 2 * (512 + 16) * kv_tok
    at_rate = kv_bytes / (PROFILE.disk_read_gbps * GB)
    assert lane[1] - lane[0] == pytest.approx(at_rate)
    assert lane[2] - lane[0] == pytest.approx(2 * at_rate)
    assert paid.decode_step_s > base.decode_step_s
    weights_on_disk = Policy(8, 2, weights=Placement(0.5, 0.3, 0.2))
    assert estimate(cfg, weights_on_disk, torch.float16, 512, 32, slow) == estimate(
        cfg, weights_on_disk, torch.float16, 512, 32, PROFILE
    )


def test_the_kv_disk_read_rate_is_measured_through_the_spill_file(tmp_path):
    """The profile's measurement runs the executor's read path (a spill file in the
    given directory, removed after) beside a busy host thread, and restores the GIL's
    switch interval."""
    before = sys.getswitchinterval()
    rate = kv_disk_read_rate(tmp_path, homes=2)
    assert 0.01 < rate < 1e4  # GB/s
    assert sys.getswitchinterval() == before
    assert list(tmp_path.iterdir()) == []


def test_the_all_reduce_costs_tensor_parallel_plans_time():
    cfg = cfg_of("llama-2-13b")
    policy = Policy(16, 1)
    free = estimate(cfg, policy, torch.float16, 512, 32, PROFILE, tp=2)
    slow = dataclasses.replace(PROFILE, allreduce_gbps=0.5, allreduce_latency_s=1e-3)
    paid = estimate(cfg, policy, torch.float16, 512, 32, slow, tp=2)
    assert paid.decode_step_s > free.decode_step_s
    # 2 all-reduces a layer of 16 rows x 5120 fp16; a 2-rank ring moves 2 (2 - 1) / 2 = 1
    # buffer over the bus, plus the latency
    per_layer = 2 * (1e-3 + 16 * 5120 * 2 / 0.5e9)
    assert paid.decode_step_s - free.decode_step_s == pytest.approx(
        cfg.num_layers * per_layer, rel=0.01
    )
    assert estimate(cfg, policy, torch.float16, 512, 32, slow).decode_step_s == pytest.approx(
        free.decode_step_s
    )  # one rank: no all-reduce


def test_ranked_plans_differ_in_kind_and_lead_with_the_search_best():
    cfg, caps = cfg_of("opt-30b"), Caps(24 * GB, 100 * GB, False)
    plans = ranked(cfg, torch.float16, 512, 32, PROFILE, caps, top=3)
    assert len(plans) == 3
    assert plans[0].policy == search(cfg, torch.float16, 512, 32, PROFILE, caps).policy
    kinds = {
        (e.policy.gpu_batch_size, e.policy.num_gpu_batches, e.policy.attention_on_cpu)
        for e in plans
    }
    assert len(kinds) == 3
    assert [e.total_tok_s for e in plans] == sorted((e.total_tok_s for e in plans), reverse=True)


def _injected_stage_seconds(policy, device, rows, steps, nvme=None) -> float:
    """A stage's step time as the probes would measure it: 10 ms with one micro-batch,
    16 with four, 20 with four attended on the CPU, 3 replayed from CUDA graphs."""
    if policy.attention_on_cpu:
        return 0.020
    if policy.weights.gpu == 1.0:
        return 0.003
    return {1: 0.010, 4: 0.016}[policy.num_gpu_batches]


def _injected_chains(policies, device, steps, nvme) -> list[float]:
    """The off-GPU KV chain's and the disk's step time beyond the plan before each: with
    streamed weights 4 and 8 ms; with the weights on the GPU 2 ms, and the disk's a
    drift below nothing."""
    return [0.002, -0.001] if policies[0].weights.gpu == 1.0 else [0.004, 0.008]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_executor_fixed_costs_from_injected_timings(monkeypatch, tmp_path, device):
    """The fixed costs' arithmetic on timings injected in place of the probes' (a loaded
    machine's timings cannot move it; `offload-profile` measures for real)."""
    from offload.executor import fixed_costs

    monkeypatch.setattr(fixed_costs, "_stage_seconds", _injected_stage_seconds)
    monkeypatch.setattr(fixed_costs, "_chains", _injected_chains)
    figures = overheads(torch.device(device), tmp_path, steps=2)
    stages_per_layer = (fixed_costs.OVERHEAD_LAYERS + 2) / fixed_costs.OVERHEAD_LAYERS
    per_block = stages_per_layer / 4  # a layer's share of a stage over 4 micro-batches
    cuda = device == "cuda"
    assert figures == pytest.approx({
        "micro_fixed_s": (0.016 - 0.010) / 3,
        "layer_fixed_s": 0.010 - (0.016 - 0.010) / 3,
        "offgpu_kv_s": 0.004 * per_block,
        "disk_kv_s": 0.008 * per_block,
        "graph_layer_s": 0.003 if cuda else 0.0,  # no CUDA graphs on the CPU
        "offgpu_kv_graph_s": 0.002 * per_block if cuda else 0.0,
        "disk_kv_graph_s": 0.0,  # a difference below nothing is none
        # without CUDA all attention is the CPU's: nothing beyond it
        "cpu_attention_fixed_s": (0.020 - 0.016) / 4 * stages_per_layer if cuda else 0.0,
    })  # fmt: skip


def _injected_full_width(prefill_slope: float, decode_slope: float, modeled: bool):
    """`_full_width_seconds` whose times grow by a slope a layer: prefill (and, where
    `modeled`, as on CUDA, the matmul and attention kernels' GPU time, 1 ms a layer, and
    0.1 ms of gaps between a decode step's kernels), decode."""

    def full_width(cfg, device, rows, tokens, steps=8):
        layers = cfg.num_layers
        kernels = 1e-3 * layers if modeled else None
        prefill = prefill_slope * layers + (kernels or 0.0)
        return (prefill, kernels), (decode_slope * layers, 1e-4 * layers if modeled else 0.0)

    return full_width


def test_elementwise_figures_from_injected_timings(monkeypatch):
    """A layer's element-wise time: the difference of a deep and a shallow model beyond
    its matmuls and attention, per token and hidden unit in prefill (clamped at 0 where
    the model's own terms exceed it), on timings injected in place of the probes'."""
    from offload.executor import fixed_costs

    def figures(device, prefill_slope, decode_slope):
        injected = _injected_full_width(prefill_slope, decode_slope, device == "cuda")
        monkeypatch.setattr(fixed_costs, "_full_width_seconds", injected)
        return elementwise(PROFILE, torch.device(device))

    rows, tokens = fixed_costs.ELEMENTWISE_SHAPE["cuda"]
    gpu = figures("cuda", 5e-3, 2e-4)  # on CUDA: the kernels' own time taken out
    assert set(gpu["prefill_elementwise_s"]) == {"opt", "bloom", "llama"}
    for family, per_unit in gpu["prefill_elementwise_s"].items():
        hidden = fixed_costs._elementwise_config(family, torch.device("cuda")).hidden_size
        assert per_unit == pytest.approx(5e-3 / (rows * tokens * hidden))
        assert gpu["decode_elementwise_s"][family] == pytest.approx(2e-4 + 1e-4)
    # on the CPU the matmuls and attention are the profile's model: a slope 1 ms higher
    # a layer is that much more element-wise time, and a slope of 0 leaves none
    rows, tokens = fixed_costs.ELEMENTWISE_SHAPE["cpu"]
    low, high, none = figures("cpu", 5e-3, 2e-3), figures("cpu", 6e-3, 3e-3), figures("cpu", 0, 0)
    for family in low["prefill_elementwise_s"]:
        hidden = fixed_costs._elementwise_config(family, torch.device("cpu")).hidden_size
        step = high["prefill_elementwise_s"][family] - low["prefill_elementwise_s"][family]
        assert step == pytest.approx(1e-3 / (rows * tokens * hidden))
        step = high["decode_elementwise_s"][family] - low["decode_elementwise_s"][family]
        assert step == pytest.approx(1e-3)
        assert none["prefill_elementwise_s"][family] == none["decode_elementwise_s"][family] == 0


def test_the_chain_probe_leaves_no_spill_file(tmp_path):
    """The real probe of the KV chains (its figures are timings, not asserted here)
    closes its executors: the disk homes' spill file is gone."""
    from offload.executor.fixed_costs import _chains

    off_gpu = Policy(1, 4, weights=Placement(0.0, 1.0, 0.0), kv_cache=Placement(0, 0, 1),
                     kv_compression=INT4)  # fmt: skip
    plain = Policy(1, 4, weights=Placement(0.0, 1.0, 0.0))
    assert len(_chains([plain, off_gpu], torch.device("cpu"), 2, tmp_path)) == 1
    assert not list(tmp_path.iterdir())


def test_probe_extrapolates_from_two_depths(tiny_checkpoints):
    from offload.models.resolve import resolve_model

    cfg = resolve_model(str(tiny_checkpoints["opt"][0]), dummy=True).config
    policy = Policy(2, 2, weights=Placement(0.0, 1.0, 0.0))
    probe = probe_plan(cfg, policy, torch.float32, torch.device("cpu"), 8, 4)
    assert probe.prefill_s > 0 and probe.decode_step_s > 0
    assert probe.total_tok_s == pytest.approx(4 * 4 / (probe.prefill_s + 3 * probe.decode_step_s))
    assert probe.seconds_spent >= probe.prefill_s


def test_the_probes_cuts_take_turns_so_a_drift_falls_on_both(monkeypatch):
    """A machine that slows during the probe (each run 1 ms slower than the last): the
    two cuts are timed in turns, so their medians differ by the layers' cost plus one
    turn's drift. Timed one cut after the other they would differ by 7 ms here. A run's
    time is simulated (what it returns), so a loaded machine cannot move it."""
    from offload.executor import probe

    calls = []
    monkeypatch.setattr(probe, "synced_seconds", lambda device, fn: fn())

    def run(ex, batch) -> float:
        calls.append(ex.name)
        return ex.cost + (len(calls) - 1) * 1e-3

    cuts = [
        (SimpleNamespace(name=name, cost=cost, kv=SimpleNamespace(settle=lambda: None)), None)
        for name, cost in (("shallow", 2e-3), ("deep", 4e-3))
    ]
    shallow, deep = _turns(torch.device("cpu"), cuts, [run] * 5)
    assert calls == ["shallow", "deep"] * 5
    assert deep - shallow == pytest.approx(3e-3, abs=1e-9)


def test_plan_verify_probes_and_keeps_the_measured_best(tmp_path, tiny_checkpoints, capsys):
    path = tmp_path / "hw.json"
    path.write_text(HardwareProfile.to_json(PROFILE))
    model = str(tiny_checkpoints["opt"][0])
    argv = ["--model", model, "--gpu-mem", "1GB", "--cpu-mem", "8GB", "--profile", str(path)]
    argv += ["--prompt-len", "8", "--max-tokens", "4", "--verify", "--json"]
    assert plan_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    verified = out["verified"]
    assert 1 <= len(verified) <= 3
    assert all(v["probed_tok_s"] > 0 and v["predicted_tok_s"] > 0 for v in verified)
    rates = [v["probed_tok_s"] for v in verified]
    assert rates == sorted(rates, reverse=True)
    assert out["policy"] == verified[0]["policy"]  # the measured best is the plan


def test_all_reduce_is_measured_between_ranks():
    from offload.parallel.bandwidth import measure_node

    node = measure_node(2, large_bytes=2**20)  # gloo on the CPU here
    assert node["allreduce_gbps"] > 0 and 0 < node["allreduce_latency_s"] < 1.0
    assert node["rank_skew"] >= 0 and node["h2d_all_gbps"] == 0.0  # (no GPUs)
    dataclasses.replace(PROFILE, **node)  # figures a profile takes
