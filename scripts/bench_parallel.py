"""Tensor-parallel throughput: TP=1 then TP=2, same call, same caps, searched policy.

    python scripts/bench_parallel.py            # on nvidia-h200-x2 (two GPUs, NCCL)
    python scripts/bench_parallel.py --smoke    # CPU, a tiny model, two ranks over gloo

Runs OPT-30B fp16 and BLOOM-176B with int4 weights and KV (dummy weights), prompt 512,
generate 32, --gpu-mem 24GB per GPU, the node's CPU memory (cgroup limit) shared by
the ranks. The policy is the plan search's for one rank's shard (`rank_config`). The
ranks start through torch.distributed's elastic launcher, one per GPU. Reports per
configuration: tok/s, the block (batch), the all-reduce share of the decode time,
the measured all-reduce bus bandwidth, and every rank's lanes over a traced decode
step; writes benchmarks/results/bench_parallel_<stamp>.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from offload.cli.common import parse_size  # noqa: E402
from offload.core.config import ModelConfig  # noqa: E402
from offload.core.sampling import SamplingParams, sample  # noqa: E402
from offload.models.batch import PaddedBatch  # noqa: E402
from offload.models.resolve import ModelSpec, resolve_model  # noqa: E402
from offload.parallel.comm import Topology, allreduce_bus_gbps  # noqa: E402
from offload.parallel.rank import make_rank_runner, rank_nvme  # noqa: E402
from offload.parallel.shard import rank_config  # noqa: E402
from offload.policies.caps import process_rss  # noqa: E402
from offload.policies.choose import choose_policy  # noqa: E402
from offload.policies.memory_limit import node_memory_limit, rank_cpu_bytes  # noqa: E402
from offload.policies.policy import Compression, Placement, Policy  # noqa: E402

GB = 1e9
INT4 = Compression(4, 64)
# name -> (model preset, dtype, weight compression, KV compression)
CONFIGS = {
    "opt-30b-fp16": ("opt-30b", torch.float16, None, None),
    "bloom-176b-int4-wkv": ("bloom", torch.float16, INT4, INT4),
}
TARGETS = {"opt-30b-fp16": "TP=2 >= 1.8x TP=1", "bloom-176b-int4-wkv": "TP=2 >= 40 tok/s"}
SMOKE_CONFIG = ModelConfig("smoke-opt", "opt", 512, 128, 4, 8, 8, 16, 384, 256, 1e-5)


def _spec(preset: str, smoke: bool) -> ModelSpec:
    if smoke:
        return ModelSpec("smoke-opt", SMOKE_CONFIG, "dummy")
    return resolve_model(preset, dummy=True)


def _policy(topo: Topology, spec: ModelSpec, args, dtype, wc, kc) -> Policy:
    """World rank 0 searches one rank's shard under the per-rank caps; all run it."""
    if args.smoke:
        return Policy(gpu_batch_size=2, num_gpu_batches=2, weights=Placement(0.4, 0.3, 0.3))
    policy = None
    if topo.rank == 0:  # the plan search LLM runs, over one rank's shard and caps
        node_cpu, _ = node_memory_limit()
        policy = choose_policy(
            rank_config(spec.config, topo.tp, 0),
            dtype,
            parse_size(args.gpu_mem),
            rank_cpu_bytes(int(0.9 * node_cpu), topo.local_world),
            args.nvme,
            args.prompt_len,
            args.gen_len,
            args.profile,
            compressions=(wc,),
            kv_compressions=(kc,),
        ).best.policy
    return topo.share(policy)


def bench_rank(name: str, args: argparse.Namespace) -> dict:
    """One rank of one configuration (the elastic launcher's entry point)."""
    preset, dtype, wc, kc = CONFIGS[name]
    device = torch.device(args.smoke_device if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke and device.type == "cpu" else dtype
    topo = Topology.from_env(None, 1, device)
    spec = _spec(preset, args.smoke)
    parallel = topo.tensor_parallel(spec.config, timing=True)
    bus_gbps = allreduce_bus_gbps(topo.tp_group, topo.device) if topo.tp > 1 else None
    policy = _policy(topo, spec, args, dtype, wc, kc)
    started = time.perf_counter()
    with spec.open_weights() as source:
        runner = make_rank_runner(
            source, parallel, policy, dtype, topo.device, rank_nvme(args.nvme, topo.rank), True
        )
    load_s = time.perf_counter() - started
    try:
        result = _generate(runner, parallel, policy, args, spec.config.vocab_size)
    finally:
        runner.close()
        topo.close()
    return {
        "rank": topo.rank,
        "policy": policy.to_dict(),
        "load_s": load_s,
        "allreduce_bus_gbps": bus_gbps,
        "peak_rss_bytes": process_rss(),
        **result,
    }


def _generate(runner, parallel, policy: Policy, args, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    rows = policy.block_size
    prompts = torch.randint(10, vocab - 10, (rows, args.prompt_len), generator=gen).tolist()
    batch = PaddedBatch(runner.executor.cfg, prompts, args.gen_len, pad_id=1)
    greedy = SamplingParams(max_tokens=args.gen_len)
    runner.tracer.enabled = False

    def run(trace_last: bool) -> tuple[float, float, list[list[int]]]:
        runner.start(batch)
        _sync(runner)
        started = time.perf_counter()
        logits = runner.forward(batch.prompt_ids, runner.step_inputs(batch, 0, args.prompt_len))
        _sync(runner)
        prefill_s = time.perf_counter() - started
        parallel.take_reduce_seconds()
        parallel.reduce_count = 0
        tokens = [sample(logits, greedy)]
        started = time.perf_counter()
        for t in range(args.gen_len - 1):
            runner.tracer.enabled = trace_last and t == args.gen_len - 2
            step = runner.step_inputs(batch, args.prompt_len + t, 1)
            logits = runner.forward(tokens[-1][:, None], step)
            tokens.append(sample(logits, greedy))
        _sync(runner)
        runner.tracer.enabled = False
        return prefill_s, time.perf_counter() - started, torch.stack(tokens, 1).tolist()

    run(False)  # warm-up: allocator, Triton's compiles, NCCL's channels
    prefill_s, decode_s, tokens = run(True)
    reduce_s = parallel.take_reduce_seconds()
    decode_reduces = parallel.reduce_count
    traced = runner.traces[-1]
    return {
        "sequences": rows,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "total_tok_s": rows * args.gen_len / (prefill_s + decode_s),
        "decode_tok_s": rows * (args.gen_len - 1) / decode_s,
        "allreduce_s_decode": reduce_s,
        "allreduce_share_decode": reduce_s / decode_s,
        "allreduces_per_decode_step": decode_reduces / (args.gen_len - 1),
        "traced_step_s": traced.seconds,
        "lanes": {
            lane: {**s, "gbps": s["bytes"] / s["busy_s"] / GB if s["busy_s"] else 0.0}
            for lane, s in traced.lanes.items()
        },
        "tokens_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest(),
        "tokens": tokens if args.smoke else None,
    }


def _sync(runner) -> None:
    if runner.executor.device.type == "cuda":
        torch.cuda.synchronize(runner.executor.device)


def launch(name: str, tp: int, args) -> list[dict]:
    """All ranks of one configuration; their results in rank order."""
    from torch.distributed.launcher.api import elastic_launch

    from offload.parallel.launch import local_config

    fork = args.smoke and args.smoke_device == "cpu"
    results = elastic_launch(local_config(tp, fork, "bench"), entrypoint=bench_rank)(name, args)
    return [results[rank] for rank in sorted(results)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, gloo (correctness)")
    p.add_argument(
        "--smoke-device",
        default="cpu",
        help="cuda: the smoke run's ranks share the GPUs there are, over gloo "
        "(OFFLOAD_DIST_BACKEND=gloo is set)",
    )
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--tp", default="1,2", help="TP sizes to run, in order")
    p.add_argument("--gpu-mem", default="24GB", help="GPU memory cap per GPU")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--profile", type=Path, help="hardware profile JSON (default: cached)")
    p.add_argument("--nvme", type=Path, help="a fast-disk directory (per-rank stores)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args()
    if args.smoke:
        args.prompt_len, args.gen_len = 32, 4
        if args.smoke_device != "cpu":
            os.environ["OFFLOAD_DIST_BACKEND"] = "gloo"
        args.configs = args.configs if args.configs != ",".join(CONFIGS) else "opt-30b-fp16"
        if args.nvme is None:
            import tempfile

            args.nvme = Path(tempfile.mkdtemp(prefix="bench-parallel-"))
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()
    res: dict = {
        "machine": platform.node(),
        "smoke": args.smoke,
        "git_commit": commit,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "prompt_len": args.prompt_len,
        "gen_len": args.gen_len,
        "gpu_mem_cap_per_gpu": args.gpu_mem,
        "cpu_limit": node_memory_limit(),
        "targets": TARGETS,
        "runs": {},
    }
    for name in args.configs.split(","):
        res["runs"][name] = {}
        for tp in (int(t) for t in args.tp.split(",")):
            ranks = launch(name, tp, args)
            head = ranks[0]
            summary = {
                "total_tok_s": head["total_tok_s"],
                "decode_tok_s": head["decode_tok_s"],
                "sequences": head["sequences"],
                "allreduce_share_decode": max(r["allreduce_share_decode"] for r in ranks),
                "allreduce_bus_gbps": head["allreduce_bus_gbps"],
                "ranks": ranks,
            }
            res["runs"][name][f"tp{tp}"] = summary
            print(
                f"{name} TP={tp}: {summary['total_tok_s']:.1f} tok/s, block "
                f"{summary['sequences']}, all-reduce {summary['allreduce_share_decode']:.1%} "
                f"of decode, bus {summary['allreduce_bus_gbps'] or 0:.1f} GB/s",
                flush=True,
            )
        runs = res["runs"][name]
        if "tp1" in runs and "tp2" in runs:
            runs["speedup_tp2"] = runs["tp2"]["total_tok_s"] / runs["tp1"]["total_tok_s"]
            if args.smoke:  # the same tokens at TP=1 and TP=2
                same = runs["tp1"]["ranks"][0]["tokens"] == runs["tp2"]["ranks"][0]["tokens"]
                runs["tokens_identical"] = same
                assert same, f"{name}: TP=2 tokens differ from TP=1"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bench_parallel_{'smoke_' if args.smoke else ''}{stamp}.json"
    path.write_text(json.dumps(res, indent=1, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
