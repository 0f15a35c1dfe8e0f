"""Cost model, search and offload-plan (CPU)."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch

from offload.api.llm import LLM
from offload.cli.plan import main as plan_main
from offload.cli.run import main as run_main
from offload.core.config import ModelConfig
from offload.core.errors import UserError
from offload.core.presets import PRESETS
from offload.io.tiers import Tier
from offload.kernels.formats import Compression
from offload.policies.caps import Baseline, Caps, gpu_phase_peaks, peak_bytes
from offload.policies.cost import estimate
from offload.policies.hardware import HardwareProfile
from offload.policies.memory import plan_memory
from offload.policies.policy import Placement, Policy
from offload.policies.search import search

GB = 10**9

# A machine description for the tests (the H100 machine's measured shape, halved PCIe).
PROFILE = HardwareProfile(
    device_name="test machine",
    has_gpu=True,
    gpu_mem_bytes=80 * GB,
    cpu_mem_bytes=128 * GB,
    h2d_gbps=25.0,
    d2h_gbps=25.0,
    bidir_gbps=40.0,
    pageable_h2d_gbps=8.0,
    disk_read_gbps=1.5,
    disk_write_gbps=1.0,
    prefill_tflops=300.0,
    decode_tflops=100.0,
    hbm_gbps=2000.0,
    cpu_attention_gbps=40.0,
    cpu_quant_attention_gbps=10.0,
    dram_gbps=90.0,
    gpu_context_bytes=500_000_000,
    process_base_bytes=2 * GB,
)


def cfg_of(name: str) -> ModelConfig:
    return ModelConfig.from_hf(PRESETS[name], name)


def test_no_fit_names_the_smallest_fit_and_what_int4_would_need():
    """When nothing fits, the message gives the smallest plan's peaks in the formats
    allowed and, where int4 weights and KV would need less, that need and its flags."""
    cfg, caps, int4 = cfg_of("bloom"), Caps(24 * GB, 22 * GB, True), Compression(4, 64)
    with pytest.raises(UserError, match="smallest fit needs") as dense:
        search(cfg, torch.float16, 512, 32, PROFILE, caps)
    assert "; with --compress int4 --kv-compress int4 it needs" in str(dense.value)
    with pytest.raises(UserError, match="smallest fit needs") as small:
        search(cfg, torch.float16, 512, 32, PROFILE, caps, compressions=(int4,), kv_compressions=(int4,))  # fmt: skip
    assert "--compress int4" not in str(small.value)
    assert str(dense.value).endswith(str(small.value).split("needs ")[-1])
    # a model so small that int4's buffers outweigh what it saves: a hint that needs more
    # memory is none (its smallest plan: 0.7 GB GPU and 3.5 GB CPU; int4's 1.4 and 4.0)
    with pytest.raises(UserError, match="smallest fit needs") as tiny:
        search(cfg_of("smollm2-135m-instruct"), torch.float16, 512, 32, PROFILE, Caps(GB // 2, 3 * GB, False))  # fmt: skip
    assert "--compress int4" not in str(tiny.value)


@pytest.mark.parametrize("name", ["opt-30b", "llama-2-13b", "llama-3.1-8b"])
@pytest.mark.parametrize(
    "gpu_gb, cpu_gb, nvme", [(24, 100, False), (12, 64, True), (40, 200, False)]
)
def test_search_never_exceeds_a_cap(name, gpu_gb, cpu_gb, nvme):
    caps = Caps(gpu_gb * GB, cpu_gb * GB, nvme)
    try:
        best = search(cfg_of(name), torch.float16, 512, 32, PROFILE, caps)
    except UserError as exc:
        assert "smallest fit needs" in str(exc)
        return
    assert best.gpu_peak_bytes <= caps.gpu_bytes and best.cpu_peak_bytes <= caps.cpu_bytes
    if not nvme:
        assert best.policy.weights.disk == 0 and best.policy.kv_cache.disk == 0


def test_more_bandwidth_or_memory_never_predicts_less():
    cfg = cfg_of("opt-30b")
    caps = Caps(24 * GB, 100 * GB, False)
    base = search(cfg, torch.float16, 512, 32, PROFILE, caps).total_tok_s
    faster = dataclasses.replace(PROFILE, h2d_gbps=50.0, cpu_attention_gbps=80.0)
    assert search(cfg, torch.float16, 512, 32, faster, caps).total_tok_s >= base
    for more in (Caps(32 * GB, 100 * GB, False), Caps(24 * GB, 120 * GB, False)):
        assert search(cfg, torch.float16, 512, 32, PROFILE, more).total_tok_s >= base * 0.999
    # and for a fixed policy, every faster lane gives a faster estimate
    policy = Policy(
        16, 4, weights=Placement(0.25, 0.75, 0), kv_cache=Placement(0, 1, 0), attention_on_cpu=True
    )
    slow = estimate(cfg, policy, torch.float16, 512, 32, PROFILE).total_tok_s
    for field in ("h2d_gbps", "cpu_attention_gbps", "decode_tflops", "prefill_tflops"):
        quick = dataclasses.replace(PROFILE, **{field: getattr(PROFILE, field) * 2})
        assert estimate(cfg, policy, torch.float16, 512, 32, quick).total_tok_s >= slow, field


@pytest.mark.parametrize(
    "policy",
    [
        Policy(2, 3, weights=Placement(0.3, 0.4, 0.3), kv_cache=Placement(0.5, 0.25, 0.25)),
        Policy(
            2,
            3,
            weights=Placement(0.3, 0.4, 0.3),
            kv_cache=Placement(0.5, 0.25, 0.25),
            kv_compression=Compression(4, 16),
        ),
    ],
    ids=["kv-3-ways", "int4-kv-3-ways"],
)
def test_predicted_memory_matches_what_the_executor_allocates(policy, tiny_checkpoints, tmp_path):
    directory, _ = tiny_checkpoints["opt"]
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [1, 2, 3, 4], [3, 3], [4, 4, 4]]
    with LLM(str(directory), device="cpu", dtype="float32", policy=policy, nvme=tmp_path) as llm:
        plan = plan_memory(llm.config, policy, torch.float32, prompt_len=4, max_new_tokens=5)
        from offload.models.batch import PaddedBatch

        llm.runner.start(PaddedBatch(llm.config, prompts, 5, 0))
        ledger = llm.runner.ledger
        d = plan.detail
        assert (
            ledger.used(Tier.GPU)
            == d["weights_gpu"] + d["weight_slots_gpu"] + d["kv_gpu"] + d["kv_scratch_gpu"]
        )
        assert ledger.used(Tier.DISK) == d["weights_disk"] + d["kv_disk"]
        weights_cpu = d["weights_cpu"] + d["weight_staging_cpu"]
        assert llm.runner.weights.pool.stats()["reserved_bytes"] == weights_cpu
        kv_cpu = ledger.used(Tier.CPU) - d["weights_cpu"]  # the KV manager's pinned blocks
        assert kv_cpu == d["kv_cpu"] + d["kv_staging_cpu"] + d["act_cpu"]


def test_a_compressed_prefill_dequantizes_whole_matrices_where_the_layer_s_largest_fits():
    """OPT-30B's largest matrix (7168 x 28672, 392 MiB in fp16) is dequantized whole, so
    every prefill matmul is one cuBLAS call; BLOOM's (1.5 GiB) in 128 MiB slices. The
    memory plan holds the same scratch beside a prefill layer's working set."""
    from offload.kernels import qmatmul
    from offload.models.decoder import dense_scratch_bytes

    opt, bloom = (ModelConfig.from_hf(PRESETS[name], name) for name in ("opt-30b", "bloom"))
    assert dense_scratch_bytes(opt, 2) == 7168 * 28672 * 2
    assert dense_scratch_bytes(bloom, 2) == qmatmul.DENSE_SLICE_BYTES
    int4 = Compression(4, 64)
    # 4 x 512 rows: the dense path (DENSE_ROWS), the MLP in one slice either way
    plain = Policy(4, 1, weights=Placement(1, 0, 0), kv_cache=Placement(1, 0, 0))
    packed = dataclasses.replace(plain, weight_compression=int4)
    for cfg in (opt, bloom):
        transient = [
            plan_memory(cfg, p, torch.float16, 512, 32).detail["transient_gpu"]
            for p in (plain, packed)
        ]
        assert transient[1] - transient[0] == dense_scratch_bytes(cfg, 2)


def test_a_compressed_mlp_takes_up_to_mlp_whole_rows_at_once_and_the_plan_counts_it():
    """A compressed layer's prefill dequantizes the MLP's weights every call, so its rows
    go in one slice up to MLP_WHOLE_ROWS; an uncompressed one's in MLP_CHUNK_ROWS slices.
    The plan's MLP working set follows: for OPT-30B at 14 x 512 rows (ReLU in the
    epilogue) the projection, norm, intermediate and output, 7168 x (3 x 7168 + 28672)
    elements, against 2 x 7168 x 7168 + 4096 x (2 x 7168 + 28672) in slices (and
    there the attention's half is the larger)."""
    from offload.models.decoder import MLP_CHUNK_ROWS, MLP_WHOLE_ROWS, mlp_chunks
    from offload.policies.memory import _layer_transient

    assert mlp_chunks(7168, compressed=True) == [7168]
    assert mlp_chunks(7168, compressed=False) == [MLP_CHUNK_ROWS, 7168 - MLP_CHUNK_ROWS]
    assert mlp_chunks(MLP_WHOLE_ROWS + 1, True) == [4096, 4096, 1]
    assert mlp_chunks(100, False) == [100]
    opt = ModelConfig.from_hf(PRESETS["opt-30b"], "opt-30b")
    h, i = 7168, 28672
    assert _layer_transient(opt, 7168, compressed=True) == 7168 * (3 * h + i)
    sliced = 2 * 7168 * h + 4096 * (2 * h + i)
    attention = 7168 * (3 * h + 3 * h)  # the fused QKV, norm, SDPA's output and its reshape
    assert _layer_transient(opt, 7168, compressed=False) == max(sliced, attention)


def test_plan_json_round_trips_into_offload_run(tiny_checkpoints, tmp_path, capsys):
    directory, _ = tiny_checkpoints["llama-gqa"]
    profile = tmp_path / "hw.json"
    profile.write_text(
        dataclasses.replace(
            PROFILE, has_gpu=False, gpu_context_bytes=0, process_base_bytes=0
        ).to_json()
    )
    args = [
        "--model",
        str(directory),
        "--gpu-mem",
        "2MB",
        "--cpu-mem",
        "3GB",
        "--profile",
        str(profile),
        "--prompt-len",
        "8",
        "--gen-len",
        "4",
        "--json",
    ]
    assert plan_main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"policy", "predicted", "memory"}
    assert set(out["predicted"]) >= {"total_tok_s", "prefill_s", "decode_s", "bottleneck"}
    assert set(out["memory"]) >= {"gpu_bytes", "cpu_bytes", "disk_bytes"}
    assert out["memory"]["gpu_bytes"] <= 2_000_000
    policy_file = tmp_path / "policy.json"
    policy_file.write_text(json.dumps(out))  # the plan as printed: its "policy" is read
    result = tmp_path / "out.jsonl"
    assert (
        run_main(
            [
                "--model",
                str(directory),
                "--policy",
                str(policy_file),
                "--prompt",
                "hello",
                "--output",
                str(result),
                "--max-new-tokens",
                "4",
                "--device",
                "cpu",
                "--quiet",
            ]
        )
        == 0
    )
    assert json.loads(result.read_text())["completion_tokens"] == 4


@pytest.mark.parametrize(
    "args, words",
    [
        (["--gpu-mem", "abc"], "cannot parse size 'abc'"),
        (["--gpu-mem=-5GB"], "cannot parse size"),
        (["--gpu-mem", "200GB"], "more than the GPU has (80.00 GB)"),
        (
            ["--gpu-mem", "24GB", "--prompt-len", "2000", "--gen-len", "100"],
            "exceed the model's context of 2048",
        ),
        (["--gpu-mem", "1MB", "--cpu-mem", "1GB"], "smallest fit needs"),
    ],
)
def test_plan_bad_input(args, words, tmp_path, capsys):
    profile = tmp_path / "hw.json"
    profile.write_text(PROFILE.to_json())
    assert plan_main(["--model", "opt-30b", "--profile", str(profile), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert words in err and "Traceback" not in err


def test_plan_prints_a_readable_table(tmp_path, capsys, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**13, 0, 10**13))
    profile = tmp_path / "hw.json"
    profile.write_text(PROFILE.to_json())
    assert (
        plan_main(
            [
                "--model",
                "bigscience/bloom",
                "--gpu-mem",
                "24GB",
                "--cpu-mem",
                "100GB",
                "--nvme",
                str(tmp_path),
                "--profile",
                str(profile),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    for words in (
        "weights",
        "KV cache",
        "activations",
        "bottleneck:",
        "predicted:",
        "peak memory:",
        "what would help",
    ):
        assert words in text


def test_plan_tells_the_weight_store_and_the_free_space(tmp_path, capsys, monkeypatch):
    """The store holds only the weights on disk: the plan's disk share of the weights,
    not the whole model; a disk short of it is a one-line problem."""
    import shutil
    from collections import namedtuple

    profile = tmp_path / "hw.json"
    profile.write_text(PROFILE.to_json())
    args = ["--model", "bigscience/bloom", "--gpu-mem", "24GB", "--cpu-mem", "100GB"]
    args += ["--nvme", str(tmp_path), "--profile", str(profile)]
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**13, 0, 10**13))
    assert plan_main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    store, disk = out["weight_store"], out["memory"]["detail"]["weights_disk"]
    assert store["bytes"] == store["write_bytes"] == disk > 0 and store["problem"] is None
    assert store["free_bytes"] == 10**13 and store["nvme"] == str(tmp_path)
    assert disk < cfg_of("bloom").param_count() * 2, "the whole model counted"
    assert plan_main(args) == 0
    text = capsys.readouterr()
    assert f"weight store: {disk / GB:.1f} GB on {tmp_path} ({10**13 / GB:.1f} GB free)" in text.out
    # a disk short of the store: refused in one line, as offload-run refuses it
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**13, 0, 6 * GB))
    assert plan_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "GB free; the weight store needs" in err


def test_plan_counts_decode_graph_buffers_only_where_graphs_run():
    """All weights and activations on the GPU: the decode graphs' buffers (each layer's
    qkv twice and residual, the logits, per micro-batch) are in the GPU plan; a policy
    that streams weights has none."""
    cfg = ModelConfig.from_hf(PRESETS["opt-30b"], "opt-30b")
    on = Policy(4, 2)
    off = Policy(4, 2, weights=Placement(0.5, 0.5, 0))
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    floor = 2 * 8 * (cfg.num_layers * (2 * qkv + cfg.hidden_size) + 2 * cfg.vocab_size)
    assert on.decode_graphs and not off.decode_graphs
    assert plan_memory(cfg, on, torch.float16, 64, 8).detail["decode_graphs_gpu"] >= floor
    assert plan_memory(cfg, off, torch.float16, 64, 8).detail["decode_graphs_gpu"] == 0


def test_the_gpu_peak_is_the_larger_of_the_load_and_the_run_phases():
    """`peak_bytes` is the larger phase of `gpu_phase_peaks`: int4 weights quantized on the
    GPU as they load make the load phase the larger for a plan whose KV lives off the
    GPU (the run has no room for their transients), while KV on the GPU makes the run
    the larger; each phase holds the weights, only the run its KV and activations."""
    cfg = cfg_of("llama-3.1-8b")
    base = Baseline(gpu_context_bytes=800 << 20, process_bytes=1 << 30)
    int4 = Compression(4, 64)
    w4 = {"weight_compression": int4, "kv_compression": int4}
    off_gpu = Policy(8, 2, kv_cache=Placement(0, 0.875, 0.125), **w4)
    on_gpu = Policy(48, 1, **w4)
    peaks = {}
    for name, policy in (("off", off_gpu), ("on", on_gpu)):
        plan = plan_memory(cfg, policy, torch.float16, 512, 32)
        load, run = gpu_phase_peaks(plan, base)
        assert peak_bytes(plan, base)[0] == max(load, run)
        assert plan.load_bytes("gpu") == plan.detail["weights_gpu"] + max(
            plan.detail["load_stage_gpu"], plan.detail["weight_slots_gpu"]
        )
        assert plan.run_bytes("gpu") >= plan.detail["weights_gpu"] + plan.detail["kv_gpu"]
        peaks[name] = (load, run)
    assert peaks["off"][0] > peaks["off"][1]
    assert peaks["on"][1] > peaks["on"][0]
    assert peaks["off"][0] == peaks["on"][0]  # the same weights load the same way


def test_a_stage_stored_uncompressed_loads_without_a_quantizer():
    """Under weight compression the embedding table is stored as the source gives it, so
    placing it holds the table once: the load's largest transient is then the head's
    (its fp16 source, its int4 copy and the quantizer's working set). Llama-3.1-8B int4,
    H100 c115: the load phase measured 7.94-8.05 GB where the plan counted the 1.05 GB
    table twice and a quantizer beside it (9.17 GB); now 8.42."""
    from offload.io.layout import stage_image_bytes, stage_keys
    from offload.kernels.quant import QUANT_WORK_BYTES

    cfg = cfg_of("llama-3.1-8b")
    int4 = Compression(4, 64)
    stored = dict(zip(stage_keys(cfg), stage_image_bytes(cfg, torch.float16, int4), strict=True))
    full = dict(zip(stage_keys(cfg), stage_image_bytes(cfg, torch.float16), strict=True))
    assert stored["embed"] == full["embed"] > full["head"] / 2 > stored["head"]
    plan = plan_memory(cfg, Policy(28, 1, weight_compression=int4), torch.float16, 512, 32)
    assert plan.detail["load_stage_gpu"] == full["head"] + stored["head"] + QUANT_WORK_BYTES
    assert plan.detail["load_stage_cpu"] == full["head"] + 2 * stored["head"] + QUANT_WORK_BYTES
    fp16 = plan_memory(cfg, Policy(28, 1), torch.float16, 512, 32)
    assert fp16.detail["load_stage_gpu"] == max(full.values())


def test_the_load_phase_holds_the_weight_ring_slots_where_they_outgrow_the_stage():
    """The fetcher's ring slots are allocated as the load ends, after the stage being
    placed is freed: a streamed plan's load phase holds the larger of the two (Llama-3.1-8B
    with 75% of its weights on the CPU: its 1.05 GB head stage and 2 x 1.05 GB slots;
    measured 6.70 GB at the load's end against 5.73 planned without them, H200 c109)."""
    cfg = cfg_of("llama-3.1-8b")
    streamed = Policy(16, 4, weights=Placement(0.25, 0.75, 0), kv_cache=Placement(0, 1, 0))
    plan = plan_memory(cfg, streamed, torch.float16, 512, 32)
    d = plan.detail
    assert d["weight_slots_gpu"] > d["load_stage_gpu"] > 0
    assert plan.load_bytes("gpu") == d["weights_gpu"] + d["weight_slots_gpu"]
    assert plan.load_bytes("gpu") <= plan.run_bytes("gpu")  # the run holds the slots too
    resident = plan_memory(cfg, Policy(8, 1), torch.float16, 512, 32).detail
    assert resident["weight_slots_gpu"] == resident["load_slots_gpu"] == 0


@pytest.mark.parametrize("kv_compression", [None, Compression(4, 64)], ids=["fp16", "int4"])
def test_kv_goes_wholly_on_the_gpu_when_it_fits_there_without_a_scratch(kv_compression):
    """Rows off the GPU need a scratch on it; a cache that fits on the GPU only without
    that scratch is placed there whole (it was split once, measured 142 against 214
    tok/s), and one a byte too large is split."""
    from offload.policies.caps import GPU_SLACK, GPU_WORKSPACE_BYTES
    from offload.policies.search import _kv_placement

    cfg = cfg_of("llama-3.1-8b")
    base = Policy(8, 1, kv_compression=kv_compression)
    on_gpu = plan_memory(cfg, base, torch.float16, 512, 32)
    scratch = plan_memory(
        cfg, dataclasses.replace(base, kv_cache=Placement(0, 1, 0)), torch.float16, 512, 32
    ).detail["kv_scratch_gpu"]
    assert scratch > 0
    for extra, whole in ((scratch // 2, True), (-on_gpu.detail["kv_gpu"] // 10, False)):
        fixed = PROFILE.gpu_context_bytes + GPU_WORKSPACE_BYTES
        gpu_cap = (on_gpu.run_bytes("gpu") + extra) * (1 + GPU_SLACK) + fixed
        caps = Caps(int(gpu_cap), 100 * GB, False)
        placement = _kv_placement(cfg, base, torch.float16, 512, 32, PROFILE, caps)
        assert (placement == Placement(1.0, 0.0, 0.0)) == whole, (extra, placement)


def test_a_searched_plan_is_never_refused_by_the_engine(monkeypatch):
    """The property behind the caps' promise: over random models, caps and formats, the
    policy the search returns passes the engine's own checks before load (weights, then
    the planned block), with the same baseline the search planned with."""
    import random

    from offload.policies import caps as caps_module
    from offload.policies.caps import Baseline, check_block_fits, check_weights_fit

    # the machine's own size is not what is tested: the caps are the limits
    monkeypatch.setattr(caps_module, "device_limits", lambda device: (10**15, 10**15))
    rng = random.Random(0)
    int4 = Compression(4, 64)
    base = Baseline.from_profile(PROFILE)
    device = torch.device("cpu")
    searched = 0
    for _ in range(6):
        cfg = cfg_of(rng.choice(["opt-30b", "llama-2-13b", "llama-3.1-70b", "bloom"]))
        caps = Caps(rng.randint(12, 48) * GB, rng.randint(64, 240) * GB, rng.random() < 0.5)
        prompt_len, gen_len = rng.choice([(128, 32), (512, 32), (512, 256)])
        try:
            best = search(
                cfg, torch.float16, prompt_len, gen_len, PROFILE, caps,
                compressions=(None, int4), kv_compressions=(None, int4),
            )  # fmt: skip
        except UserError:  # nothing fits these caps: nothing is promised
            continue
        searched += 1
        check_weights_fit(cfg, best.policy, torch.float16, device, caps, base)
        check_block_fits(
            cfg, best.policy, torch.float16, device, caps, base, prompt_len, gen_len
        )  # fmt: skip
    assert searched >= 3, f"only {searched} of 6 random cases had a plan to check"


LOAD_PEAK_CHILD = """
import dataclasses, json, sys
import torch
from offload.core.config import ModelConfig
from offload.executor.executor import Executor
from offload.models.weights import DummySource
from offload.policies.memory import plan_memory
from offload.policies.policy import Placement, Policy
from offload.core.presets import PRESETS

def rss(field):
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) * 1024 for l in status if l.startswith(field))

cfg = dataclasses.replace(ModelConfig.from_hf(PRESETS["opt-6.7b"], "opt-6.7b"), num_layers=2)
policy = Policy(1, 1, weights=Placement(0, 1, 0), kv_cache=Placement(0, 1, 0))
plan = plan_memory(cfg, policy, torch.float32, 8, 8)
before = rss("VmRSS:")
ex = Executor(DummySource(cfg), policy, torch.float32, torch.device("cpu"))
print(json.dumps({"grew": rss("VmHWM:") - before, "plan": plan.detail}))
ex.close()
"""


def test_the_load_phase_host_peak_is_planned():
    """While the weights load, one stage's source tensors and its host image sit beside
    the pool (`memory._load_transients`): a 2-layer OPT-6.7B (an 805 MB fp32 layer, an
    824 MB table) on the CPU grows the process by the pool and at most that, and by more
    than the pool alone (the transient is real, not a margin: measured 0.85 GB over the
    pool; a plain CPU pool is touched as it fills, so the last layer's transient meets
    the pool less its head)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", LOAD_PEAK_CHILD], capture_output=True, text=True, check=True
    ).stdout
    measured = json.loads(out.splitlines()[-1])
    detail = measured["plan"]
    pool = detail["weights_cpu"] + detail["weight_staging_cpu"]
    grew = measured["grew"]
    assert pool + detail["load_stage_cpu"] // 4 < grew <= pool + detail["load_stage_cpu"], (
        f"the load grew the process {grew / 1e9:.2f} GB; the plan: pool {pool / 1e9:.2f} GB "
        f"+ transient {detail['load_stage_cpu'] / 1e9:.2f} GB"
    )


def test_kv_goes_to_disk_only_where_the_cpu_has_no_room():
    """The CPU's share is counted from the GPU's whole rows: a block whose GPU share is
    rounded down puts the rounding's row in CPU memory when the CPU has room for it, not
    on disk (where the host would read it in every layer)."""
    from offload.parallel.shard import rank_config
    from offload.policies.search import _kv_placement

    cfg = rank_config(cfg_of("llama-2-13b"), 2, 0)
    checked = tight_checked = 0
    for rows, gpu_gb in itertools.product((80, 160), range(6, 16)):
        base = Policy(rows, 1, weights=Placement(0.5, 0.5, 0.0), attention_on_cpu=True)
        with_room = _kv_placement(cfg, base, torch.float16, 400, 32, PROFILE, Caps(gpu_gb * GB, 135 * GB, True))  # fmt: skip
        if with_room is None or with_room.gpu == 1.0:
            continue
        checked += 1
        assert with_room.disk == 0.0, (rows, gpu_gb, with_room)
        assert with_room.split(rows)[0] == round(with_room.gpu * rows)  # whole rows
        # a CPU too small for the rest: the rows it cannot hold go to disk, whole
        tight = _kv_placement(cfg, base, torch.float16, 400, 32, PROFILE, Caps(gpu_gb * GB, 16 * GB, True))  # fmt: skip
        if tight is not None:
            tight_checked += 1
            _, cpu_rows, disk_rows = tight.split(rows)
            assert disk_rows > 0 and abs(tight.cpu * rows - cpu_rows) < 1e-6, tight
    assert checked >= 4 and tight_checked >= 2, (checked, tight_checked)
