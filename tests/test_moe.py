"""Mixtures of experts: dummy routing's skew, the block's parts against its whole.

The families' math against transformers' own classes runs in tests/test_model_math.py
(the `tiny_models.MOE_CASES`)."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from offload.api.llm import LLM
from offload.core.config import ModelConfig
from offload.core.presets import PRESETS
from offload.core.sampling import SamplingParams
from offload.executor.runner import PlainRunner
from offload.io.tiers import Tier
from offload.kernels.formats import Compression
from offload.models import moe
from offload.models.weights import DummySource
from offload.policies.cost import estimate
from offload.policies.hardware import HardwareProfile
from offload.policies.policy import Placement, Policy
from tests import tiny_models


def cfg_of(name: str) -> ModelConfig:
    return ModelConfig.from_hf(PRESETS[name], name)


def _tiny(name: str, **extra) -> ModelConfig:
    hf = {**PRESETS[name], "hidden_size": 64, "num_hidden_layers": 2, "head_dim": 16}
    hf.update({"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320})
    hf.update({"intermediate_size": 96, "moe_intermediate_size": 32})
    return ModelConfig.from_hf({**hf, **extra}, name)


def test_dummy_routing_is_skewed_in_a_seeded_order():
    """The dummy router's rows are scaled in a seeded order: some experts take several
    times the tokens of others, and the favourites differ between layers."""
    cfg = _tiny("qwen3-235b-a22b", num_experts=64)  # top 8
    h = torch.randn(4096, cfg.hidden_size)
    source = DummySource(cfg, seed=0)
    favourites = []
    for layer in range(2):
        w = source.layer(layer, torch.float32, torch.device("cpu"))
        routing = moe.route(cfg, w, h)
        counts = torch.bincount(routing.ids.flatten(), minlength=cfg.num_experts)
        assert counts.max() > 3 * counts.min(), counts
        favourites.append(counts.argmax().item())
    assert favourites[0] != favourites[1]


def test_the_block_by_parts_is_the_block(monkeypatch):
    """Routing a block, then each chosen expert over its rows (in slices: 3 rows here),
    each computed in any order and added in ascending expert order, is `moe_block` bit
    for bit."""
    monkeypatch.setattr(moe, "EXPERT_CHUNK_ROWS", 3)
    cfg = _tiny("glm-4.5-air")
    w = DummySource(cfg, seed=1).layer(1, torch.float32, torch.device("cpu"))
    x, residual = torch.randn(2, 5, cfg.hidden_size), torch.randn(2, 5, cfg.hidden_size)
    whole = moe.moe_block(cfg, w, x.clone(), residual)
    h, res = moe.pre(cfg, w, x.clone(), residual)
    chosen = moe.expert_rows(moe.route(cfg, w, h))
    assert max(rows.shape[0] for _, rows, _ in chosen) > 3  # some expert runs in slices
    alone = {}
    for expert, rows, weights in chosen[::-1]:
        alone[expert] = torch.zeros_like(h)
        moe.apply_expert(alone[expert], h, rows, weights, *moe.expert_weights(w, expert))
    out = torch.zeros_like(h)
    for expert, _, _ in chosen:
        out += alone[expert]
    assert torch.equal(moe.post(out, moe.shared(cfg, w, h), res).view_as(x), whole)


# -- the executor: experts by module ------------------------------------------------------
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34], [7, 8], [100, 101, 102]]
PARAMS = SamplingParams(max_new_tokens=6)
# every family's experts on all three tiers (each layer: 1-7 on the GPU, 2-5 in pinned
# memory, 1-4 on disk), the KV over all three too, three micro-batches
SPLIT = Policy(
    gpu_batch_size=2,
    num_gpu_batches=3,
    weights=Placement(0.5, 0.3, 0.2),
    kv_cache=Placement(0.25, 0.25, 0.5),
)
INT4 = Compression(bits=4, group_size=32, symmetric=False)


def _tokens(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]


def _plain(directory, compression=None) -> list[list[int]]:
    llm = LLM(str(directory), device="cpu", dtype="float32", batch_size=8)
    if compression is not None:
        with llm.spec.open_weights() as source:
            llm.runner = PlainRunner(
                source, torch.float32, llm.device, weight_compression=compression
            )
        llm.loop.runner = llm.runner
    return _tokens(llm)


@pytest.mark.parametrize("compression", [None, INT4], ids=["fp32", "int4-g32"])
@pytest.mark.parametrize("case", list(tiny_models.MOE_CASES))
def test_experts_on_every_tier_give_the_plain_tokens(case, compression, tiny_checkpoints, tmp_path):
    """Experts on the GPU, in pinned memory and on disk, fetched by module (int4: their
    codes and group parameters cross), give the plain run's tokens; so does the dense
    schedule, which fetches every expert for every micro-batch."""
    directory, _ = tiny_checkpoints[case]
    policy = (
        SPLIT if compression is None else dataclasses.replace(SPLIT, weight_compression=compression)
    )
    want = _plain(directory, compression)
    with LLM(str(directory), device="cpu", dtype="float32", policy=policy, nvme=tmp_path) as llm:
        homes = next(iter(llm.runner.experts.homes.values()))
        assert {homes.tier(e) for e in range(homes.span.count)} == {Tier.GPU, Tier.CPU, Tier.DISK}
        assert _tokens(llm) == want, f"{case}: experts by module"
        llm.runner.experts.dense = True
        assert _tokens(llm) == want, f"{case}: the dense schedule"


def _steps(llm, monkeypatch, prompts) -> list[tuple[dict, list, dict]]:
    """Run the prompts, recording each step's chosen experts a stage, trace spans and
    experts' tiers."""
    fetcher, runner = llm.runner.experts, llm.runner
    steps: list[tuple[dict, list, dict]] = []
    chosen: dict[int, list[list[int]]] = {}
    run, forward = fetcher.run, runner.forward

    def recording_run(index, experts, *args):
        chosen.setdefault(index, []).append(list(experts))
        return run(index, experts, *args)

    def recording_forward(*args, **kwargs):
        chosen.clear()
        out = forward(*args, **kwargs)  # (rebalances first: the tiers are the step's after)
        tiers = {i: [h.tier(e) for e in range(h.span.count)] for i, h in fetcher.homes.items()}
        steps.append(({k: v[:] for k, v in chosen.items()}, list(runner.tracer.resolved()), tiers))
        return out

    monkeypatch.setattr(fetcher, "run", recording_run)
    monkeypatch.setattr(runner, "forward", recording_forward)
    llm.generate(prompts, PARAMS)
    return steps


def _moved(spans, key: str, lane: str) -> list[tuple[int, int]]:
    """(expert, bytes) of every span on `lane` that moved one of stage `key`'s experts."""
    out = []
    for span_lane, name, _, _, nbytes in spans:
        m = re.fullmatch(rf"(?:read )?{key}(?: expert |/experts\.)(\d+)\b.*", name)
        if span_lane == lane and m:
            out.append((int(m.group(1)), nbytes))
    return out


def test_each_chosen_expert_crosses_once_a_layer_and_an_unchosen_one_never(
    tiny_checkpoints, tmp_path, monkeypatch
):
    """Counted from the lanes' own spans: a decode step copies each chosen expert not on
    the GPU once a layer (its whole bytes), reads a disk one once, and moves no expert
    that no row chose; the dense schedule copies every expert off the GPU once for each
    micro-batch."""
    directory, _ = tiny_checkpoints["qwen3-moe"]  # 16 experts, 4 a token
    with LLM(
        str(directory), device="cpu", dtype="float32", policy=SPLIT, nvme=tmp_path, trace=True
    ) as llm:
        homes = llm.runner.experts.homes
        unchosen_off_gpu = 0
        for chosen, spans, tiers in _steps(llm, monkeypatch, PROMPTS[:2]):
            for index, expert_homes in homes.items():
                key, tier = expert_homes.key, tiers[index]
                (experts,) = chosen[index]  # routed once a layer and step
                off_gpu = [e for e in experts if tier[e] is not Tier.GPU]
                on_disk = {e for e in experts if tier[e] is Tier.DISK}
                nbytes = expert_homes.span.expert_bytes
                assert _moved(spans, key, "h2d") == [(e, nbytes) for e in off_gpu]
                read = _moved(spans, key, "disk")
                assert {e for e, _ in read} == on_disk
                assert sum(b for _, b in read) == nbytes * len(on_disk)
                unchosen_off_gpu += expert_homes.off_gpu - len(off_gpu)
        assert unchosen_off_gpu > 0, "every step chose every expert: nothing was tested"
        llm.runner.experts.dense = True
        steps = _steps(llm, monkeypatch, PROMPTS)
        for index, expert_homes in homes.items():
            for _, spans, tiers in steps:
                moved = [e for e, _ in _moved(spans, expert_homes.key, "h2d")]
                off_gpu = [e for e in range(16) if tiers[index][e] is not Tier.GPU]
                assert moved == off_gpu * 3  # 5 prompts: 3 micro-batches


def test_the_most_used_experts_move_to_the_gpu(tiny_checkpoints, tmp_path):
    """Placement by routing: after the first prefill the experts that took the most
    rows trade places with the GPU's least used (the job's tokens unchanged), and a
    rebalance leaves every layer's GPU experts at least as used as its pinned ones."""
    directory, _ = tiny_checkpoints["qwen3-moe"]
    want = _plain(directory)
    with LLM(str(directory), device="cpu", dtype="float32", policy=SPLIT, nvme=tmp_path) as llm:
        fetcher = llm.runner.experts
        assert _tokens(llm) == want
        assert fetcher.swaps > 0
        fetcher.rebalance(now=True)
        assert _tokens(llm) == want
        fetcher.rebalance(now=True)
        for index, homes in fetcher.homes.items():
            usage = fetcher.usage[index]
            tiers = {t: [usage[e] for e in range(16) if homes.tier(e) is t] for t in Tier}
            assert min(tiers[Tier.GPU]) >= max(tiers[Tier.CPU]), (index, tiers)


# -- experts computed on the CPU ------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("compression", [None, INT4, Compression(8, 64, True)], ids=str)
def test_the_cpu_expert_matches_its_reference(dtype, compression):
    """`cpu_expert_mlp` against the float32 reference over the same weights: compressed
    (dequantized to float32 a slice at a time) within float32 rounding; full precision
    within twice the error of the same MLP in torch at that dtype."""
    from offload.kernels.cpu_expert import cpu_expert_mlp, expert_mlp_reference
    from offload.kernels.quant import quantize

    hidden, inter, rows = 256, 320, 5
    mlp_in = (torch.randn(2 * inter, hidden) / hidden**0.5).to(dtype)
    mlp_out = (torch.randn(hidden, inter) / inter**0.5).to(dtype)
    x = torch.randn(rows, hidden).to(dtype)
    if compression is not None:
        mlp_in, mlp_out = quantize(mlp_in, compression), quantize(mlp_out, compression)
    want = expert_mlp_reference(x, mlp_in, mlp_out).float()
    got = cpu_expert_mlp(x, mlp_in, mlp_out).float()
    if compression is not None or dtype == torch.float32:
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max())
        return
    torch_err = (moe.expert_mlp(x, mlp_in, mlp_out).float() - want).abs().max()
    assert (got - want).abs().max() <= 2 * torch_err + 1e-6


@pytest.mark.parametrize("compression", [None, INT4], ids=["fp32", "int4-g32"])
def test_experts_on_the_cpu_give_the_logits_of_experts_on_the_gpu(
    compression, tiny_checkpoints, tmp_path
):
    """At decode, every chosen expert in pinned memory computed on the CPU beside its
    weights (only its rows crossing) gives the logits of the same experts copied to the
    GPU, within 1e-5 of their size: the CPU's float32 arithmetic and its output added
    after the others'. Those experts' weights do not cross (the prefill's still do)."""
    directory, _ = tiny_checkpoints["mixtral"]
    policy = dataclasses.replace(SPLIT, weight_compression=compression)
    logits, traffic = {}, {}
    for share in (0.0, 1.0):
        with LLM(
            str(directory),
            device="cpu",
            dtype="float32",
            policy=dataclasses.replace(policy, cpu_experts=share),
            nvme=tmp_path,
        ) as llm:
            logits[share] = tiny_models.decode_logits(llm, PROMPTS, steps=3)
            traffic[share] = llm.runner.experts.step_traffic()
    scale = logits[0.0].abs().max()
    assert (logits[1.0] - logits[0.0]).abs().max() <= 1e-5 * scale
    on_cpu = sum(t.on_cpu for t in traffic[1.0].values())
    copied = {share: sum(t.from_cpu for t in traffic[share].values()) for share in traffic}
    assert on_cpu > 0 and copied[1.0] + on_cpu == copied[0.0]  # (the prefill copies all)


def test_the_job_report_accounts_for_every_chosen_expert(tiny_checkpoints, tmp_path):
    """`expert_report` (the stats' "experts"): each layer's experts by tier, and over
    the job every chosen expert used on the GPU, copied from pinned memory or read from
    disk, the bytes those moved."""
    directory, _ = tiny_checkpoints["qwen2-moe"]
    with LLM(str(directory), device="cpu", dtype="float32", policy=SPLIT, nvme=tmp_path) as llm:
        llm.generate(PROMPTS, PARAMS)
        report = llm.runner.expert_report()
    assert len(report["layers"]) == 3 and report["total"]["chosen"] > 0
    for layer in report["layers"]:
        assert layer["gpu"] + layer["cpu"] + layer["disk"] == 8
        moved = layer["from_cpu"] + layer["from_disk"]
        assert layer["resident"] + layer["on_cpu"] + moved == layer["chosen"]
        assert layer["h2d_bytes"] == moved * report["expert_bytes"]
        assert layer["disk_bytes"] == layer["from_disk"] * report["expert_bytes"]


# -- the cost model's expert terms ----------------------------------------------------------
def _profile(**figures) -> HardwareProfile:
    from tests.test_policies import PROFILE

    return dataclasses.replace(PROFILE, **figures)


def test_the_expected_experts_touched_match_sampled_routing():
    """1 - (1 - k/E)^T of the E experts, against routing drawn uniformly (k distinct
    experts a token): Qwen3-235B's 8 of 128 and Mixtral's 2 of 8, 1 to 256 tokens."""
    from offload.policies.cost_moe import ExpertLayers, touched

    gen = torch.Generator().manual_seed(0)
    for experts, k in ((128, 8), (8, 2)):
        layers = ExpertLayers(1, experts, k, 1.0, 1, 0.0, float(experts), 0.0)
        for tokens in (1, 4, 32, 256):
            drawn = [
                len(
                    {
                        e
                        for _ in range(tokens)
                        for e in torch.randperm(experts, generator=gen)[:k].tolist()
                    }
                )
                for _ in range(200)
            ]
            want = touched(layers, tokens)[1]
            assert sum(drawn) / len(drawn) == pytest.approx(want, rel=0.03, abs=0.05)


def test_the_plan_computes_experts_on_the_cpu_where_that_beats_copying():
    """Without a measured CPU expert rate no expert is computed on the CPU; with one as
    fast as the copies (beside the CPU's own DRAM reads too), half the experts in pinned
    memory are, and the expert phase takes about half the time."""
    from offload.policies.cost_moe import cpu_share, expert_layers, expert_phase

    cfg = cfg_of("mixtral-8x7b")
    x = expert_layers(cfg, torch.float16, None, Placement(0.0, 1.0, 0.0))
    assert x is not None and (x.gpu, x.cpu, x.disk) == (0, 8, 0)
    assert cpu_share(x, _profile(), None, 64) == 0.0
    hw = _profile(cpu_expert_gbps={"dense": 25.0}, h2d_under_cpu_attention_gbps=25.0)
    share = cpu_share(x, hw, None, 64)
    assert share == 0.5
    copied = expert_phase(x, hw, None, 64).seconds
    assert expert_phase(x, hw, None, 64, cpu_share=share).seconds < 0.6 * copied


def test_the_dense_schedule_moves_every_expert_for_every_micro_batch():
    """The cost model's dense schedule: each micro-batch copies every expert off the
    GPU, so a decode step of 8 micro-batches moves 8 x a layer's; the module schedule
    moves each chosen one once."""
    cfg = cfg_of("mixtral-8x7b")
    policy = Policy(32, 8, weights=Placement(0.2, 0.8, 0.0), kv_cache=Placement(0.0, 1.0, 0.0))
    module = estimate(cfg, policy, torch.float16, 512, 32, _profile())
    dense = estimate(cfg, policy, torch.float16, 512, 32, _profile(), dense_experts=True)
    off_gpu = module.experts["cpu"] + module.experts["disk"]
    assert module.experts["decode_moved"] == pytest.approx(off_gpu, rel=1e-6)  # all chosen
    assert dense.experts["decode_moved"] == pytest.approx(8 * off_gpu)
    assert dense.decode_step_s > 5 * module.decode_step_s


def test_offload_plan_speaks_of_experts(tmp_path, capsys):
    """offload-plan's table and JSON give a mixture of experts' placement a layer and a
    decode step's expert traffic."""
    from offload.cli.plan import main as plan_main

    profile = tmp_path / "hw.json"
    profile.write_text(_profile().to_json())
    args = ["--model", "mixtral-8x7b", "--gpu-mem", "24GB", "--cpu-mem", "100GB"]
    assert plan_main([*args, "--profile", str(profile)]) == 0
    text = capsys.readouterr().out
    assert "experts: 32 layers x 8, 352 MB each" in text and "experts a decode step" in text
    assert plan_main([*args, "--profile", str(profile), "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)["experts"]
    assert facts["layers"] == 32 and facts["gpu"] + facts["cpu"] + facts["disk"] == 8


def test_a_prefills_expert_phase_counts_its_routed_rows_passes():
    """Beside the matmuls, the expert phase counts the executor's passes over each routed
    row (`cost_moe.ROUTED_ROW_PASSES` rows of the hidden width, at the HBM rate): for
    Mixtral-8x7B's prefill of 480 x 512 tokens, 491,520 routed rows a layer, about 60 GB,
    which halving the HBM rate adds again (and a decode step's 960 rows barely)."""
    from offload.policies.cost_moe import ROUTED_ROW_PASSES, expert_layers, expert_phase

    cfg = cfg_of("mixtral-8x7b")
    x = expert_layers(cfg, torch.float16, None, Placement(0.0, 1.0, 0.0))
    assert x.row_bytes == ROUTED_ROW_PASSES * 4096 * 2
    tokens = 480 * 512
    moved = tokens * 2 * x.row_bytes
    assert moved == pytest.approx(60.4e9, rel=0.01)
    fast, slow = _profile(hbm_gbps=2000.0), _profile(hbm_gbps=1000.0)
    prefill = [expert_phase(x, hw, None, tokens, prefill=True).compute for hw in (fast, slow)]
    assert prefill[1] - prefill[0] == pytest.approx(moved / 2000e9, rel=1e-6)
    decode = [expert_phase(x, hw, None, 480).compute for hw in (fast, slow)]
    assert decode[1] - decode[0] == pytest.approx(480 * 2 * x.row_bytes / 2000e9, rel=1e-6)
