"""CUDA-only checks (marked `gpu`): run on the GPU machine, skipped elsewhere."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from offload.api.llm import LLM
from offload.executor.runner import PlainRunner
from offload.io.pinned import PinnedPool
from offload.io.reader import ExtentReader
from offload.io.store_format import WeightStore, write_stage_file
from offload.policies.policy import Placement, Policy
from tests.test_executor import FAMILIES
from tests.tiny_models import assert_prefill_logits_match

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22], [300, 1, 2, 250, 7]]


def test_pool_is_pinned_and_reader_copies_to_the_gpu(tmp_path):
    tensors = {"a": torch.randn(300_001), "b": torch.randn(17, 4099).to(torch.bfloat16)}
    entry = write_stage_file(tmp_path / "s.bin", tensors)
    store = WeightStore(tmp_path, {"dtype": "float32", "stages": {"s": entry}})
    with PinnedPool(2**24) as pool, ExtentReader(threads=4) as reader:
        assert pool.pinned and pool.buffer.is_pinned()
        for extent in store.extents("s"):
            dest = torch.empty(extent.shape, dtype=extent.dtype, device="cuda")
            with pool.alloc(extent.padded) as block:
                load = reader.submit(extent, block, dest).result()
                assert load.event is not None
                load.event.synchronize()
            assert torch.equal(dest.cpu(), tensors[extent.name])


@pytest.mark.parametrize("case", ["llama-gqa", "bloom", "opt-350m-like", "qwen2-bias"])
def test_cuda_fp32_logits_match_transformers(case, tiny_checkpoints):
    directory, model = tiny_checkpoints[case]
    llm = LLM(str(directory), device="cuda", dtype="float32")
    assert_prefill_logits_match(llm, model, PROMPTS, case)


@pytest.mark.parametrize("case", ["llama-gqa", "opt"])
def test_unpadded_steps_through_flash_give_the_masked_logits(case, tiny_checkpoints, monkeypatch):
    """Prompts of one length: the prefill and every decode step are flagged causal and
    attend through SDPA's flash kernel without the bias (fp16 on CUDA); the same steps
    with the flag cleared take the masked kernels and give the same logits."""
    from offload.models.batch import PaddedBatch
    from tests.tiny_models import decode_logits

    directory, _ = tiny_checkpoints[case]
    prompts = [[5, 6, 7, 8, 9, 10], [30, 31, 32, 33, 34, 35], [7, 7, 7, 7, 7, 7]]
    llm = LLM(str(directory), device="cuda", dtype="float16")
    batch = PaddedBatch(llm.config, prompts, max_new_tokens=8, pad_id=0)
    assert llm.runner.step_inputs(batch, 6, 1).causal
    flash = decode_logits(llm, prompts, steps=8)
    step_inputs = PaddedBatch.step_inputs

    def masked(self, *args, **kwargs):
        return dataclasses.replace(step_inputs(self, *args, **kwargs), causal=False)

    monkeypatch.setattr(PaddedBatch, "step_inputs", masked)
    torch.testing.assert_close(flash, decode_logits(llm, prompts, steps=8), atol=2e-2, rtol=2e-2)


def test_cuda_greedy_matches_cpu(tiny_checkpoints):
    directory, _ = tiny_checkpoints["llama-gqa"]
    cpu = LLM(str(directory), device="cpu", dtype="float32").generate(PROMPTS)
    gpu = LLM(str(directory), device="cuda", dtype="float32").generate(PROMPTS)
    assert [o.token_ids for o in cpu] == [o.token_ids for o in gpu]


@pytest.mark.parametrize(
    "policy",
    [
        "weights-3-ways",
        "kv-cpu-cpu-attention",
        "kv-cpu-device-attention",
        "kv-partly-disk",
        "serial-everything-split",
        "overlap-everything-split",
    ],
)
def test_cuda_executor_policies_give_the_plain_tokens(policy, tiny_checkpoints, tmp_path):
    from tests.test_executor import PARAMS, POLICIES
    from tests.test_executor import PROMPTS as MANY

    directory, _ = tiny_checkpoints["llama-gqa"]
    plain = LLM(str(directory), device="cuda", dtype="float32", batch_size=8).generate(MANY, PARAMS)
    with LLM(
        str(directory), device="cuda", dtype="float32", policy=POLICIES[policy], nvme=tmp_path
    ) as llm:
        runs = [[o.token_ids for o in llm.generate(MANY, PARAMS)] for _ in range(3)]
    assert all(run == [o.token_ids for o in plain] for run in runs)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
def test_qlinear_kernel_compiled_matches_reference(bits, symmetric):
    """The Triton kernel and, for int4-g64 asymmetric on Hopper, `qmatmul_wgmma`'s."""
    from tests.kernel_cases import QLINEAR_SHAPES, WGMMA_SHAPES, qlinear_failures

    shapes = [*QLINEAR_SHAPES, (8, 7168, 7168, 64), (512, 4096, 11008, 128), (2100, 384, 512, 64)]
    shapes += WGMMA_SHAPES
    dtypes = [torch.float16, torch.bfloat16, torch.float32]
    assert qlinear_failures(bits, symmetric, "cuda", dtypes, shapes) == []
    if bits == 4 and not symmetric:  # integer zero points (pre-quantized checkpoints')
        assert qlinear_failures(4, False, "cuda", dtypes, shapes, zero_point=True) == []


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
def test_quantized_decode_attention_compiled_matches_reference(bits, symmetric):
    from tests.kernel_cases import ATTENTION_SHAPES, attention_failures

    shapes = [
        *ATTENTION_SHAPES,
        (4, 56, 56, 128, 64, 544, 512, False),
        (3, 64, 8, 128, 64, 300, 250, True),
    ]
    dtypes = [torch.float16, torch.bfloat16, torch.float32]
    assert attention_failures(bits, symmetric, "cuda", dtypes, shapes) == []


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
def test_kv_cache_quantizing_kernel_compiled_is_bit_exact(bits, symmetric):
    from tests.kernel_cases import kv_write_failures

    dtypes = [torch.float16, torch.bfloat16, torch.float32]
    assert kv_write_failures(bits, symmetric, "cuda", dtypes) == []


def test_norm_kernel_compiled_matches_layer_and_rms_norm():
    from tests.kernel_cases import NORM_SHAPES, norm_failures

    shapes = [*NORM_SHAPES, (12, 7168), (300, 8192), (2, 14336)]
    dtypes = [torch.float16, torch.bfloat16, torch.float32]
    assert norm_failures("cuda", dtypes, shapes) == []


def test_launcher_keys_compiled_kernels_by_alignment():
    """The same shapes with an unaligned x (a view one element in) after an aligned one:
    the kernel compiled for 16-byte-aligned pointers must not be reused for it."""
    from offload.kernels.formats import Compression
    from offload.kernels.qmatmul import qlinear, qlinear_reference
    from offload.kernels.quant import quantize

    w = quantize(torch.randn(256, 512, device="cuda"), Compression(4, 64, False))
    wide = torch.randn(5, 513, device="cuda", dtype=torch.float16)
    for x in (wide[:, :512].clone(), wide[:, 1:]):  # aligned, then 2 bytes off
        ours, want = qlinear(x, w), qlinear_reference(x, w, None)
        assert (ours - want).abs().max().item() <= 1e-2 * want.abs().max().item()


def test_launcher_calls_the_compiled_kernel_directly(monkeypatch):
    """After a kernel's first call of a kind, the Launcher launches the compiled kernel
    itself: Triton's own path (its argument binding, 39 us a launch) is not taken again,
    and the result is the same."""
    from offload.kernels import qmatmul
    from offload.kernels.formats import Compression
    from offload.kernels.quant import quantize

    w = quantize(torch.randn(256, 512, device="cuda"), Compression(4, 64, False))
    x = torch.randn(5, 512, device="cuda", dtype=torch.float16)
    first = qmatmul.qlinear(x, w)
    kernel = qmatmul._launch.kernel
    calls = []
    run = kernel.run
    monkeypatch.setattr(kernel, "run", lambda *a, **k: calls.append(1) or run(*a, **k))
    again = qmatmul.qlinear(x, w)
    assert calls == [], "the second launch took Triton's path"
    assert torch.equal(first, again)


@pytest.mark.parametrize("kernel", ["triton", "wgmma"])
def test_split_k_qlinear_replays_in_a_cuda_graph(kernel):
    """Split-K (arrival counters reset by the last program of a tile) captured once and
    replayed on new inputs gives exactly the eager result: the Triton kernel, and
    `qmatmul_wgmma`'s (its x preparation captured too)."""
    from offload.kernels import qmatmul_wgmma
    from offload.kernels.formats import Compression
    from offload.kernels.qmatmul import qlinear
    from offload.kernels.qmatmul_tiles import tiles_for
    from offload.kernels.quant import quantize

    w = quantize(torch.randn(1024, 4096, device="cuda"), Compression(4, 64, False))
    x = torch.randn(12, 4096, device="cuda", dtype=torch.float16)
    tiles = tiles_for(12, 1024, 4096, 64, x.device)
    if kernel == "wgmma":
        if not qmatmul_wgmma.eligible(x, w, None):
            pytest.skip("qmatmul_wgmma: Hopper GPUs only")
        tiles = None
        assert (1024 // 64) % qmatmul_wgmma.programs(12, 1024, 4096, x.device), "no tile shared"
    assert kernel == "wgmma" or tiles.split > 1
    qlinear(x, w, tiles=tiles)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = qlinear(x, w, tiles=tiles)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(out, qlinear(x, w, tiles=tiles))


def test_wgmma_shapes_take_the_wgmma_kernel_on_hopper():
    """The cases `qlinear_failures` runs as WGMMA_SHAPES reach `qmatmul_wgmma` (so the
    compiled test above checks it) on every kind of grid: one tile a program (with one
    warpgroup and with two), split-K, and stream-K (tiles shared by runs that cross them)."""
    from offload.kernels import qmatmul_wgmma
    from offload.kernels.formats import Compression
    from offload.kernels.launch import sm_count
    from offload.kernels.quant import quantize
    from tests.kernel_cases import WGMMA_SHAPES

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("qmatmul_wgmma: Hopper GPUs only")
    if sm_count(torch.device("cuda")) != 132:
        pytest.skip("WGMMA_SHAPES' grids are chosen for 132 SMs")
    kinds = set()
    for rows, n, k, group in WGMMA_SHAPES:
        w = quantize(torch.randn(n, k, device="cuda"), Compression(4, group, False))
        x = torch.randn(rows, k, device="cuda", dtype=torch.float16)
        assert qmatmul_wgmma.eligible(x, w, torch.zeros(n, device="cuda", dtype=x.dtype))
        warpgroups = qmatmul_wgmma._warpgroups(rows, n, k, x.device)
        tiles = n // (64 * warpgroups)
        grid = qmatmul_wgmma.programs(rows, n, k, x.device)
        if grid == tiles:
            kinds.add(f"one tile a program, {warpgroups} warpgroup(s)")
        else:
            kinds.add("split-K" if grid % tiles == 0 else "stream-K")
    assert kinds == {
        "one tile a program, 1 warpgroup(s)",
        "one tile a program, 2 warpgroup(s)",
        "split-K",
        "stream-K",
    }


def test_int4_head_dim_128_caches_take_the_mma_attention_kernel():
    """The compiled attention test's shapes with 128 channels (plain heads, 3 and 8 query
    heads a KV head) reach `kv_attention_mma` in float16 over int4-g64 asymmetric caches,
    and nothing else does: more than 8 query heads a KV head, int8, symmetric, float32."""
    from offload.kernels import kv_attention_mma
    from offload.kernels.formats import Compression
    from offload.kernels.kv_cache import QuantKV

    def takes(heads, kv_heads, config=None, dtype=torch.float16):
        config = config or Compression(4, 64, False)
        cache = QuantKV(2, kv_heads, 128, 300, config, dtype, torch.device("cuda"))
        q = torch.zeros(2, heads, 1, 128, device="cuda", dtype=dtype)
        return kv_attention_mma.eligible(q, cache)

    assert takes(56, 56) and takes(12, 4) and takes(64, 8)
    assert not takes(32, 2)
    assert not takes(8, 8, Compression(8, 64, False))
    assert not takes(8, 8, Compression(4, 64, True))
    assert not takes(8, 8, dtype=torch.float32)


@pytest.mark.parametrize("case", FAMILIES)
def test_cuda_graph_decode_gives_the_eager_tokens(case, tiny_checkpoints, tmp_path):
    """Decode steps replayed from CUDA graphs give exactly the eager steps' tokens: all on
    the GPU with several micro-batches, one, int4 weights with an int4 cache, and the KV
    in CPU homes attended on the CPU (graphs replayed one micro-batch behind,
    `Executor._one_behind`): full precision, half the rows on the GPU, and an int4 cache;
    then a smaller batch (the graphs are captured again for its sizes)."""
    from tests.test_executor import INT4, KV4, KV_PARAMS, PROMPTS, _with

    directory, _ = tiny_checkpoints[case]
    policies = {
        "micro-batches": Policy(gpu_batch_size=2, num_gpu_batches=4),
        "one-micro-batch": Policy(gpu_batch_size=8, num_gpu_batches=1),
        "int4-weights-and-kv": _with(
            Policy(gpu_batch_size=2, num_gpu_batches=4), weight_compression=INT4, kv_compression=KV4
        ),
        "kv-cpu-cpu-attention": Policy(
            gpu_batch_size=2, num_gpu_batches=4, kv_cache=Placement(0, 1, 0), attention_on_cpu=True
        ),
        # a micro-batch's GPU rows joined with its rows attended on the CPU
        "kv-split-cpu-attention": Policy(
            gpu_batch_size=2,
            num_gpu_batches=4,
            kv_cache=Placement(0.5, 0.5, 0),
            attention_on_cpu=True,
        ),
        "int4-kv-cpu-cpu-attention": _with(
            Policy(
                gpu_batch_size=2,
                num_gpu_batches=4,
                kv_cache=Placement(0, 1, 0),
                attention_on_cpu=True,
            ),
            kv_compression=KV4,
        ),
    }
    for name, policy in policies.items():
        runs = {}
        for graphs in (True, False):
            with LLM(
                str(directory), device="cuda", dtype="float32", policy=policy, nvme=tmp_path
            ) as llm:
                # the load warmed up: compiled, and captured the block's graphs
                assert bool(llm.runner._graphs) == llm.runner.policy.decode_graphs, name
                if not graphs:
                    llm.runner.cuda_graphs = False
                    llm.runner._drop_graphs()
                runs[graphs] = [
                    [o.token_ids for o in llm.generate(prompts, KV_PARAMS)]
                    for prompts in (PROMPTS, PROMPTS[:3])
                ]
                assert bool(llm.runner._graphs) == graphs, name
        assert runs[True] == runs[False], f"{case} under {name}: graphs change the tokens"


@pytest.mark.parametrize("case", ["llama-gqa", "bloom", "opt"])
def test_cuda_compressed_kv_in_cpu_and_disk_homes(case, tiny_checkpoints, tmp_path):
    """A compressed cache with CPU and disk homes on CUDA (pinned pool, packed stores on
    the copy streams, disk homes read ahead, graphs where the weights are all on the
    GPU): attention on the GPU gives
    exactly the plain run's tokens with the same cache format (the same kernels read
    the same bytes), three runs alike; attention on the CPU (`decode_attention_cpu`
    against the GPU kernel, whose float32 `tl.dot` rounds its inputs to TF32) keeps
    teacher-forced decode logits within 1% of the plain run's."""
    from tests.test_executor import KV4, KV_PARAMS, KV_POLICIES, PROMPTS, _with
    from tests.tiny_models import decode_logits

    directory, _ = tiny_checkpoints[case]
    plain = LLM(str(directory), device="cuda", dtype="float32", batch_size=8)
    with plain.spec.open_weights() as source:
        plain.runner = PlainRunner(source, torch.float32, torch.device("cuda"), kv_compression=KV4)
    plain.loop.runner = plain.runner  # the decode loop holds the runner it was built with
    want = [o.token_ids for o in plain.generate(PROMPTS, KV_PARAMS)]
    want_logits = decode_logits(plain, PROMPTS, 24)
    for name in (
        "kv-cpu-device-attention",
        "kv-cpu-disk-device-attention",
        "kv-3-ways-serial",
        "kv-3-ways-cpu-attention",
    ):
        policy = _with(KV_POLICIES[name], kv_compression=KV4)
        with LLM(
            str(directory), device="cuda", dtype="float32", policy=policy, nvme=tmp_path
        ) as llm:
            if policy.attention_on_cpu:
                got = decode_logits(llm, PROMPTS, 24)
                error = ((got - want_logits).abs().max() / want_logits.abs().max()).item()
                assert error < 1e-2, f"{case} {name}: relative logit error {error:.3g}"
                continue
            runs = [[o.token_ids for o in llm.generate(PROMPTS, KV_PARAMS)] for _ in range(3)]
        assert all(run == want for run in runs), f"{case} under {name} differs"


def test_a_disk_read_still_running_loads_at_its_attention(tiny_checkpoints, tmp_path, monkeypatch):
    """Weights all on the GPU (no weight copy follows a layer's KV loads): a micro-batch
    whose disk read has not landed is not waited for ahead of the layer but loads at its
    attention (`KVManager.load_layer`). Reads slowed so that some do not land in time:
    the same tokens as with reads at full speed."""
    import time

    from offload.executor.kv import KVManager
    from offload.io.spill import SpillFile
    from tests.test_executor import KV4, KV_PARAMS, KV_POLICIES, PROMPTS, _with

    directory, _ = tiny_checkpoints["llama-gqa"]
    policy = _with(KV_POLICIES["kv-cpu-disk-device-attention"], kv_compression=KV4)

    def generate() -> list[list[int]]:
        with LLM(
            str(directory), device="cuda", dtype="float32", policy=policy, nvme=tmp_path
        ) as llm:
            return [o.token_ids for o in llm.generate(PROMPTS, KV_PARAMS)]

    want = generate()
    landed: list[bool] = []
    read_done, read_all = KVManager._read_done, SpillFile._read_all

    def slow_read(self, offset, view):
        time.sleep(0.01)
        read_all(self, offset, view)

    def recorded(self, layer, mb):
        landed.append(read_done(self, layer, mb))
        return landed[-1]

    monkeypatch.setattr(SpillFile, "_read_all", slow_read)
    monkeypatch.setattr(KVManager, "_read_done", recorded)
    assert generate() == want
    assert not all(landed), "no read was still running when its layer's loads were issued"


def _grouped_prefill(batch: int, seed: int):
    """q [B, 32, 512, 128] and K/V of 8 heads in fp16, and the causal bias [B, 1, T, T]."""
    heads, kv_heads, tokens, dim = 32, 8, 512, 128
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, heads, tokens, dim, device="cuda", dtype=torch.float16, generator=gen)
    k, v = (
        torch.randn(batch, kv_heads, tokens, dim, device="cuda", dtype=torch.float16, generator=gen)
        for _ in range(2)
    )
    causal = torch.full((tokens, tokens), float("-inf"), device="cuda").triu(1)
    bias = causal.to(torch.float16).expand(batch, 1, tokens, tokens).contiguous()
    return q, k, v, bias


def _held(fn) -> tuple[torch.Tensor, int]:
    """fn()'s result and the device bytes it held at its peak beyond what it returns to."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - before


def test_masked_grouped_query_prefill_attention_holds_no_scores():
    """SDPA's own GQA path falls back to the math backend under a mask and holds fp32
    scores [B, H, T, S] (28.5 GB under a 10 GB cap in an H100 run); `decoder.attend`
    expands K/V instead, which `policies.memory` counts. Same values as grouping."""
    from offload.models.attention import attend

    q, k, v, bias = _grouped_prefill(64, seed=0)
    batch, heads, tokens, dim = q.shape
    out, extra = _held(lambda: attend(q, k, v, bias))
    scores = batch * heads * tokens * tokens * 4
    expanded = 2 * batch * heads * tokens * dim * 2
    bound = expanded + 2 * out.numel() * out.element_size() + (64 << 20)  # + out's reshape
    assert bound < scores, "the bound must tell the two backends apart"
    assert extra < bound, f"{extra / 1e9:.2f} GB over the expanded K/V's {bound / 1e9:.2f}"
    rows = slice(0, 4)  # the reference on a few rows: grouped heads, plain math
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[rows].float(), k[rows].float().repeat_interleave(4, 1),
        v[rows].float().repeat_interleave(4, 1), attn_mask=bias[rows].float(),
    )  # fmt: skip
    want = ref.transpose(1, 2).reshape(4, tokens, heads * dim)
    torch.testing.assert_close(out[rows].float(), want, atol=2e-3, rtol=2e-3)


def test_causal_prefill_attention_reads_grouped_heads_in_place():
    """A prefill without padding (`StepInputs.causal`) runs SDPA's causal kernel without
    the bias: grouped-query K/V are read in place, not expanded to every query head,
    and the values are the masked path's."""
    from offload.models.attention import attend

    q, k, v, bias = _grouped_prefill(16, seed=1)
    batch, heads, tokens, dim = q.shape
    out, extra = _held(lambda: attend(q, k, v, bias, causal=True))
    masked, masked_extra = _held(lambda: attend(q, k, v, bias))
    expanded = 2 * batch * heads * tokens * dim * 2  # K and V at every query head
    assert extra + expanded // 2 <= masked_extra, (extra, masked_extra, expanded)
    torch.testing.assert_close(out, masked, atol=2e-3, rtol=2e-3)


def test_a_job_after_the_warm_up_compiles_no_kernel(tiny_checkpoints, tmp_path):
    """Where decode replays graphs, the load's warm-up compiles every kernel a job of
    another prompt length and budget runs: none compiles in the job's prefill or its
    decode steps, which complete cache groups (W1c's first prefill took 2.25 s against
    0.70: the KV quantize kernel specialized on a slot count the warm-up's was not like).
    The counter itself is checked on a tiling nothing else uses."""
    from offload.core.sampling import SamplingParams
    from offload.kernels.formats import Compression
    from offload.kernels.launch import CompileCount
    from offload.kernels.qmatmul import qlinear
    from offload.kernels.qmatmul_tiles import Tiles
    from offload.kernels.quant import quantize
    from tests.test_executor import INT4, KV4, _with

    w = quantize(torch.randn(96, 256, device="cuda"), Compression(4, 32, False))
    with CompileCount() as fresh:
        qlinear(torch.randn(5, 256, device="cuda"), w, tiles=Tiles(16, 32, 64, 2, 2))
    assert fresh.names == ["_qmatmul_kernel"]

    directory, _ = tiny_checkpoints["opt"]
    policy = _with(
        Policy(gpu_batch_size=8, num_gpu_batches=1), weight_compression=INT4, kv_compression=KV4
    )
    with LLM(str(directory), device="cuda", dtype="float16", policy=policy, nvme=tmp_path) as llm:
        assert llm.runner._graphs, "the load warmed up and captured the graphs"
        warm_slots = llm.runner.kv.homes.max_slots
        # 8 x 130 prompt rows take the dense path as the warm-up's did; 130 + 46 slots
        # are a multiple of 16 where the warm-up's were not; decode completes 3 groups
        prompts = [[5 + i] * 130 for i in range(8)]
        params = SamplingParams(max_tokens=46, ignore_eos=True)
        with CompileCount() as job:
            outs = llm.generate(prompts, params)
        assert warm_slots % 16 and llm.runner.kv.homes.max_slots == 176
    assert all(len(o.outputs[0].token_ids) == 46 for o in outs)
    assert job.names == [], f"compiled in the job: {job.names}"


_STREAMED_JOB = """
import sys
from offload.api.llm import LLM
from offload.kernels.launch import CompileCount
from offload.policies.policy import Placement, Policy
from offload.core.sampling import SamplingParams

policy = Policy(gpu_batch_size=4, num_gpu_batches=2, weights=Placement(0, 1, 0))
with LLM(sys.argv[1], device="cuda", dtype="float16", policy=policy) as llm:
    assert not llm.runner._graphs
    with CompileCount() as job:
        llm.generate([[5 + i] * 40 for i in range(8)], SamplingParams(max_tokens=4))
print("compiled in the job:", job.names)
"""


@pytest.mark.parametrize("case", ["llama-gqa", "bloom"])
def test_a_streamed_plans_first_prefill_compiles_nothing(case, tiny_checkpoints):
    """Where weights stream (no decode graphs, so no warm-up block), the load still
    launches the decoder's kernels once (`decoder.warm_kernels`): the job's first prefill
    loads no Triton kernel and starts no runtime. A process of its own, so nothing an
    earlier test compiled is in memory (a load from Triton's disk cache counts too)."""
    import subprocess
    import sys

    directory, _ = tiny_checkpoints[case]
    done = subprocess.run(
        [sys.executable, "-c", _STREAMED_JOB, str(directory)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled in the job: []" in done.stdout, done.stdout


def test_a_steps_gpu_transients_are_a_layers_or_the_logits_as_planned():
    """A step holds a prefill layer's working set or, at the head, every micro-batch's
    logits and their cat, not both (`memory.activation_plan`): here the two are near
    equal, so a plan that summed them would be near twice what the step holds. Prefill
    and two decode steps as the decode loop runs them (a step's logits dropped once
    sampled); the whole run within the plan as the cap check counts it."""

    from offload.core.config import ModelConfig
    from offload.executor.executor import Executor
    from offload.models.batch import PaddedBatch
    from offload.models.weights import DummySource
    from offload.policies.caps import GPU_SLACK
    from offload.policies.memory import plan_memory

    cfg = ModelConfig("logits", "llama", 128256, 256, 2, 4, 4, 64, 512, 2048, 1e-5)
    cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    policy = Policy(gpu_batch_size=256, num_gpu_batches=2)
    prompt_len, new_tokens = 640, 3
    plan = plan_memory(cfg, policy, torch.float16, prompt_len, new_tokens)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    empty = torch.cuda.memory_allocated()
    ex = Executor(DummySource(cfg), policy, torch.float16, torch.device("cuda"), cuda_graphs=False)
    prompts = [[5 + row % 97] * prompt_len for row in range(policy.block_size)]
    batch = PaddedBatch(cfg, prompts, new_tokens, pad_id=0)
    ex.start(batch)
    torch.cuda.synchronize()
    started = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logits = [ex.forward(batch.prompt_ids, ex.step_inputs(batch, 0, prompt_len))]
    for t in range(new_tokens - 1):
        ids = logits.pop().argmax(-1)[:, None]
        logits.append(ex.forward(ids, ex.step_inputs(batch, prompt_len + t, 1)))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    ex.close()
    step, whole = peak - started, peak - empty
    planned = plan.detail["transient_gpu"] + plan.detail["act_gpu"]
    report = f"step {step / 1e6:.0f} MB (planned {planned / 1e6:.0f}), run {whole / 1e6:.0f} MB"
    report += f" (planned {plan.gpu_bytes / 1e6:.0f} + {GPU_SLACK:.0%})"
    assert whole <= plan.gpu_bytes * (1 + GPU_SLACK), report
    # the small tensors no term names (ids, positions, the attention's log-sum-exp: 33
    # MB of 1381 on the H100 machine) are what the cap's slack is for
    assert 0.8 * planned <= step <= planned + GPU_SLACK * plan.gpu_bytes, report


def test_greedy_steps_issued_ahead_give_the_waited_for_tokens(tiny_checkpoints, monkeypatch):
    """Plain greedy rows on a GPU: each decode step is issued from the GPU's argmax before
    the host reads the tokens, and the executor returns without waiting (all on the GPU,
    graphs). The tokens are those of the loop that waits for every step, with a stop
    token that ends some rows early too; and the decode steps did not wait."""
    from offload.api.decode_loop import DecodeLoop
    from offload.core.sampling import SamplingParams
    from tests.test_executor import PROMPTS as MANY

    directory, _ = tiny_checkpoints["llama-gqa"]
    policy = Policy(gpu_batch_size=8, num_gpu_batches=1)

    def generate(params: SamplingParams, ahead: bool) -> tuple[list[list[int]], int]:
        with monkeypatch.context() as patch:
            if not ahead:
                patch.setattr(DecodeLoop, "_ahead", lambda self, seqs: False)
            with LLM(str(directory), device="cuda", dtype="float16", policy=policy) as llm:
                sync, count = llm.runner._sync, [0]
                llm.runner._sync = lambda: (count.__setitem__(0, count[0] + 1), sync())
                return [o.token_ids for o in llm.generate(MANY, params)], count[0]

    plain = SamplingParams(max_new_tokens=8)
    waited, waits = generate(plain, ahead=False)
    row = next(i for i, ids in enumerate(waited) if len(ids) >= 3)
    stop = SamplingParams(max_new_tokens=8, stop_token_ids=[waited[row][2]])
    for params in (plain, stop):
        tokens, ahead_waits = generate(params, ahead=True)
        assert tokens == generate(params, ahead=False)[0], params
        assert ahead_waits < waits, (ahead_waits, waits)
    assert len(tokens[row]) <= 3 and tokens != waited  # the stop token ended a row early


def test_vllms_gpu_memory_utilization_is_that_share_of_the_gpu_as_a_cap():
    """vLLM's `LLM(gpu_memory_utilization=0.5)` is a GPU cap of half the device's memory
    (the plan search's, as a max_memory GPU entry), refused beside one."""
    from offload.api.args import from_vllm_arguments, parse_size
    from offload.core.errors import UserError

    cuda = torch.device("cuda")
    total = torch.cuda.get_device_properties(cuda).total_memory
    rest, gpu_mem = from_vllm_arguments({"gpu_memory_utilization": 0.5}, cuda, None)
    assert rest == {} and parse_size(gpu_mem) == total // 2
    with pytest.raises(UserError, match="give one"):
        from_vllm_arguments({"gpu_memory_utilization": 0.5}, cuda, "24GB")


def test_a_gpu_cap_holds_the_caching_allocator_until_the_engine_closes(tiny_checkpoints):
    """With a GPU cap and `hold_gpu_mem` the engine holds the caching allocator to the
    cap less the CUDA context (`caps.hold_gpu_allocator`): a run's reserved bytes and the
    context stay within the cap, a tensor past it is refused while the engine is open,
    and allowed once it is closed."""
    from offload.core.sampling import SamplingParams
    from offload.policies.caps import Caps, cuda_context_bytes
    from tests.test_executor import PROMPTS as MANY

    cuda = torch.device("cuda")
    torch.cuda.empty_cache()
    # what other tests of this process still hold, beside this test's 2 GiB
    cap = torch.cuda.memory_allocated(cuda) + cuda_context_bytes(cuda) + (2 << 30)
    torch.cuda.reset_peak_memory_stats(cuda)
    directory, _ = tiny_checkpoints["llama-gqa"]
    policy = Policy(gpu_batch_size=8, num_gpu_batches=1)
    with LLM(
        str(directory),
        device="cuda",
        dtype="float16",
        policy=policy,
        caps=Caps(gpu_bytes=cap),
        hold_gpu_mem=True,
    ) as llm:
        llm.generate(MANY, SamplingParams(max_new_tokens=8))
        assert torch.cuda.max_memory_reserved(cuda) + cuda_context_bytes(cuda) <= cap
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(cap, dtype=torch.uint8, device=cuda)
    del llm
    past = torch.empty(cap, dtype=torch.uint8, device=cuda)  # the limit went with it
    assert past.numel() == cap
