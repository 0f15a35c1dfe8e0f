"""Mixtures of experts offloaded on one GPU: experts by module against the dense schedule
and Accelerate (issue 60).

Mixtral-8x7B (preset mixtral-8x7b), dummy weights, prompt 512, 32 new tokens, --gpu-mem
24GB, the searched plan, a job of one full block. Parts, in order of importance, each
a subprocess with its own timeout inside --time-budget (a part that cannot finish in
what is left is skipped):
    profile      offload-profile --quick (the cost model's rates, the expert figures and
                 the ceilings of this run: pinned PCIe, disk, DRAM, the CPU expert rate)
    mixtral      ours, fp16: one searched block of 32 tokens (a decode step in the middle
                 traced: the bytes each lane moved); then on the same loaded engine the
                 dense schedule (every expert fetched for every micro-batch, as
                 model-based batching runs it): a prefill and one decode step
    accelerate   transformers' MixtralForCausalLM dispatched by Accelerate
                 (infer_auto_device_map with max_memory, offload_dir) at the batch that
                 fits the cap: a prefill and one decode step, timed
    qwen3-235b   qwen3-235b-a22b int4 weights and KV, --nvme, the machine's RAM: a short
                 job (4 new tokens) over one searched block
    mixtral-int4 ours with compression allowed (--compress auto --kv-compress auto)
Each of ours records the prediction (and the dense schedule's), the experts' traffic
(moved, resident, computed on the CPU, bytes) and a decode step against its roofline
(the traced lanes' bytes over the ceilings measured here).

    python3 scripts/bench_moe.py                 # the GPU machine: about 9 minutes
    python3 scripts/bench_moe.py --parts profile,qwen3-235b
    python3 scripts/bench_moe.py --smoke         # CPU, toy configs of each part
Writes benchmarks/results/bench_moe_<stamp>.json after every part (a copy in $OUT when
set) and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import benchlib as bench  # noqa: E402
from benchlib import GB, fmt  # noqa: E402

PARTS = ("profile", "mixtral", "accelerate", "qwen3-235b", "mixtral-int4")
# seconds: each part's timeout and the least worth starting it with
CAPS = {"profile": (150, 40), "mixtral": (330, 200), "accelerate": (200, 90)}
CAPS |= {"qwen3-235b": (330, 200), "mixtral-int4": (240, 120)}
# (preset, --compress, --kv-compress, new tokens) of our parts
OURS = {
    "mixtral": ("mixtral-8x7b", "none", "none", None),
    "mixtral-int4": ("mixtral-8x7b", "auto", "auto", None),
    "qwen3-235b": ("qwen3-235b-a22b", "int4", "int4", 4),
}
SMOKE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16}
SMOKE |= {"num_key_value_heads": 2, "intermediate_size": 128, "moe_intermediate_size": 64}
SMOKE |= {"vocab_size": 512, "num_local_experts": 8, "num_experts": 16}
ACCELERATE_BATCH, ACCELERATE_GPU_WEIGHTS = 16, "19GiB"


def parse_args() -> argparse.Namespace:
    p = bench.doc_parser(__doc__)
    p.add_argument("--smoke", action="store_true", help="CPU, toy configs, prompt 32, gen 4")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated, run in this order")
    p.add_argument("--time-budget", type=float, default=540, help="seconds in all (default 540)")
    p.add_argument("--gpu-mem", default="24GB")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--nvme", type=Path, help="fast-disk directory (default: under /tmp)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # a part, run in its own process
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    bench.check_names(p, "--parts", args.parts, PARTS)
    if args.smoke:  # (measuring a profile on a small CPU machine takes minutes)
        args.prompt_len, args.gen_len, args.gpu_mem = 32, 4, "64MB"
        CAPS["profile"] = (600, 40)
    return args


# -- the parts, each in its own process ----------------------------------------------------
def _model(preset: str, smoke: bool, work: Path) -> str:
    """The preset, or (smoke) its architecture at toy sizes as a config-only directory."""
    if not smoke:
        return preset
    from offload.core.presets import PRESETS

    hf = {**PRESETS[preset], **{k: v for k, v in SMOKE.items()}}
    directory = work / f"toy-{preset}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf))
    return str(directory)


def ours(part: str, args) -> dict[str, Any]:
    """One searched block with experts by module, then (mixtral) the dense schedule."""
    import torch

    from offload.api.args import parse_size
    from offload.api.llm import LLM
    from offload.core.sampling import SamplingParams
    from offload.policies.caps import Caps
    from offload.policies.cost import estimate
    from offload.policies.hardware import load_profile

    preset, compress, kv_compress, gen_len = OURS[part]
    gen_len = min(gen_len or args.gen_len, args.gen_len)
    work = args.out.parent
    started = time.perf_counter()
    llm = LLM(
        _model(preset, args.smoke, work), dummy=True, caps=Caps(parse_size(args.gpu_mem)),
        nvme=args.nvme / part,
        compress=compress, kv_compress=kv_compress, prompt_len=args.prompt_len, gen_len=gen_len,
        dtype="float16" if torch.cuda.is_available() else "float32",
    )  # fmt: skip
    load_s = time.perf_counter() - started
    policy, runner, cfg = llm.policy, llm.runner, llm.config
    hw = load_profile()
    record: dict[str, Any] = {"model": preset, "policy": policy.to_dict(), "load_s": load_s}
    if hw is not None:
        predicted = estimate(cfg, policy, llm.dtype, args.prompt_len, gen_len, hw)
        dense = estimate(cfg, policy, llm.dtype, args.prompt_len, gen_len, hw, dense_experts=True)
        record["predicted"] = _estimate(predicted)
        record["predicted_dense"] = _estimate(dense)
    traced = _trace_one_step(runner, decode_step=max(1, gen_len // 2))
    prompts = _prompts(policy.block_size, args.prompt_len, cfg.vocab_size)
    params = SamplingParams(max_tokens=gen_len, ignore_eos=True)
    outs = llm.generate(prompts, params)
    s = llm.stats
    record["ours"] = {
        "sequences": len(prompts),
        "generated_tokens": sum(len(o.token_ids) for o in outs),
        "prefill_s": s.prefill_seconds,
        "decode_s": s.decode_seconds,
        "decode_step_s": s.decode_seconds / max(1, gen_len - 1),
        "tok_s": s.tokens_per_second,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
        "traced_step": traced.get("step"),
        "experts": runner.expert_report(),
    }
    if part == "mixtral":
        record["dense"] = _dense_schedule(llm, prompts, gen_len)
    llm.close()
    return record


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


def _trace_one_step(runner, decode_step: int) -> dict[str, Any]:
    """Trace the `decode_step`-th decode step of the next job (the lanes' busy times and
    bytes, `lanes.busy_seconds`); the dict fills in as it runs."""
    out: dict[str, Any] = {}
    forward, seen = runner.forward, [0]

    def traced(token_ids, step, *a, **k):
        decode = token_ids.shape[1] == 1
        seen[0] += decode
        runner.tracer.enabled = decode and seen[0] == decode_step
        try:
            return forward(token_ids, step, *a, **k)
        finally:
            if runner.tracer.enabled:
                last = runner.traces[-1]
                out["step"] = {"seconds": last.seconds, "lanes": last.lanes}
            runner.tracer.enabled = False

    runner.forward = traced
    return out


def _dense_schedule(llm, prompts: list[list[int]], gen_len: int) -> dict[str, Any]:
    """The same block under the dense schedule: a prefill and one decode step, timed."""
    import torch

    from offload.models.batch import PaddedBatch

    runner = llm.runner
    runner.experts.dense = True
    runner.experts.step_traffic()
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
    runner.experts.dense = False
    seqs = len(prompts)
    return {
        "prefill_s": prefill_s,
        "decode_step_s": step_s,
        "decode_tok_s": seqs / step_s,
        "tok_s": seqs * gen_len / (prefill_s + (gen_len - 1) * step_s),
        "h2d_bytes": sum(t.h2d_bytes for t in traffic.values()),
    }


def accelerate_part(args) -> dict[str, Any]:
    """transformers' Mixtral under Accelerate's offload at the batch that fits the cap:
    a prefill and one decode step, timed."""
    import tempfile

    import torch
    from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
    from transformers import MixtralConfig, MixtralForCausalLM

    from offload.core.presets import PRESETS

    hf = dict(PRESETS["mixtral-8x7b"])
    if args.smoke:
        hf |= {k: v for k, v in SMOKE.items() if k != "num_experts"}
    config = MixtralConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    cuda = torch.cuda.is_available()
    dtype = torch.float16 if cuda else torch.float32
    started = time.perf_counter()
    with init_empty_weights():
        model = MixtralForCausalLM(config).to(dtype)
    model.to_empty(device="cpu")
    _fill(model)
    gpu = "64MB" if args.smoke else ACCELERATE_GPU_WEIGHTS
    max_memory = {0: gpu, "cpu": "120GiB"} if cuda else {"cpu": "120GiB"}
    device_map = infer_auto_device_map(
        model, max_memory=max_memory, no_split_module_classes=model._no_split_modules, dtype=dtype
    )
    offload = Path(tempfile.mkdtemp(prefix="accelerate-offload-", dir=str(args.nvme)))
    model = dispatch_model(model, device_map=device_map, offload_dir=str(offload))
    load_s = time.perf_counter() - started
    batch = 2 if args.smoke else ACCELERATE_BATCH
    device = torch.device("cuda" if cuda else "cpu")
    ids = torch.tensor(_prompts(batch, args.prompt_len, config.vocab_size), device=device)
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
    gen = args.gen_len
    on_gpu = sum(1 for d in device_map.values() if d == 0)
    return {
        "batch": batch,
        "max_memory": {str(k): v for k, v in max_memory.items()},
        "modules_on_gpu": on_gpu,
        "modules": len(device_map),
        "load_s": load_s,
        "prefill_s": prefill_s,
        "decode_step_s": step_s,
        "decode_tok_s": batch / step_s,
        "tok_s": batch * gen / (prefill_s + (gen - 1) * step_s),
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    }


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


def child_main(args) -> int:
    args.nvme.mkdir(parents=True, exist_ok=True)
    record = accelerate_part(args) if args.child == "accelerate" else ours(args.child, args)
    args.out.write_text(json.dumps(record, indent=1, default=str))
    return 0


# -- the parent ----------------------------------------------------------------------------
def run_child(name: str, args, budget: bench.Budget, work: Path, env) -> dict[str, Any]:
    cap, _ = CAPS[name]
    timeout = min(cap, budget.left())
    if name == "profile":
        cmd = [sys.executable, "-m", "offload.cli.profile", "--quick", "--nvme", str(args.nvme)]
        record = {"run": bench.run_part(name, cmd, timeout, work / name, env)}
        record["profile"] = bench._profile()
        return record
    out = work / name / "record.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--out", str(out)]
    cmd += ["--nvme", str(args.nvme), "--gpu-mem", args.gpu_mem]
    cmd += ["--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len)]
    cmd += ["--smoke"] if args.smoke else []
    record = {"run": bench.run_part(name, cmd, timeout, work / name, env, 120)}
    if out.is_file():
        record |= json.loads(out.read_text())
    return record


def roofline(record: dict[str, Any], profile: dict[str, Any] | None) -> dict[str, Any] | None:
    """The traced decode step's bytes per lane over this run's ceilings (the profile's
    pinned PCIe and disk rates): the ideal step, against the measured one."""
    step = (record.get("ours") or {}).get("traced_step")
    if not step or not profile:
        return None
    lanes = step["lanes"]
    ideal = {
        "pcie_h2d": lanes.get("pcie_h2d", {}).get("bytes", 0) / (profile["h2d_gbps"] * GB),
        "disk": lanes.get("disk", {}).get("bytes", 0) / (profile["disk_read_gbps"] * GB),
    }
    ideal_s = max(ideal.values())
    measured = record["ours"]["decode_step_s"]
    return {
        "lane_bytes": {k: lanes.get(k, {}).get("bytes", 0) for k in ideal},
        "lane_ideal_s": ideal,
        "lane_busy_s": {k: v["busy_s"] for k, v in lanes.items() if v["busy_s"]},
        "ideal_step_s": ideal_s,
        "measured_step_s": measured,
        "traced_step_s": step["seconds"],
        "over_roofline_pct": 100 * (measured / ideal_s - 1) if ideal_s else None,
    }


def ratios(parts: dict[str, Any]) -> dict[str, Any]:
    mixtral = parts.get("mixtral", {})
    ours = [parts.get(p, {}).get("ours", {}).get("tok_s") for p in ("mixtral", "mixtral-int4")]
    best = max((t for t in ours if t), default=None)
    dense = (mixtral.get("dense") or {}).get("tok_s")
    acc = (parts.get("accelerate") or {}).get("tok_s")
    return {
        "best_ours_tok_s": best,
        "over_dense_schedule": best / dense if best and dense else None,
        "fp16_over_dense_schedule": ours[0] / dense if ours[0] and dense else None,
        "over_accelerate": best / acc if best and acc else None,
    }


def print_table(data: dict[str, Any]) -> None:
    parts = data["parts"]
    print(f"\n{'part':13s} {'seqs':>5s} {'prefill':>8s} {'s/step':>7s} {'tok/s':>8s} "
          f"{'predicted':>9s} {'error':>6s} {'moved/step':>10s} {'roofline':>9s}")  # fmt: skip
    for name, r in parts.items():
        o = r.get("ours")
        if name == "accelerate" and "tok_s" in r:
            print(f"{name:13s} {r['batch']:5d} {r['prefill_s']:7.1f}s {r['decode_step_s']:7.2f} "
                  f"{r['tok_s']:8.2f}")  # fmt: skip
            continue
        if not o:
            if name != "profile":
                print(f"{name:13s} {r.get('skipped') or _failure(r)}")
            continue
        p = (r.get("predicted") or {}).get("tok_s")
        err = 100 * (o["tok_s"] / p - 1) if p else None
        moved = (r.get("predicted") or {}).get("experts", {}).get("decode_moved_bytes")
        roof = (r.get("roofline") or {}).get("over_roofline_pct")
        print(f"{name:13s} {o['sequences']:5d} {o['prefill_s']:7.1f}s {o['decode_step_s']:7.2f} "
              f"{o['tok_s']:8.1f} {fmt(p):>9s} {fmt(err, '+.0f', '%'):>6s} "
              f"{fmt(moved and moved / GB, '.1f', ' GB'):>10s} {fmt(roof, '+.0f', '%'):>9s}")  # fmt: skip
        if r.get("dense"):
            d = r["dense"]
            pd = (r.get("predicted_dense") or {}).get("tok_s")
            print(f"{'  dense sched':13s} {o['sequences']:5d} {d['prefill_s']:7.1f}s "
                  f"{d['decode_step_s']:7.2f} {d['tok_s']:8.1f} {fmt(pd):>9s}")  # fmt: skip
    r = data.get("ratios", {})
    print(f"\nours over the dense schedule {fmt(r.get('over_dense_schedule'))}x (fp16 "
          f"{fmt(r.get('fp16_over_dense_schedule'))}x), over Accelerate "
          f"{fmt(r.get('over_accelerate'))}x")  # fmt: skip


def _failure(record: dict[str, Any]) -> str:
    run = record.get("run") or {}
    if run.get("ok"):
        return "no record"
    last = (run.get("stderr_tail", "").strip().splitlines() or [""])[-1]
    return f"failed (rc {run.get('rc')}{', ' + run['killed'] if run.get('killed') else ''}): {last}"


def main() -> None:
    args = parse_args()
    if args.child:
        sys.exit(child_main(args))
    budget, work, results = bench.start(
        args,
        "bench_moe",
        "Mixtral-8x7B dummy weights, prompt 512, gen 32, --gpu-mem 24GB, searched plan: ours "
        "(experts by module; fp16, and compression allowed) against the dense schedule "
        "and Accelerate; Qwen3-235B-A22B int4 on one GPU",
    )
    env = bench.child_env()

    def run(name: str) -> dict:
        record = run_child(name, args, budget, work, env)
        profile = results.data["parts"].get("profile", {}).get("profile")
        if "ours" in record:
            record["roofline"] = roofline(record, profile or record.get("profile"))
        return record

    def after_each(record: dict) -> str:
        results.data["ratios"] = ratios(results.data["parts"])
        return "done" if record.get("run", {}).get("ok") else "failed"

    try:
        bench.run_parts(
            args.parts.split(","), lambda name: CAPS[name][1], run, results, budget, after_each
        )
    finally:
        results.data["ratios"] = ratios(results.data["parts"])
        bench.finish(results, budget, print_table)


if __name__ == "__main__":
    main()
