"""The parts of scripts/bench_moe.py that run in a process of their own, one process a
model load: the engine is loaded once and every schedule runs on it, each time-boxed
within the seconds the parent gave the process (a schedule that cannot finish in what
is left is recorded as skipped, with why). The record is rewritten after every
schedule (`PartRecord`), so a process cut off by the parent leaves what it measured.

    ours         the searched plan's job: one block, prompt P, G new tokens, greedy;
                 its prediction (`cost.estimate` on the cached profile) beside it, the
                 experts' traffic, and one decode step traced (the lanes' busy times and
                 bytes, and per layer when its copies, compute and host waits ran)
    dense        on the same engine, the dense schedule (model-based batching's: every
                 expert fetched for every micro-batch): a prefill and one decode step,
                 beside the cost model's dense prediction
    accelerate   transformers' MixtralForCausalLM dispatched by Accelerate
    cpu-int4     the CPU expert kernel over a Mixtral expert in int4 against the
                 profile's DRAM rate
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

GB = 1e9


class PartRecord:
    """A part's record, rewritten whole after every schedule; `running` names the
    schedule in flight (what a process killed at its limit was doing)."""

    def __init__(self, path: Path, seconds: float) -> None:
        self.path, self.deadline = path, time.monotonic() + seconds
        self.data: dict[str, Any] = {"runs": {}, "running": None}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def start(self, name: str) -> None:
        self.data["running"] = name
        self.save()

    def done(self, name: str, run: dict[str, Any]) -> None:
        self.data["runs"][name] = run
        self.data["running"] = None
        self.save()

    def skip(self, name: str, why: str) -> None:
        self.done(name, {"skipped": why})

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


def fits(record: PartRecord, name: str, needs_s: float | None, margin: float = 1.5) -> bool:
    """Whether `needs_s` (a prediction) times `margin` fits in what is left; else the
    schedule is recorded as skipped."""
    if needs_s is None or needs_s * margin <= record.left():
        return True
    record.skip(
        name, f"time box: predicted {needs_s:.0f} s (x{margin}), {record.left():.0f} s left"
    )
    return False


# -- our engine ----------------------------------------------------------------------------
def run_ours(
    record: PartRecord,
    model: str,
    gpu_mem: str,
    nvme: Path,
    compress: str,
    kv_compress: str,
    prompt_len: int,
    gen_len: int,
    dense: bool,
    dtype: str = "float16",
) -> None:
    """Load `model` once (in `dtype` on a GPU, float32 on the CPU), then ours (and the
    dense schedule where `dense`) on it."""
    import torch

    from offload.api.args import parse_size
    from offload.api.llm import LLM
    from offload.policies.caps import Caps
    from offload.policies.cost import estimate
    from offload.policies.hardware import load_profile

    record.start("load")
    started = time.perf_counter()
    llm = LLM(
        model, dummy=True, caps=Caps(parse_size(gpu_mem)), nvme=nvme, compress=compress,
        kv_compress=kv_compress, prompt_len=prompt_len, gen_len=gen_len,
        dtype=dtype if torch.cuda.is_available() else "float32",
    )  # fmt: skip
    policy, cfg = llm.policy, llm.config
    record.data |= {"model": model, "load_s": time.perf_counter() - started}
    record.data |= {"policy": policy.to_dict() if policy else None, "dtype": str(llm.dtype)}
    hw = load_profile()
    predicted = dense_predicted = None
    if hw is not None and policy is not None:
        predicted = _estimate(estimate(cfg, policy, llm.dtype, prompt_len, gen_len, hw))
        if dense:
            dense_est = estimate(
                cfg, policy, llm.dtype, prompt_len, gen_len, hw, dense_experts=True
            )
            dense_predicted = _estimate(dense_est)
    record.save()
    prompts = _prompts(policy.block_size if policy else 1, prompt_len, cfg.vocab_size)
    try:
        job_s = predicted and predicted["prefill_s"] + (gen_len - 1) * predicted["decode_step_s"]
        if fits(record, "ours", job_s, margin=1.2):
            record.start("ours")
            run = _ours(llm, prompts, gen_len)
            run["against_predicted"] = _against(run, predicted, gen_len - 1)
            record.done("ours", {**run, "predicted_tok_s": _get(predicted, "tok_s"),
                                 "predicted": predicted})  # fmt: skip
        if dense:
            one_step = dense_predicted and dense_predicted["prefill_s"]
            one_step = one_step and one_step + dense_predicted["decode_step_s"]
            if fits(record, "dense", one_step, margin=1.2):
                record.start("dense")
                run = _dense_schedule(llm, prompts, gen_len)
                record.done("dense", {**run, "predicted_tok_s": _get(dense_predicted, "tok_s"),
                                      "predicted": dense_predicted})  # fmt: skip
    finally:
        llm.close()


def _get(d: dict | None, key: str):
    return None if d is None else d.get(key)


def _estimate(est) -> dict[str, Any]:
    return {
        "tok_s": est.total_tok_s,
        "prefill_s": est.prefill_s,
        "decode_step_s": est.decode_step_s,
        "bottleneck": est.bottleneck,
        "lanes_decode_step_s": est.lanes_decode_s,
        "experts": est.experts,
        "gpu_peak_bytes": est.gpu_peak_bytes,
        "cpu_peak_bytes": est.cpu_peak_bytes,
    }


def _prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(0)
    return torch.randint(5, vocab, (count, length), generator=gen).tolist()


def _ours(llm, prompts: list[list[int]], gen_len: int) -> dict[str, Any]:
    """The searched block through `LLM.generate`, one decode step in the middle traced."""
    import torch

    from offload.core.sampling import SamplingParams

    runner = llm.runner
    traced = _trace_one_step(runner, decode_step=max(1, gen_len // 2))
    outs = llm.generate(prompts, SamplingParams(max_tokens=gen_len, ignore_eos=True))
    s = llm.stats
    return {
        "sequences": len(prompts),
        "generated_tokens": sum(len(o.token_ids) for o in outs),
        "prefill_s": s.prefill_seconds,
        "decode_s": s.decode_seconds,
        "decode_step_s": s.decode_seconds / max(1, gen_len - 1),
        "tok_s": s.tokens_per_second,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        "traced_step": traced.get("step"),
        "traced_prefill": traced.get("prefill"),
        "allocator": _allocator(),
        "experts": runner.expert_report() if hasattr(runner, "expert_report") else None,
    }


def _trace_one_step(runner, decode_step: int) -> dict[str, Any]:
    """Trace the next job's prefill and its `decode_step`-th decode step: each one's
    lanes' busy times and bytes (`lanes.busy_seconds`) and each layer's timeline
    (`lanes.layer_timeline`; the host's wait for a layer's routing shows as host_wait);
    the dict fills in as it runs."""
    from offload.executor.lanes import layer_timeline

    out: dict[str, Any] = {}
    if not hasattr(runner, "tracer"):
        return out
    forward, seen = runner.forward, [0]

    def traced(token_ids, step, *a, **k):
        decode = token_ids.shape[1] == 1
        seen[0] += decode
        runner.tracer.enabled = seen[0] == (decode_step if decode else 0)
        try:
            return forward(token_ids, step, *a, **k)
        finally:
            if runner.tracer.enabled:
                last, name = runner.traces[-1], "step" if decode else "prefill"
                spans = runner.last_spans if decode else runner.prefill_spans
                out[name] = {"seconds": last.seconds, "lanes": last.lanes}
                out[name]["layers"] = layer_timeline(spans or [])["rows"]
            runner.tracer.enabled = False

    runner.forward = traced
    return out


def _allocator() -> dict[str, Any] | None:
    """The CUDA caching allocator's peaks and its retries (an allocation that found no
    free block within the cap: every cached block freed, the device synchronized)."""
    import torch

    if not torch.cuda.is_available():
        return None
    stats = torch.cuda.memory_stats()
    return {
        "peak_allocated_bytes": stats.get("allocated_bytes.all.peak"),
        "peak_reserved_bytes": stats.get("reserved_bytes.all.peak"),
        "alloc_retries": stats.get("num_alloc_retries"),
        "ooms": stats.get("num_ooms"),
    }


def _against(run: dict[str, Any], predicted: dict[str, Any] | None, steps: int) -> dict:
    """Where a run's time went against its prediction: its prefill's and its `steps`
    decode steps' seconds, each over the predicted."""
    if not predicted:
        return {}
    decode = steps * predicted["decode_step_s"]
    return {
        "prefill_over_predicted_s": run["prefill_s"] - predicted["prefill_s"],
        "decode_over_predicted_s": run["decode_s"] - decode,
        "prefill_ratio": run["prefill_s"] / predicted["prefill_s"],
        "decode_ratio": run["decode_s"] / decode if decode else None,
    }


def _dense_schedule(llm, prompts: list[list[int]], gen_len: int) -> dict[str, Any]:
    """The same block under the dense schedule: a prefill and one decode step, timed."""
    import torch

    from offload.models.batch import PaddedBatch

    runner = llm.runner
    runner.experts.dense = True
    runner.experts.step_traffic()
    try:
        batch = PaddedBatch(llm.config, prompts, max_new_tokens=2, pad_id=0)
        runner.start(batch)
        started = time.perf_counter()
        runner.forward(batch.prompt_ids, runner.step_inputs(batch, 0, batch.prompt_len))
        prefill_s = time.perf_counter() - started
        token = torch.zeros((len(prompts), 1), dtype=torch.long)
        started = time.perf_counter()
        runner.forward(token, runner.step_inputs(batch, batch.prompt_len, 1))
        step_s = time.perf_counter() - started
        traffic = runner.experts.step_traffic()
    finally:
        runner.experts.dense = False
    seqs = len(prompts)
    return {
        "sequences": seqs,
        "prefill_s": prefill_s,
        "decode_step_s": step_s,
        "decode_tok_s": seqs / step_s,
        "tok_s": seqs * gen_len / (prefill_s + (gen_len - 1) * step_s),
        "h2d_bytes": sum(t.h2d_bytes for t in traffic.values()),
    }


# -- Accelerate ------------------------------------------------------------------------------
def run_accelerate(
    record: PartRecord, hf: dict, prompt_len: int, gen_len: int, gpu: str, batch: int, nvme: Path
) -> None:
    """transformers' Mixtral (config `hf`) under Accelerate's offload at `batch`
    sequences: a prefill and one decode step, timed."""
    import tempfile

    import torch
    from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
    from transformers import MixtralConfig, MixtralForCausalLM

    record.start("accelerate")
    config = MixtralConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    cuda = torch.cuda.is_available()
    dtype = torch.float16 if cuda else torch.float32
    started = time.perf_counter()
    with init_empty_weights():
        model = MixtralForCausalLM(config).to(dtype)
    model.to_empty(device="cpu")
    _fill(model)
    max_memory = {0: gpu, "cpu": "120GiB"} if cuda else {"cpu": "120GiB"}
    device_map = infer_auto_device_map(
        model, max_memory=max_memory, no_split_module_classes=model._no_split_modules, dtype=dtype
    )
    offload = Path(tempfile.mkdtemp(prefix="accelerate-offload-", dir=str(nvme)))
    model = dispatch_model(model, device_map=device_map, offload_dir=str(offload))
    load_s = time.perf_counter() - started
    device = torch.device("cuda" if cuda else "cpu")
    ids = torch.tensor(_prompts(batch, prompt_len, config.vocab_size), device=device)
    with torch.no_grad():
        started = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        _sync()
        prefill_s = time.perf_counter() - started
        token = out.logits[:, -1:].argmax(-1)
        started = time.perf_counter()
        model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
        _sync()
        step_s = time.perf_counter() - started
    record.done("accelerate", {
        "sequences": batch,
        "max_memory": {str(k): v for k, v in max_memory.items()},
        "modules_on_gpu": sum(1 for d in device_map.values() if d == 0),
        "modules": len(device_map),
        "load_s": load_s,
        "prefill_s": prefill_s,
        "decode_step_s": step_s,
        "decode_tok_s": batch / step_s,
        "tok_s": batch * gen_len / (prefill_s + (gen_len - 1) * step_s),
        "predicted_tok_s": None,  # (the cost model is ours alone)
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    })  # fmt: skip


def _fill(model) -> None:
    """Every parameter from a pool of normal values at seeded offsets (drawing 47B values
    one by one took minutes; copying runs at memory speed), the routers drawn whole."""
    import torch

    gen = torch.Generator().manual_seed(0)
    pool = (torch.randn(1 << 26, generator=gen) * 0.02).to(next(model.parameters()).dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.view(-1)
            if "norm" in name:
                flat.fill_(1.0)
                continue
            if name.endswith("gate.weight"):  # a router: its own draw, scaled as ours
                flat.copy_(torch.randn(flat.numel(), generator=gen) / param.shape[-1] ** 0.5)
                continue
            for start in range(0, flat.numel(), pool.numel() // 2):
                n = min(pool.numel() // 2, flat.numel() - start)
                at = int(torch.randint(0, pool.numel() // 2, (1,), generator=gen))
                flat[start : start + n].copy_(pool[at : at + n])


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


# -- the CPU's compressed experts ------------------------------------------------------------
def run_cpu_int4(record: PartRecord, hidden: int, inter: int, copy_bytes: int, rows: int) -> None:
    """`kernels.cpu_expert.cpu_expert_mlp` (the path the executor takes for an expert
    on the CPU) over an int4 expert `hidden` x `inter` at `rows` rows, each call on
    another copy of the expert (`copy_bytes` of copies in all, past the last-level
    cache): weight bytes as stored a second, against the profile's DRAM rate."""
    import torch

    from offload.kernels.cpu_expert import cpu_expert_mlp
    from offload.kernels.formats import Compression
    from offload.kernels.quant import assemble_stage, compress_stage
    from offload.policies.hardware import load_profile

    record.start("cpu-int4")
    compression = Compression(4, 64, False)
    dtype = torch.float16 if torch.cuda.is_available() else torch.float32
    shapes = {"mlp_in.weight": (2 * inter, hidden), "mlp_out.weight": (hidden, inter)}
    gen = torch.Generator().manual_seed(0)
    dense = {n: (torch.randn(s, generator=gen) / s[1] ** 0.5).to(dtype) for n, s in shapes.items()}
    stored = compress_stage(dense, compression)
    nbytes = sum(t.numel() * t.element_size() for t in stored.values())
    copies = []
    for _ in range(max(2, copy_bytes // nbytes)):
        views = assemble_stage(
            {n: t.clone() for n, t in stored.items()}, shapes, dtype, compression
        )
        copies.append((views["mlp_in.weight"], views["mlp_out.weight"]))
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    cpu_expert_mlp(x, *copies[0])  # (a kernel built or loaded once)
    times = []
    for weights in copies * 2:
        started = time.perf_counter()
        cpu_expert_mlp(x, *weights)
        times.append(time.perf_counter() - started)
    times.sort()
    median = times[len(times) // 2]
    hw = load_profile()
    dram = hw.dram_gbps if hw is not None else None
    rate = nbytes / median / GB
    record.done("cpu-int4", {
        "expert": [hidden, inter], "rows": rows, "expert_bytes": nbytes,
        "copies": len(copies), "median_s": median, "best_s": times[0],
        "gbps": rate, "best_gbps": nbytes / times[0] / GB,
        "profile_dram_gbps": dram, "share_of_dram": rate / dram if dram else None,
        "profile_cpu_expert_gbps": hw.cpu_expert_gbps if hw is not None else None,
        "threads": torch.get_num_threads(),
    })  # fmt: skip
