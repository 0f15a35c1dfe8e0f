"""Cost-model validation: measured against predicted, policy by policy, in one run.

    python scripts/validate_cost_model.py --model opt-30b --gpu-mem 24GB [--profile FILE]
    python scripts/validate_cost_model.py --model llama-3.1-8b --gpu-mem 10GB
    python scripts/validate_cost_model.py --model smollm2-135m-instruct --device cpu --gpu-mem 2GB \
        --prompt-len 16 --gen-len 4 --policies w4gpu-kv4-cpu-disk-gpuattn-8x2 --nvme DIR  # smoke
    python scripts/validate_cost_model.py --model opt-6.7b --gpu-mem 8GB \
        --formats fp16,int4,int4kv --gen-lens 32,256 --time-budget 540   # one call of the matrix
    python scripts/validate_cost_model.py --jobs [--time-budget 540]      # whole jobs: validate_jobs.py

For each policy (the hand-written set below, scaled to the model, plus the search's
choice): a full generation of one block with dummy weights, then total tok/s and peak
GPU memory against the cost model's prediction for the same policy and profile. The
profile (device rates and the executor's fixed costs, `executor.probe.measure_profile`)
is measured at the start of the run unless --profile is given. Writes JSON to
benchmarks/results/ (and $OUT) and prints a table. Bounds: throughput within +-20%,
peak GPU within +-10%, no cap exceeded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

from offload.api.decode_loop import DecodeLoop
from offload.cli.common import parse_compression, parse_kv_compression, parse_size
from offload.core.outputs import GenerationStats
from offload.core.sampling import SamplingParams
from offload.executor.executor import Executor
from offload.executor.probe import measure_profile
from offload.io.layout import DISK_BUFFERS
from offload.kernels.formats import Compression
from offload.models.resolve import resolve_model
from offload.policies.caps import Baseline, Caps, cuda_context_bytes, gpu_phase_peaks
from offload.policies.cost import estimate
from offload.policies.hardware import HardwareProfile
from offload.policies.policy import Placement, Policy
from offload.policies.search import search

GB = 1e9


KV4 = Compression(4, 64, False)
W4 = Compression(4, 64, False)


def hand_policies() -> dict[str, Policy]:
    cpu_kv = Placement(0, 1, 0)
    return {
        "w25-kvcpu-cpuattn-16x4": Policy(
            16, 4, weights=Placement(0.25, 0.75, 0), kv_cache=cpu_kv, attention_on_cpu=True
        ),
        "w25-kvcpu-gpuattn-16x4": Policy(16, 4, weights=Placement(0.25, 0.75, 0), kv_cache=cpu_kv),
        "w25-kvcpu-cpuattn-8x8": Policy(
            8, 8, weights=Placement(0.25, 0.75, 0), kv_cache=cpu_kv, attention_on_cpu=True
        ),
        "w15-kv10gpu-gpuattn-32x2": Policy(
            32, 2, weights=Placement(0.15, 0.85, 0), kv_cache=Placement(0.1, 0.9, 0)
        ),
        "w0-kvcpu-cpuattn-48x1": Policy(
            48, 1, weights=Placement(0, 1, 0), kv_cache=cpu_kv, attention_on_cpu=True
        ),
        # an int4-g64 cache in CPU homes: a quarter of the KV bytes cross PCIe or are
        # attended on the CPU; the same policies as above otherwise
        "w25-kv4cpu-gpuattn-16x4": Policy(
            16, 4, weights=Placement(0.25, 0.75, 0), kv_cache=cpu_kv, kv_compression=KV4
        ),
        "w25-kv4cpu-cpuattn-16x4": Policy(
            16,
            4,
            weights=Placement(0.25, 0.75, 0),
            kv_cache=cpu_kv,
            attention_on_cpu=True,
            kv_compression=KV4,
        ),
        # int4 weights all on the GPU, one sequence of each micro-batch's KV on disk:
        # an uncompressed cache and an int4-g64 one in the same homes (disk-bound steps)
        "w4gpu-kv-cpu-disk-gpuattn-8x2": Policy(
            8, 2, kv_cache=Placement(0, 0.875, 0.125), weight_compression=W4
        ),
        "w4gpu-kv4-cpu-disk-gpuattn-8x2": Policy(
            8, 2, kv_cache=Placement(0, 0.875, 0.125), weight_compression=W4, kv_compression=KV4
        ),
        # its twin with every row's KV in CPU homes: what the disk rows add
        "w4gpu-kv4-cpu-gpuattn-8x2": Policy(
            8, 2, kv_cache=cpu_kv, weight_compression=W4, kv_compression=KV4
        ),
    }


def measure_policy(
    spec,
    policy: Policy,
    dtype,
    device,
    prompt_len: int,
    gen_len: int,
    cuda_graphs: bool = True,
    disk_buffers: int = DISK_BUFFERS,
    nvme_dir: Path | None = None,
    switch_interval: float | None = None,
) -> dict:
    """One block generated as `offload-run` generates it: the executor warmed up as the
    engine warms it (`Executor.warm_up`), then the engine's own loop (`DecodeLoop`:
    greedy, EOS ignored, steps issued ahead where it does that), so the measurement is
    what a user's job gets. disk_buffers, nvme_dir (where KV spills; None: the working
    directory): `Executor`'s. switch_interval: the interpreter's thread switch interval
    while the executor runs (None: the one the executor sets, `spill.SWITCH_INTERVAL_S`).

    Peak GPU memory by phase: while the weights load (the executor's construction) and
    during the timed generation, each with the CUDA context."""
    cfg = spec.config
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    ex = Executor(
        spec.open_weights(),
        policy,
        dtype,
        device,
        nvme_dir=nvme_dir,
        cuda_graphs=cuda_graphs,
        disk_buffers=disk_buffers,
    )
    if switch_interval is not None:  # (the executor puts the process's back at close)
        sys.setswitchinterval(switch_interval)
    # each phase's time as it ends: a run cut off by the call's limit still tells where
    # its time went (a 70B-class load and block can outlast one call)
    print(f"  weights placed in {time.perf_counter() - began:.1f} s", flush=True)
    load_peak = 0
    if device.type == "cuda":
        load_peak = torch.cuda.max_memory_allocated() + cuda_context_bytes(device)
    try:
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(
            10, cfg.vocab_size - 10, (policy.block_size, prompt_len), generator=gen
        ).tolist()
        stats = GenerationStats()
        loop = DecodeLoop(cfg, spec.tokenizer(), set(), stats, lambda phase: None, device)

        def generate(runner: Executor, tokens: int) -> None:
            params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
            loop.run(runner, [(ids, params) for ids in prompts], policy.block_size)

        ex.warm_up()
        if policy.weight_compression is not None or policy.kv_compression is not None:
            # Triton compiles a kernel per shape class it meets (about a second each, once
            # per process): an untimed block of a few tokens at the real shapes, so the
            # timing is the steady state. Not a whole generation: a 70B-class block's
            # would not fit one 10-minute GPU call beside the timed one
            generate(ex, min(gen_len, 4))
            print(f"  warmed up at {time.perf_counter() - began:.1f} s", flush=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = dataclasses.replace(stats)
        generate(ex, gen_len)
        prefill = stats.prefill_seconds - before.prefill_seconds
        decode = stats.decode_seconds - before.decode_seconds
        print(f"  timed prefill {prefill:.1f} s", flush=True)
        peak = 0
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated() + cuda_context_bytes(device)
        return {
            "total_tok_s": policy.block_size * gen_len / (prefill + decode),
            "prefill_s": prefill,
            "decode_s": decode,
            "decode_step_s": decode / max(gen_len - 1, 1),
            "peak_gpu_bytes": peak,
            "load_peak_gpu_bytes": load_peak,
        }
    finally:
        ex.close()
        del ex
        if device.type == "cuda":
            torch.cuda.empty_cache()


# the searches of --formats: (--compress, --kv-compress)
FORMATS = {"fp16": ("none", "none"), "int4": ("int4", "none"), "int4kv": ("int4", "int4")}


def main() -> None:
    if "--jobs" in sys.argv[1:]:  # whole jobs through offload-run, and the hold's A/B
        sys.argv.remove("--jobs")
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import validate_jobs

        sys.exit(validate_jobs.main())
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="opt-30b")
    p.add_argument("--gpu-mem", default="24GB")
    p.add_argument("--cpu-mem", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--profile", type=Path)
    p.add_argument("--compress", default="none", help="formats the search may use (auto: any)")
    p.add_argument("--kv-compress", default="none", help="KV formats the search may use")
    p.add_argument(
        "--formats",
        help="comma-separated searches, each its own run: fp16, int4 (weights), int4kv "
        "(weights and KV); instead of --compress/--kv-compress",
    )
    p.add_argument("--gen-lens", help="comma-separated generation lengths (default: --gen-len)")
    p.add_argument(
        "--time-budget",
        type=float,
        help="seconds for all runs: a run whose predicted time (x 1.5, + 60 s to load) "
        "does not fit in what is left is recorded as skipped",
    )
    p.add_argument(
        "--policies", help="comma-separated subset of the policies (hand names, searched)"
    )
    p.add_argument(
        "--eager",
        action="store_true",
        help="also run each policy without CUDA graphs (named '<policy> eager')",
    )
    p.add_argument(
        "--nvme",
        type=Path,
        help="where disk plans spill KV (default: the working directory); give the "
        "directory the profile's disk figures were measured in (offload-profile --nvme)",
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    began = time.perf_counter()
    device = torch.device(args.device)
    spec = resolve_model(args.model, dummy=True)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    hw = HardwareProfile.from_file(args.profile) if args.profile else measure_profile(None)
    print(f"profile at {time.perf_counter() - began:.1f} s", flush=True)
    caps = Caps(
        parse_size(args.gpu_mem),
        parse_size(args.cpu_mem) if args.cpu_mem else hw.default_cpu_cap,
        False,
    )
    policies = hand_policies()
    if device.type == "cpu":  # smoke run: small blocks
        policies = {
            k: Policy(
                2, 2, weights=v.weights, kv_cache=v.kv_cache, attention_on_cpu=v.attention_on_cpu
            )
            for k, v in policies.items()
        }
    searches = (
        {f"searched {f}": FORMATS[f] for f in args.formats.split(",")}
        if args.formats
        else {"searched": (args.compress, args.kv_compress)}
    )
    if device.type == "cpu":
        searches = {}
    gen_lens = [int(g) for g in args.gen_lens.split(",")] if args.gen_lens else [args.gen_len]
    # the search plans for each generation length (its KV, so its batch, differs)
    runs = []
    for gen_len in gen_lens:
        searched = {
            name: search(
                spec.config,
                dtype,
                args.prompt_len,
                gen_len,
                hw,
                caps,
                compressions=parse_compression(weights),
                kv_compressions=parse_kv_compression(kv),
            ).policy
            for name, (weights, kv) in searches.items()
        }
        for name, policy in {**searched, **policies}.items():
            if args.policies and name not in args.policies.split(","):
                continue
            runs.append((name, policy, gen_len, True))
            if args.eager:
                runs.append((f"{name} eager", policy, gen_len, False))
    print(f"searched at {time.perf_counter() - began:.1f} s", flush=True)
    res = {
        "model": args.model,
        "profile": json.loads(hw.to_json()),
        "gpu_mem": args.gpu_mem,
        "runs": {},
    }
    stamp = time.strftime("%Y%m%d-%H%M%S")
    outdir = Path(os.environ.get("OUT", args.out))
    outdir.mkdir(parents=True, exist_ok=True)
    for base, policy, gen_len, graphs in runs:
        name = base if len(gen_lens) == 1 else f"{base} @ gen {gen_len}"
        left = (
            None if args.time_budget is None else args.time_budget - (time.perf_counter() - began)
        )
        res["runs"][name] = _run_one(
            spec, policy, dtype, device, args, gen_len, graphs, hw, caps, left
        )
        (outdir / f"validate_cost_model_{stamp}.json").write_text(json.dumps(res, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"validate_cost_model_{stamp}.json").write_text(json.dumps(res, indent=1))
    _report(res)


def _run_one(spec, policy, dtype, device, args, gen_len, graphs, hw, caps, left) -> dict:
    """One policy at one generation length, measured against its prediction (or why not:
    over the GPU cap by the plan, or not in the `left` seconds of the time budget)."""
    pred = estimate(spec.config, policy, dtype, args.prompt_len, gen_len, hw)
    if device.type == "cuda" and pred.gpu_peak_bytes > caps.gpu_bytes:
        return {"policy": policy.to_dict(), "skipped": "predicted over the GPU cap"}
    need = 60 + 1.5 * policy.block_size * gen_len / pred.total_tok_s
    if left is not None and need > left:
        return {
            "policy": policy.to_dict(),
            "skipped": f"time budget: about {need:.0f} s needed, {left:.0f} s left",
        }
    got = measure_policy(
        spec, policy, dtype, device, args.prompt_len, gen_len, cuda_graphs=graphs,
        nvme_dir=args.nvme,
    )  # fmt: skip
    print(f"measured {got['total_tok_s']:.2f} tok/s, predicted {pred.total_tok_s:.2f}", flush=True)
    # each phase's peak against the plan's for that phase: a plan whose load phase is
    # its larger (int4 weights quantized on the GPU as they load) says nothing through
    # the run's peak about the run's own parts
    load_plan, run_plan = gpu_phase_peaks(pred.memory, Baseline.from_profile(hw))
    return {
        "policy": policy.to_dict(),
        "gen_len": gen_len,
        "measured": got,
        "predicted": {
            "total_tok_s": pred.total_tok_s,
            "prefill_s": pred.prefill_s,
            "decode_step_s": pred.decode_step_s,
            "peak_gpu_bytes": pred.gpu_peak_bytes,
            "run_gpu_bytes": run_plan,
            "load_gpu_bytes": load_plan,
            "bottleneck": pred.bottleneck,
        },
        "throughput_error": got["total_tok_s"] / pred.total_tok_s - 1,
        "gpu_memory_error": got["peak_gpu_bytes"] / run_plan - 1 if got["peak_gpu_bytes"] else None,
        "load_memory_error": got["load_peak_gpu_bytes"] / load_plan - 1
        if got["load_peak_gpu_bytes"]
        else None,
        "within_cap": max(got["peak_gpu_bytes"], got["load_peak_gpu_bytes"]) <= caps.gpu_bytes,
    }


def _report(res: dict) -> None:
    """The table, then each searched policy's rank among the runs at its generation length."""
    print(
        f"\n{'policy':36s} {'measured':>9s} {'predicted':>9s} {'error':>7s} "
        f"{'GPU GB: run':>11s} {'plan':>5s} {'load':>5s} {'plan':>5s}"
    )
    for name, r in res["runs"].items():
        if "skipped" in r:
            print(f"{name:36s} skipped: {r['skipped']}")
            continue
        m, pr = r["measured"], r["predicted"]
        print(
            f"{name:36s} {m['total_tok_s']:9.2f} {pr['total_tok_s']:9.2f} {100 * r['throughput_error']:+6.1f}% "
            f"{m['peak_gpu_bytes'] / GB:11.1f} {pr['run_gpu_bytes'] / GB:5.1f} "
            f"{m['load_peak_gpu_bytes'] / GB:5.1f} {pr['load_gpu_bytes'] / GB:5.1f}"
        )
    # issue 20: a searched plan is at least as fast as any hand one measured beside it
    measured = {n: r for n, r in res["runs"].items() if "measured" in r}
    for name, r in measured.items():
        if name.startswith("searched"):
            peers = [m for m in measured.values() if m["gen_len"] == r["gen_len"]]
            rank = 1 + sum(
                m["measured"]["total_tok_s"] > r["measured"]["total_tok_s"] for m in peers
            )
            print(f"{name}: rank {rank} of {len(peers)} measured at gen {r['gen_len']}")


if __name__ == "__main__":
    main()
