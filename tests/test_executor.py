"""The offloading executor: every policy gives the plain single-device run's tokens.

On a machine without CUDA the compute device's memory stands in for the GPU tier, the
pinned pool is plain host memory and a temporary directory is the disk.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re

import pytest
import torch

from offload.api.llm import LLM
from offload.core.errors import UserError
from offload.core.sampling import SamplingParams
from offload.executor.runner import PlainRunner
from offload.io.layout import store_bytes
from offload.io.reader import CorruptExtent
from offload.io.store_format import store_dir
from offload.kernels.formats import Compression
from offload.models.resolve import resolve_model
from offload.policies.caps import Caps
from offload.policies.policy import Placement, Policy
from tests.tiny_models import decode_logits, prefill_logits

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11],
    [20, 21, 22],
    [30, 31, 32, 33, 34],
    [7, 8],
    [100, 101, 102, 103],
    [1, 2, 3],
    [9] * 9,
]
PARAMS = SamplingParams(max_new_tokens=8)
W3 = Placement(0.3, 0.4, 0.3)

POLICIES = {
    "all-on-device": Policy(gpu_batch_size=2, num_gpu_batches=4),
    "weights-3-ways": Policy(gpu_batch_size=2, num_gpu_batches=4, weights=W3),
    "kv-cpu-cpu-attention": Policy(
        gpu_batch_size=2, num_gpu_batches=4, kv_cache=Placement(0, 1, 0), attention_on_cpu=True
    ),
    "kv-cpu-device-attention": Policy(
        gpu_batch_size=2, num_gpu_batches=4, kv_cache=Placement(0, 1, 0)
    ),
    "kv-partly-disk": Policy(
        gpu_batch_size=2, num_gpu_batches=4, kv_cache=Placement(0.25, 0.25, 0.5)
    ),
    "kv-partly-disk-cpu-attention": Policy(
        gpu_batch_size=2,
        num_gpu_batches=4,
        kv_cache=Placement(0.25, 0.25, 0.5),
        attention_on_cpu=True,
    ),
    "activations-cpu": Policy(
        gpu_batch_size=2, num_gpu_batches=4, activations=Placement(0.5, 0.5, 0)
    ),
    "one-micro-batch": Policy(
        gpu_batch_size=8, num_gpu_batches=1, weights=W3, kv_cache=Placement(0.5, 0.5, 0)
    ),
    "serial-everything-split": Policy(
        gpu_batch_size=2,
        num_gpu_batches=4,
        weights=W3,
        kv_cache=Placement(0.25, 0.25, 0.5),
        activations=Placement(0.5, 0.5, 0),
        overlap=False,
    ),
    "overlap-everything-split": Policy(
        gpu_batch_size=2,
        num_gpu_batches=4,
        weights=W3,
        kv_cache=Placement(0.25, 0.25, 0.5),
        activations=Placement(0.5, 0.5, 0),
    ),
}
FAMILIES = ["llama-gqa", "qwen2-bias", "mistral-window", "bloom", "opt", "opt-350m-like"]


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    out = {}
    for case in FAMILIES:
        directory, _ = tiny_checkpoints[case]
        llm = LLM(str(directory), device="cpu", dtype="float32", batch_size=8)
        out[case] = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    return out


@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("case", FAMILIES)
def test_policy_gives_the_plain_tokens(case, policy_name, tiny_checkpoints, reference, tmp_path):
    directory, _ = tiny_checkpoints[case]
    with LLM(
        str(directory), device="cpu", dtype="float32", policy=POLICIES[policy_name], nvme=tmp_path
    ) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    assert got == reference[case], f"{case} under {policy_name} differs from the plain run"
    assert not list(tmp_path.glob("spill-*")), "spill file left behind"


@pytest.mark.parametrize("overlap", [True, False])
def test_the_cpu_attends_a_micro_batch_while_the_next_one_begins(
    tiny_checkpoints, tmp_path, monkeypatch, overlap
):
    """Attention on the CPU at decode: micro-batch k + 1's projections (and its query's
    copy out) are issued before the CPU attends k, so the GPU computes them meanwhile
    (`Executor._one_behind`); prefill, and GPU attention, keep one micro-batch at a time,
    and so does the serial reference schedule (overlap off). The tokens stay the plain
    run's (`test_policy_gives_the_plain_tokens`)."""
    from offload.executor.kv import KVManager
    from offload.models import decoder

    order: list[tuple[str, int]] = []
    attn_in, attend_on_cpu = decoder.attn_in, KVManager._attend_on_cpu
    monkeypatch.setattr(
        decoder, "attn_in", lambda cfg, w, x, step: order.append(("qkv", x.shape[1])) or attn_in(cfg, w, x, step)
    )  # fmt: skip

    def attending(self, blk, mb, *args):
        order.append(("cpu", mb))
        return attend_on_cpu(self, blk, mb, *args)

    monkeypatch.setattr(KVManager, "_attend_on_cpu", attending)
    directory, _ = tiny_checkpoints["llama-gqa"]
    # 4 micro-batches, every row on the CPU
    policy = dataclasses.replace(POLICIES["kv-cpu-cpu-attention"], overlap=overlap)
    with LLM(str(directory), device="cpu", dtype="float32", policy=policy, nvme=tmp_path) as llm:
        llm.generate(PROMPTS[:8], SamplingParams(max_new_tokens=2))
        layers = llm.runner.cfg.num_layers
    decode = order[order.index(("qkv", 1)) :]  # the one decode step's layers
    expected = ["qkv", "qkv", "cpu", "qkv", "cpu", "qkv"] if overlap else ["qkv", "cpu"] * 3
    assert [kind for kind, _ in decode[:6]] == expected
    assert [mb for kind, mb in decode if kind == "cpu"] == [0, 1, 2, 3] * layers
    assert all(width > 1 for kind, width in order[: order.index(("qkv", 1))] if kind == "qkv")


def test_five_reruns_are_identical(tiny_checkpoints, tmp_path):
    directory, _ = tiny_checkpoints["llama-gqa"]
    policy = POLICIES["overlap-everything-split"]
    with LLM(str(directory), device="cpu", dtype="float32", policy=policy, nvme=tmp_path) as llm:
        runs = [[o.token_ids for o in llm.generate(PROMPTS, PARAMS)] for _ in range(5)]
    assert all(run == runs[0] for run in runs)


def test_weight_split_is_exact_not_per_tensor(tiny_checkpoints, tmp_path):
    directory, _ = tiny_checkpoints["opt"]
    policy = Policy(gpu_batch_size=2, num_gpu_batches=1, weights=Placement(0.2, 0.5, 0.3))
    with LLM(str(directory), device="cpu", dtype="float32", policy=policy, nvme=tmp_path) as llm:
        for image in llm.runner.homes.images[1:-1]:  # the layers
            assert image.gpu_end / image.size == pytest.approx(0.2, abs=4096 / image.size)
            assert (image.cpu_end - image.gpu_end) / image.size == pytest.approx(
                0.5, abs=8192 / image.size
            )


def _run_from_store(directory, weights: Placement, nvme) -> tuple[list, int, int]:
    """A run with these weight fractions: its tokens, and the store's bytes on disk and
    manifest mtime."""
    policy = Policy(gpu_batch_size=2, num_gpu_batches=4, weights=weights)
    with LLM(str(directory), device="cpu", dtype="float32", policy=policy, nvme=nvme) as llm:
        tokens = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
        store = store_dir(nvme, llm.config, torch.float32)
    on_disk = sum(f.stat().st_size for f in store.glob("*.bin"))
    return tokens, on_disk, (store / "manifest.json").stat().st_mtime_ns


def test_disk_weights_stream_from_a_store_of_their_tails(tiny_checkpoints, reference, tmp_path):
    """The store holds only what the policy reads from disk and gives the plain tokens; a
    re-plan with less on disk reuses it, one with more rebuilds it."""
    directory, _ = tiny_checkpoints["opt"]
    cfg, f32, want = resolve_model(str(directory)).config, torch.float32, reference["opt"]
    tokens, on_disk, built = _run_from_store(directory, W3, tmp_path)
    assert tokens == want
    assert on_disk == store_bytes(cfg, f32, None, W3) < 0.4 * store_bytes(cfg, f32, None)
    tokens, reused, mtime = _run_from_store(directory, Placement(0.3, 0.5, 0.2), tmp_path)
    assert tokens == want and (reused, mtime) == (on_disk, built), "the store was rebuilt"
    more = Placement(0.2, 0.3, 0.5)
    tokens, on_disk, mtime = _run_from_store(directory, more, tmp_path)
    assert tokens == want and mtime != built, "a store with too little was reused"
    assert on_disk == store_bytes(cfg, f32, None, more)


def test_loading_shows_its_phases_only_when_asked(tiny_checkpoints, tmp_path, caplog, capsys):
    caplog.set_level(logging.INFO, logger="offload.executor")
    directory, _ = tiny_checkpoints["opt"]
    policy = Policy(gpu_batch_size=2, num_gpu_batches=4, weights=W3)
    for progress in (True, False):
        caplog.clear()
        nvme = tmp_path / str(progress)
        with LLM(
            str(directory),
            device="cpu",
            dtype="float32",
            policy=policy,
            nvme=nvme,
            progress=progress,
        ):
            pass
        bars = capsys.readouterr().err
        told = re.search(
            r"loaded in [\d.]+ s: weight store [\d.]+ s, pinning [\d.]+ s, "
            r"placing weights [\d.]+ s",
            caplog.text,
        )
        assert ("writing weight store" in bars and "placing weights" in bars) == progress
        assert bool(told) == progress, caplog.text


def test_damaged_tail_file_is_detected(tiny_checkpoints, tmp_path):
    directory, _ = tiny_checkpoints["opt"]
    policy = Policy(gpu_batch_size=2, num_gpu_batches=4, weights=W3)
    with LLM(str(directory), device="cpu", dtype="float32", policy=policy, nvme=tmp_path) as llm:
        victim = store_dir(tmp_path, llm.config, torch.float32) / "layer_0001.bin"
    with open(victim, "r+b") as f:  # the file's first byte: the cut, inside a tensor
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0x10]))
    with (
        LLM(str(directory), device="cpu", dtype="float32", policy=policy, nvme=tmp_path) as llm,
        pytest.raises(CorruptExtent, match=r"checksum mismatch in .*layer_0001\.bin"),
    ):
        llm.generate(PROMPTS, PARAMS)


def test_policy_json_round_trip_and_validation(tmp_path):
    policy = POLICIES["overlap-everything-split"]
    assert Policy.from_dict(json.loads(policy.to_json())) == policy
    assert set(json.loads(policy.to_json())) == {
        "gpu_batch_size",
        "num_gpu_batches",
        "weights",
        "kv_cache",
        "activations",
        "attention_on_cpu",
        "overlap",
        "weight_compression",
        "kv_compression",
        "cpu_experts",
    }
    with pytest.raises(ValueError, match=r"sum to 1\.2"):
        Placement(0.5, 0.5, 0.2)
    with pytest.raises(ValueError, match="unknown policy field"):
        Policy.from_dict({"gpu_batch": 3})
    bad = tmp_path / "p.json"
    bad.write_text('{"weights": {"gpu": 0.5, "cpu": 0.2, "disk": 0.0}}')
    with pytest.raises(UserError, match=r"sum to 0\.7"):
        Policy.from_file(bad)


def test_disk_policy_without_nvme_is_refused(tiny_checkpoints):
    directory, _ = tiny_checkpoints["opt"]
    with pytest.raises(UserError, match="--nvme"):
        LLM(str(directory), device="cpu", policy=Policy(weights=W3))


def test_policy_over_the_cap_is_refused_before_loading(tiny_checkpoints):
    directory, _ = tiny_checkpoints["opt"]
    with pytest.raises(UserError, match=r"GPU needs .* GB .* but 0.00 GB is available"):
        LLM(str(directory), device="cpu", policy=Policy(), caps=Caps(gpu_bytes=1000))


def test_block_over_the_cap_is_refused_before_generating(tiny_checkpoints):
    from offload.policies.memory_limit import node_memory_limit

    directory, _ = tiny_checkpoints["opt"]
    policy = Policy(gpu_batch_size=4, num_gpu_batches=2, kv_cache=Placement(0, 1, 0))
    with LLM(
        str(directory),
        device="cpu",
        dtype="float32",
        policy=policy,
        caps=Caps(cpu_bytes=node_memory_limit()[0]),  # all the machine has
    ) as llm:
        need = llm.runner.ledger.snapshot()
        assert need["cpu"]["used"] == 0  # no CPU weights
        llm.plan = dataclasses.replace(llm.plan, caps=Caps(cpu_bytes=1))
        with pytest.raises(UserError, match="CPU needs"):
            llm.generate(PROMPTS, PARAMS)


INT4 = Compression(bits=4, group_size=32, symmetric=False)
INT8 = Compression(bits=8, group_size=64, symmetric=True)
COMPRESSED_POLICIES = ["weights-3-ways", "kv-cpu-cpu-attention", "overlap-everything-split"]


def _plain_compressed(directory, compression):
    llm = LLM(str(directory), device="cpu", dtype="float32", batch_size=8)
    with llm.spec.open_weights() as source:
        llm.runner = PlainRunner(
            source, torch.float32, torch.device("cpu"), weight_compression=compression
        )
    llm.loop.runner = llm.runner  # the decode loop holds the runner it was built with
    return llm


def _with_compression(policy: Policy, compression: Compression) -> Policy:
    return Policy.from_dict({**policy.to_dict(), "weight_compression": compression.__dict__})


@pytest.mark.parametrize("compression", [INT4, INT8], ids=["int4-g32", "int8-g64-sym"])
@pytest.mark.parametrize("case", FAMILIES)
def test_compressed_weights_give_the_plain_compressed_tokens(
    case, compression, tiny_checkpoints, tmp_path
):
    """Every tier holds the quantized matrices (codes + fp16 group parameters) and the
    executor multiplies with them; the plain run computes with the same values
    (quantize-dequantize), so tokens agree exactly on the CPU."""
    directory, _ = tiny_checkpoints[case]
    want = [
        o.token_ids for o in _plain_compressed(directory, compression).generate(PROMPTS, PARAMS)
    ]
    for name in COMPRESSED_POLICIES:
        policy = _with_compression(POLICIES[name], compression)
        with LLM(
            str(directory), device="cpu", dtype="float32", policy=policy, nvme=tmp_path
        ) as llm:
            got = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
        assert got == want, f"{case} under {name} with {compression} differs"


@pytest.mark.parametrize(
    ("compression", "bound"), [(INT8, 0.02), (INT4, 0.25)], ids=["int8", "int4"]
)
def test_compressed_logits_stay_near_the_uncompressed_run(
    compression, bound, tiny_checkpoints, tmp_path
):
    """Stated bounds on max |logit error| / max |logit| against the uncompressed plain run,
    over every family and the compressed policies."""
    for case in FAMILIES:
        directory, _ = tiny_checkpoints[case]
        plain = LLM(str(directory), device="cpu", dtype="float32", batch_size=8)
        want, _ = prefill_logits(plain, PROMPTS)
        for name in COMPRESSED_POLICIES:
            policy = _with_compression(POLICIES[name], compression)
            with LLM(
                str(directory), device="cpu", dtype="float32", policy=policy, nvme=tmp_path
            ) as llm:
                got, _ = prefill_logits(llm, PROMPTS)
            error = ((got - want).abs().max() / want.abs().max()).item()
            assert error < bound, f"{case} {name}: relative logit error {error:.3g}"


# KV groups of 16 tokens, so the short test generations complete groups and keep a tail
KV4 = Compression(bits=4, group_size=16, symmetric=False)
KV8 = Compression(bits=8, group_size=16, symmetric=True)
KV_PARAMS = SamplingParams(max_new_tokens=24)
# the policies vary where a compressed cache's rows live (GPU, CPU and disk homes) and
# where their attention runs, with weights, batches and activations
KV_POLICIES = {
    "micro-batches": Policy(gpu_batch_size=2, num_gpu_batches=4),
    "weights-3-ways": Policy(gpu_batch_size=2, num_gpu_batches=4, weights=W3),
    "activations-cpu": Policy(
        gpu_batch_size=3, num_gpu_batches=3, weights=W3, activations=Placement(0.5, 0.5, 0)
    ),
    "kv-cpu-device-attention": Policy(
        gpu_batch_size=2, num_gpu_batches=4, kv_cache=Placement(0, 1, 0)
    ),
    "kv-3-ways-cpu-attention": Policy(
        gpu_batch_size=3,
        num_gpu_batches=3,
        weights=W3,
        kv_cache=Placement(0.34, 0.33, 0.33),
        attention_on_cpu=True,
    ),
    "kv-3-ways-serial": Policy(
        gpu_batch_size=8, num_gpu_batches=1, kv_cache=Placement(0.25, 0.25, 0.5), overlap=False
    ),
    "kv-cpu-disk-device-attention": Policy(
        gpu_batch_size=2, num_gpu_batches=4, kv_cache=Placement(0, 0.5, 0.5)
    ),
    # disk rows in the first and last micro-batch of a layer only: the staging blocks go
    # round those, and their reads run ahead across the others (`KVManager.prefetch_after`)
    "kv-3-ways-some-blocks-on-disk": Policy(
        gpu_batch_size=2, num_gpu_batches=4, kv_cache=Placement(0.25, 0.5, 0.25)
    ),
    # three blocks with disk rows a layer (micro-batches 1, 3 and 6), two staging blocks,
    # CPU-only blocks after them: a compressed cache loads a layer's CPU blocks and its
    # first two disk blocks at the layer's start, the third at its attention
    # (`KVManager.load_layer`)
    "kv-disk-blocks-beyond-the-staging": Policy(
        gpu_batch_size=1, num_gpu_batches=8, kv_cache=Placement(0, 0.625, 0.375)
    ),
}


def _with(policy: Policy, **compression: Compression) -> Policy:
    extra = {k: v.__dict__ for k, v in compression.items()}
    return Policy.from_dict({**policy.to_dict(), **extra})


@pytest.mark.parametrize("compression", [KV4, KV8], ids=["int4-g16", "int8-g16-sym"])
@pytest.mark.parametrize("case", FAMILIES)
def test_compressed_kv_gives_the_plain_compressed_tokens(
    case, compression, tiny_checkpoints, tmp_path
):
    """The executor's compressed cache (written per micro-batch, groups completing
    mid-generation) gives exactly the plain runner's tokens with the same cache format;
    with int4 weights too."""
    directory, _ = tiny_checkpoints[case]
    for weights in (None, INT4):
        plain = LLM(str(directory), device="cpu", dtype="float32", batch_size=8)
        with plain.spec.open_weights() as source:
            plain.runner = PlainRunner(
                source,
                torch.float32,
                torch.device("cpu"),
                weight_compression=weights,
                kv_compression=compression,
            )
        plain.loop.runner = plain.runner  # the decode loop holds the runner it was built with
        want = [o.token_ids for o in plain.generate(PROMPTS, KV_PARAMS)]
        for name, policy in KV_POLICIES.items():
            extra = {"kv_compression": compression}
            if weights is not None:
                extra["weight_compression"] = weights
            with LLM(
                str(directory),
                device="cpu",
                dtype="float32",
                policy=_with(policy, **extra),
                nvme=tmp_path,
            ) as llm:
                got = [o.token_ids for o in llm.generate(PROMPTS, KV_PARAMS)]
            assert got == want, f"{case} under {name} with KV {compression} differs"


@pytest.mark.parametrize(("compression", "bound"), [(KV8, 0.02), (KV4, 0.25)], ids=["int8", "int4"])
def test_compressed_kv_decode_logits_stay_near_the_uncompressed_run(
    compression, bound, tiny_checkpoints, tmp_path
):
    """Stated bounds on max |logit error| / max |logit| of 24 teacher-forced decode
    steps against the uncompressed plain run, every family, each KV policy."""
    for case in FAMILIES:
        directory, _ = tiny_checkpoints[case]
        plain = LLM(str(directory), device="cpu", dtype="float32", batch_size=8)
        want = decode_logits(plain, PROMPTS, 24)
        for name, policy in KV_POLICIES.items():
            policy = _with(policy, kv_compression=compression)
            with LLM(
                str(directory), device="cpu", dtype="float32", policy=policy, nvme=tmp_path
            ) as llm:
                got = decode_logits(llm, PROMPTS, 24)
            error = ((got - want).abs().max() / want.abs().max()).item()
            assert error < bound, f"{case} {name}: relative logit error {error:.3g}"


def test_kv_group_size_must_be_a_kernel_tile():
    with pytest.raises(ValueError, match="tokens a key group"):
        Policy(kv_compression=Compression(4, 48))


def test_the_host_to_gpu_link_is_busy_while_either_copy_stream_is():
    """Weights and KV loads run on two copy streams over one PCIe link: each lane keeps
    its own busy time, and the link's is their union (not their sum)."""
    from offload.executor.lanes import busy_seconds

    spans = [
        ("h2d", "weights L1", 0.0, 1.0, 100),
        ("h2d_kv", "kv L0 mb0", 0.5, 1.5, 10),
        ("h2d_kv", "kv L0 mb1", 2.0, 2.5, 10),
        ("compute", "L0 mb0", 0.0, 3.0, 0),
    ]
    busy = busy_seconds(spans)
    assert busy["h2d"] == {"busy_s": 1.0, "bytes": 100}
    assert busy["h2d_kv"] == {"busy_s": 1.5, "bytes": 20}
    assert busy["pcie_h2d"] == {"busy_s": 2.0, "bytes": 120}


def test_a_trace_holds_the_last_step_and_the_last_prefill(tiny_checkpoints, tmp_path):
    """--trace writes the last step's spans and, beside them, the last prefill's: every
    layer's compute once a micro-batch in each, the KV loads of the off-GPU rows only
    in the decode step, the layer timeline readable from the file."""
    from offload.executor.lanes import layer_timeline, read_chrome
    from offload.executor.runner import prefill_trace_path

    directory, _ = tiny_checkpoints["opt"]
    policy = POLICIES["kv-cpu-device-attention"]
    with LLM(
        str(directory), device="cpu", dtype="float32", policy=policy, nvme=tmp_path, trace=True
    ) as llm:
        llm.generate(PROMPTS, PARAMS)
        assert llm.runner.write_trace(tmp_path / "t.json")
        layers = llm.config.num_layers
    decode = read_chrome(tmp_path / "t.json")
    prefill = read_chrome(prefill_trace_path(tmp_path / "t.json"))
    for spans in (decode, prefill):
        qkv = [name for lane, name, *_ in spans if lane == "compute" and name.endswith(" qkv")]
        assert len(qkv) == layers * policy.num_gpu_batches
    assert any(lane == "h2d_kv" for lane, *_ in decode)
    assert not any(lane == "h2d_kv" for lane, *_ in prefill)
    assert len(layer_timeline(prefill)["rows"]) == layers


def test_disk_reads_merge_nearby_pieces_and_write_backs_never_do():
    from offload.executor.kv_transfer import READ_MERGE_GAP, _page_spans

    base = torch.zeros(1 << 20, dtype=torch.uint8)
    pieces = [base[0:100], base[8192:8300], base[600000:600010]]
    assert _page_spans(base, pieces) == [(0, 4096), (8192, 12288), (598016, 602112)]
    # the 4 KiB between the first two come along; the third is too far
    assert _page_spans(base, pieces, READ_MERGE_GAP) == [(0, 12288), (598016, 602112)]
