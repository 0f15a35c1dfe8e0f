"""Executor benchmark: OPT-30B dummy fp16, prompt 512, gen 32, GPU capped at 24 GB.

    python scripts/bench_executor.py [--model opt-30b] [--gpu-mem 24GB] [--policies A,B]
    python scripts/bench_executor.py --policies D-w4-kv-cpu-disk-gpu-attn,E-w4-kv4-cpu-disk-gpu-attn

In one run: the ceilings this step depends on (pinned host -> GPU copy, CPU attention
over a CPU-resident KV cache at the run's shapes, the disk where a policy spills KV),
then full generation runs under
hand-written policies sharing one weight placement (built once), each reporting
prefill, decode and total tokens/s, per-lane busy time and bandwidth of a traced
decode step, overlap efficiency (busiest lane / step), and measured peak memory.
Writes JSON to benchmarks/results/ (and $OUT) and the trace of one decode step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from offload.cli.common import parse_size
from offload.core.sampling import SamplingParams, sample
from offload.executor.executor import Executor
from offload.executor.kv import KVManager
from offload.io.layout import DISK_BUFFERS
from offload.kernels.formats import Compression
from offload.models.batch import PaddedBatch
from offload.models.resolve import resolve_model
from offload.policies.caps import (
    Baseline,
    Caps,
    check_block_fits,
    check_weights_fit,
    cuda_context_bytes,
    process_rss,
)
from offload.policies.measure_disk import disk_rates
from offload.policies.memory import plan_memory
from offload.policies.policy import Placement, Policy

GB = 1e9
WEIGHTS = Placement(0.25, 0.75, 0.0)
W4 = Compression(4, 64, False)  # int4-g64 weights; the same format for a KV cache
DISK_KV = Policy(
    gpu_batch_size=8,
    num_gpu_batches=2,
    weights=Placement(1, 0, 0),
    kv_cache=Placement(0, 0.875, 0.125),
    weight_compression=W4,
)
POLICIES = {
    "A-kv-cpu-cpu-attn": Policy(
        gpu_batch_size=16,
        num_gpu_batches=4,
        weights=WEIGHTS,
        kv_cache=Placement(0, 1, 0),
        attention_on_cpu=True,
    ),
    "B-kv-cpu-gpu-attn": Policy(
        gpu_batch_size=16,
        num_gpu_batches=4,
        weights=WEIGHTS,
        kv_cache=Placement(0, 1, 0),
        attention_on_cpu=False,
    ),
    "C-kv-cpu-cpu-attn-80": Policy(
        gpu_batch_size=20,
        num_gpu_batches=4,
        weights=WEIGHTS,
        kv_cache=Placement(0, 1, 0),
        attention_on_cpu=True,
    ),
    # int4 weights all on the GPU, one sequence of each micro-batch's KV on disk: an
    # uncompressed cache, and (E) an int4-g64 one in the same homes (disk-bound steps)
    "D-w4-kv-cpu-disk-gpu-attn": DISK_KV,
    "E-w4-kv4-cpu-disk-gpu-attn": dataclasses.replace(DISK_KV, kv_compression=W4),
}


def h2d_peak(nbytes: int = 2**30) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * nbytes / (time.perf_counter() - started) / GB


def cpu_attention_rate(cfg, rows: int, slots: int, dtype: torch.dtype) -> float:
    """GB/s of KV that the executor's CPU attention reads at one micro-batch's shape."""
    k = torch.randn(rows, cfg.num_kv_heads, slots, cfg.head_dim).to(dtype)
    v = torch.randn_like(k)
    q = torch.randn(rows, cfg.num_heads, 1, cfg.head_dim).to(dtype)
    bias = torch.zeros(rows, 1, 1, slots, dtype=dtype)
    F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    started = time.perf_counter()
    for _ in range(5):
        F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    return 5 * 2 * k.numel() * k.element_size() / (time.perf_counter() - started) / GB


def run_policy(
    ex: Executor, policy: Policy, prompt_len: int, gen_len: int, trace_path: Path | None
) -> dict:
    cfg = ex.cfg
    batch_size = policy.block_size
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(
        10, cfg.vocab_size - 10, (batch_size, prompt_len), generator=gen
    ).tolist()
    batch = PaddedBatch(cfg, prompts, gen_len, pad_id=1)
    greedy = SamplingParams(max_new_tokens=gen_len)
    ex.tracer.enabled = False
    if policy.weight_compression is not None or policy.kv_compression is not None:
        # Triton compiles a kernel per shape class it meets: a whole warm-up generation
        ex.start(batch)
        logits = ex.forward(batch.prompt_ids, ex.step_inputs(batch, 0, prompt_len))
        for t in range(gen_len - 1):
            ids = sample(logits, greedy)
            logits = ex.forward(ids[:, None], ex.step_inputs(batch, prompt_len + t, 1))
    torch.cuda.reset_peak_memory_stats()
    ex.start(batch)
    torch.cuda.synchronize()
    started = time.perf_counter()
    logits = ex.forward(batch.prompt_ids, ex.step_inputs(batch, 0, prompt_len))
    prefill_s = time.perf_counter() - started
    started = time.perf_counter()
    step_times = []
    for t in range(gen_len - 1):
        ids = sample(logits, greedy)
        if t == gen_len - 2:
            ex.tracer.enabled = True
        t0 = time.perf_counter()
        logits = ex.forward(ids[:, None], ex.step_inputs(batch, prompt_len + t, 1))
        step_times.append(time.perf_counter() - t0)
        ex.tracer.enabled = False
    sample(logits, greedy)
    decode_s = time.perf_counter() - started
    traced = ex.traces[-1]
    if trace_path is not None:
        ex.tracer.enabled = True
        ex.tracer.write_chrome(trace_path)
        ex.tracer.enabled = False
    lane, busy = traced.busiest
    peak_gpu = torch.cuda.max_memory_allocated() + cuda_context_bytes(torch.device("cuda"))
    plan = plan_memory(cfg, policy, ex.dtype, prompt_len, gen_len)
    lanes = {
        name: {**stats, "gbps": stats["bytes"] / stats["busy_s"] / GB if stats["busy_s"] else 0.0}
        for name, stats in traced.lanes.items()
    }
    return {
        "policy": policy.to_dict(),
        "sequences": batch_size,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "prefill_tok_s": batch_size * prompt_len / prefill_s,
        "decode_tok_s": batch_size * (gen_len - 1) / decode_s,
        "total_tok_s": batch_size * gen_len / (prefill_s + decode_s),
        "decode_step_s_median": sorted(step_times)[len(step_times) // 2],
        "traced_step_s": traced.seconds,
        "lanes": lanes,
        "busiest_lane": lane,
        "overlap_efficiency": busy / traced.seconds,
        "peak_gpu_bytes": peak_gpu,
        "predicted_gpu_bytes": plan.gpu_bytes + cuda_context_bytes(torch.device("cuda")),
        "peak_rss_bytes": process_rss(),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="opt-30b")
    p.add_argument("--gpu-mem", default="24GB")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--policies", default=",".join(list(POLICIES)[:3]))  # A, B, C
    p.add_argument("--nvme", type=Path, default=Path("."), help="where KV spills to disk")
    p.add_argument(
        "--disk-buffers",
        default=str(DISK_BUFFERS),
        help="disk staging blocks of the KV manager; a list (2,4,2,4) runs each disk "
        "policy once per entry",
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    device = torch.device("cuda")
    spec = resolve_model(args.model, dummy=True)
    cfg = spec.config
    dtype = torch.float16
    caps = Caps(gpu_bytes=parse_size(args.gpu_mem), nvme=args.nvme is not None)
    base = Baseline.measure(device)
    names = args.policies.split(",")
    first = POLICIES[names[0]]
    res: dict = {
        "machine": platform.node(),
        "gpu": torch.cuda.get_device_name(),
        "cpu_threads": torch.get_num_threads(),
        "model": args.model,
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "gpu_mem_cap": args.gpu_mem,
        "ceiling_h2d_gbps": h2d_peak(),
        "ceiling_cpu_attention_gbps": {
            str(dt): cpu_attention_rate(
                cfg, first.gpu_batch_size, args.prompt_len + args.gen_len, dt
            )
            for dt in (torch.float16, torch.bfloat16, torch.float32)
        },
        "runs": {},
    }
    if any(POLICIES[name].kv_cache.disk for name in names):  # where the spill file goes
        read, write = disk_rates(args.nvme, 2**30)
        res["ceiling_disk_gbps"] = {"read": read, "write": write}
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=1), flush=True)
    check_weights_fit(cfg, first, dtype, device, caps, base)
    started = time.perf_counter()
    ex = Executor(spec.open_weights(), first, dtype, device, trace=False)
    res["setup_s"] = time.perf_counter() - started
    print(f"weights placed in {res['setup_s']:.1f} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    outdir = Path(os.environ.get("OUT", args.out))
    depths = [int(n) for n in args.disk_buffers.split(",")]
    runs = [
        (name if len(depths) == 1 else f"{name} disk-buffers={n} #{i}", name, n)
        for name in names
        for i, n in enumerate(depths if POLICIES[name].kv_cache.disk else depths[:1])
    ]
    for key, name, buffers in runs:
        policy = POLICIES[name]
        assert (policy.weights, policy.weight_compression) == (
            first.weights,
            first.weight_compression,
        ), "policies in one run share the weight placement and format"
        try:
            check_block_fits(cfg, policy, dtype, device, caps, base, args.prompt_len, args.gen_len)
        except Exception as exc:  # a refused policy is a result too
            res["runs"][key] = {"refused": str(exc)}
            print(key, "refused:", exc, flush=True)
            continue
        ex.policy = policy
        ex.kv.close()
        ex.kv = KVManager(
            cfg,
            ex.lanes,
            device,
            dtype,
            ex.ledger,
            args.nvme,
            policy.attention_on_cpu,
            policy.overlap,
            policy.kv_compression,
            buffers,
        )
        trace_path = outdir / f"trace_{name}.json"
        res["runs"][key] = run_policy(ex, policy, args.prompt_len, args.gen_len, trace_path)
        r = res["runs"][key]
        r["disk_buffers"] = buffers
        print(
            f"{key}: total {r['total_tok_s']:.1f} tok/s (prefill {r['prefill_tok_s']:.0f}, decode "
            f"{r['decode_tok_s']:.1f}); step {r['traced_step_s'] * 1e3:.0f} ms, busiest "
            f"{r['busiest_lane']}, overlap {r['overlap_efficiency']:.2f}; peak GPU "
            f"{r['peak_gpu_bytes'] / GB:.1f} GB (predicted {r['predicted_gpu_bytes'] / GB:.1f})",
            flush=True,
        )
        (outdir / f"bench_executor_{stamp}.json").write_text(json.dumps(res, indent=1))
    ex.close()
    (args.out / f"bench_executor_{stamp}.json").write_text(json.dumps(res, indent=1))
    (outdir / f"bench_executor_{stamp}.json").write_text(json.dumps(res, indent=1))
    print(
        f"\n{'policy':24s} {'seqs':>5s} {'total':>7s} {'prefill':>8s} {'decode':>7s} {'overlap':>7s} {'busiest':>9s} {'GPU GB':>7s}"
    )
    for name, r in res["runs"].items():
        if "refused" in r:
            print(f"{name:24s} refused")
            continue
        print(
            f"{name:24s} {r['sequences']:5d} {r['total_tok_s']:7.1f} {r['prefill_tok_s']:8.0f} "
            f"{r['decode_tok_s']:7.1f} {r['overlap_efficiency']:7.2f} {r['busiest_lane']:>9s} "
            f"{r['peak_gpu_bytes'] / GB:7.1f}"
        )
        for lane, stats in r["lanes"].items():
            print(f"    {lane:9s} {stats['busy_s'] * 1e3:8.1f} ms {stats['gbps']:7.2f} GB/s")


if __name__ == "__main__":
    main()
