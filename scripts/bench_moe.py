"""Mixtures of experts offloaded on one GPU, in one call of under 9 minutes: each model
loaded once, every schedule run on the loaded engine (issues 60 and 67).

Dummy weights, prompt 512, 32 new tokens, the searched plan, a job of one full block.
Parts, in order of importance; each model's is one process (one load, its schedules
run on it in turn, each time-boxed inside the part's seconds: `bench_moe_parts`); a
part that cannot start in what is left of --time-budget is skipped, and a preset this
checkout lacks is recorded as not available:
    profile       offload-profile --quick (the cost model's rates, the expert figures,
                  the ceilings of this run: pinned PCIe, disk, DRAM, the CPU expert
                  rate), unless this machine's cached profile is current
    mixtral       Mixtral-8x7B fp16 at --gpu-mem 24GB: ours (the searched block, its
                  prediction beside it, one decode step traced), then on the same engine
                  the dense schedule (every expert fetched for every micro-batch, as
                  model-based batching runs it): a prefill and one decode step
    mixtral-int4  Mixtral-8x7B with compression allowed (--compress auto --kv-compress
                  auto): ours (its own load), within what leaves Accelerate its minimum
    accelerate    transformers' MixtralForCausalLM dispatched by Accelerate
                  (infer_auto_device_map with max_memory) at batch 16: a prefill and one
                  decode step
    gpt-oss-120b  MXFP4 experts as shipped, --gpu-mem 24GB, the machine's RAM: ours
    mla           DeepSeek-V2-Lite (else Moonlight-16B-A3B), latent attention, --gpu-mem
                  8GB: ours
    qwen3-235b    Qwen3-235B-A22B int4 weights and KV, --nvme, the machine's RAM: a
                  short job (4 new tokens) over one searched block
    cpu-int4      the CPU expert kernel over a Mixtral expert in int4 (8 rows), against
                  the profile's DRAM rate
Each run records tokens/s measured beside its prediction.

    python3 scripts/bench_moe.py                 # the GPU machine: under 9 minutes
    python3 scripts/bench_moe.py --parts profile,mixtral,accelerate
    python3 scripts/bench_moe.py --smoke         # CPU, toy configs of each part
Writes benchmarks/results/bench_moe_<stamp>.json after every part (a copy in $OUT when
set) and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import benchlib as bench  # noqa: E402
from benchlib import GB, fmt  # noqa: E402

PARTS = ("profile", "mixtral", "mixtral-int4", "accelerate", "gpt-oss-120b", "mla")
PARTS += ("qwen3-235b", "cpu-int4")
# seconds: each part's timeout and the least worth starting it with
CAPS = {"profile": (150, 40), "mixtral": (360, 150), "mixtral-int4": (240, 120)}
CAPS |= {"accelerate": (180, 90), "gpt-oss-120b": (240, 120), "mla": (150, 60)}
CAPS |= {"qwen3-235b": (300, 150), "cpu-int4": (90, 20)}
# a part that runs only with what leaves a later, more important part its minimum
LEAVES = {"mixtral-int4": "accelerate"}


@dataclass(frozen=True)
class Ours:
    """One of our parts: the presets it may run (the first this checkout has), the GPU
    cap (None: --gpu-mem), the formats, a cap on the new tokens, the dense schedule."""

    presets: tuple[str, ...]
    gpu_mem: str | None = None
    compress: str = "none"
    kv_compress: str = "none"
    gen_len: int | None = None
    dense: bool = False
    smoke_gpu_mem: str = "64MB"  # the toy's (int4's and MXFP4's scratches need more)
    dtype: str = "float16"  # on the GPU (auto: the checkpoint's); float32 on the CPU


OURS = {
    "mixtral": Ours(("mixtral-8x7b",), dense=True),
    "mixtral-int4": Ours(("mixtral-8x7b",), compress="auto", kv_compress="auto"),
    "gpt-oss-120b": Ours(("gpt-oss-120b",), gpu_mem="24GB", dtype="auto", smoke_gpu_mem="2GB"),
    "mla": Ours(("deepseek-v2-lite", "moonlight-16b-a3b"), gpu_mem="8GB", dtype="auto"),
    "qwen3-235b": Ours(
        ("qwen3-235b-a22b",), compress="int4", kv_compress="int4", gen_len=4, smoke_gpu_mem="2GB"
    ),
}
# a smoke run's toy sizes, for the keys each preset has
SMOKE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16}
SMOKE |= {"num_key_value_heads": 2, "intermediate_size": 128, "moe_intermediate_size": 64}
SMOKE |= {"vocab_size": 512, "num_local_experts": 8, "num_experts": 16, "n_routed_experts": 8}
SMOKE |= {"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
ACCELERATE_BATCH, ACCELERATE_GPU_WEIGHTS = 16, "19GiB"
CPU_EXPERT = (4096, 14336)  # Mixtral's expert (hidden, intermediate)
CHILD_MARGIN_S = 10  # a child's own time box ends this long before its kill


def parse_args() -> argparse.Namespace:
    p = bench.doc_parser(__doc__)
    p.add_argument("--smoke", action="store_true", help="CPU, toy configs, prompt 32, gen 4")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated, run in this order")
    p.add_argument("--time-budget", type=float, default=525, help="seconds in all (default 525)")
    p.add_argument("--gpu-mem", default="24GB")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--nvme", type=Path, help="fast-disk directory (default: under /tmp)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # a part, run in its own process
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, help=argparse.SUPPRESS)  # the child's time box
    args = p.parse_args()
    bench.check_names(p, "--parts", args.parts, PARTS)
    if args.smoke:  # (measuring a profile on a small CPU machine takes minutes)
        args.prompt_len, args.gen_len, args.gpu_mem = 32, 4, "64MB"
        CAPS["profile"] = (600, 40)
    return args


def available(part: str) -> str | None:
    """The preset a part of ours runs: the first of its presets this checkout has."""
    from offload.core.presets import PRESETS

    return next((p for p in OURS[part].presets if p in PRESETS), None)


# -- a part, in its own process ------------------------------------------------------------
def _model(preset: str, smoke: bool, work: Path) -> str:
    """The preset, or (smoke) its architecture at toy sizes as a config-only directory."""
    if not smoke:
        return preset
    directory = work / f"toy-{preset}"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(_toy(preset)))
    return str(directory)


def _toy(preset: str) -> dict[str, Any]:
    """The preset's config with SMOKE's sizes for the keys it has (a latent attention's
    heads are all KV heads; windowed layer types cut to the layers)."""
    from offload.core.presets import PRESETS

    hf = dict(PRESETS[preset])
    hf |= {k: v for k, v in SMOKE.items() if k in hf}
    if "kv_lora_rank" in hf:
        hf["num_key_value_heads"] = hf["num_attention_heads"]
    if isinstance(hf.get("layer_types"), list):
        hf["layer_types"] = hf["layer_types"][: hf["num_hidden_layers"]]
    return hf


def child_main(args) -> int:
    import bench_moe_parts as parts

    args.nvme.mkdir(parents=True, exist_ok=True)
    record = parts.PartRecord(args.out, args.seconds)
    if args.child == "accelerate":
        hf = _toy("mixtral-8x7b") if args.smoke else dict(_presets()["mixtral-8x7b"])
        gpu = "64MB" if args.smoke else ACCELERATE_GPU_WEIGHTS
        batch = 2 if args.smoke else ACCELERATE_BATCH
        parts.run_accelerate(record, hf, args.prompt_len, args.gen_len, gpu, batch, args.nvme)
    elif args.child == "cpu-int4":
        hidden, inter = (256, 512) if args.smoke else CPU_EXPERT
        parts.run_cpu_int4(record, hidden, inter, (16 if args.smoke else 1024) << 20, 8)
    else:
        ours, preset = OURS[args.child], available(args.child)
        assert preset is not None, "the parent runs only a part whose preset exists"
        gen_len = min(ours.gen_len or args.gen_len, args.gen_len)
        gpu_mem = ours.smoke_gpu_mem if args.smoke else ours.gpu_mem or args.gpu_mem
        model = _model(preset, args.smoke, args.out.parent)
        nvme = args.nvme / args.child
        parts.run_ours(record, model, gpu_mem, nvme, ours.compress, ours.kv_compress,
                       args.prompt_len, gen_len, ours.dense, ours.dtype)  # fmt: skip
        record.data["model"] = preset
        record.save()
    return 0


def _presets() -> dict:
    from offload.core.presets import PRESETS

    return PRESETS


# -- the parent ----------------------------------------------------------------------------
def run_child(name: str, args, budget: bench.Budget, work: Path, env) -> dict[str, Any]:
    cap, _ = CAPS[name]
    timeout = min(cap, budget.left())
    later = LEAVES.get(name)
    if later and later in args.parts.split(","):
        timeout = min(timeout, budget.left() - CAPS[later][1])
    if name == "profile":
        cached = bench._profile()  # (current: measured with this code on this machine)
        if cached is not None:
            return {"run": {"ok": True, "cached": True}, "profile": cached}
        cmd = [sys.executable, "-m", "offload.cli.profile", "--quick", "--nvme", str(args.nvme)]
        record = {"run": bench.run_part(name, cmd, timeout, work / name, env)}
        record["profile"] = bench._profile()
        return record
    if name in OURS and available(name) is None:
        return {"not_available": f"no preset {' or '.join(OURS[name].presets)} in this checkout"}
    out = work / name / "record.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--out", str(out)]
    cmd += ["--seconds", f"{max(1.0, timeout - CHILD_MARGIN_S):.0f}"]
    cmd += ["--nvme", str(args.nvme), "--gpu-mem", args.gpu_mem]
    cmd += ["--prompt-len", str(args.prompt_len), "--gen-len", str(args.gen_len)]
    cmd += ["--smoke"] if args.smoke else []
    record = {"run": bench.run_part(name, cmd, timeout, work / name, env, 120)}
    if out.is_file():
        record |= json.loads(out.read_text())
    if record.get("running"):  # cut off: the schedule it was in
        record["cut_off_in"] = record["running"]
    return record


def roofline(run: dict[str, Any], profile: dict[str, Any] | None) -> dict[str, Any] | None:
    """The traced decode step's bytes per lane over this run's ceilings (the profile's
    pinned PCIe and disk rates): the ideal step, against the measured one."""
    step = run.get("traced_step")
    if not step or not profile:
        return None
    lanes = step["lanes"]
    ideal = {
        "pcie_h2d": lanes.get("pcie_h2d", {}).get("bytes", 0) / (profile["h2d_gbps"] * GB),
        "disk": lanes.get("disk", {}).get("bytes", 0) / (profile["disk_read_gbps"] * GB),
    }
    ideal_s = max(ideal.values())
    measured = run["decode_step_s"]
    return {
        "lane_bytes": {k: lanes.get(k, {}).get("bytes", 0) for k in ideal},
        "lane_ideal_s": ideal,
        "lane_busy_s": {k: v["busy_s"] for k, v in lanes.items() if v["busy_s"]},
        "ideal_step_s": ideal_s,
        "measured_step_s": measured,
        "traced_step_s": step["seconds"],
        "over_roofline_pct": 100 * (measured / ideal_s - 1) if ideal_s else None,
    }


def _tok_s(parts: dict[str, Any], part: str, run: str) -> float | None:
    return ((parts.get(part) or {}).get("runs", {}).get(run) or {}).get("tok_s")


def ratios(parts: dict[str, Any]) -> dict[str, Any]:
    ours = _tok_s(parts, "mixtral", "ours")
    best = max((t for t in (ours, _tok_s(parts, "mixtral-int4", "ours")) if t), default=None)
    dense, acc = _tok_s(parts, "mixtral", "dense"), _tok_s(parts, "accelerate", "accelerate")
    predicted = ((parts.get("mixtral") or {}).get("runs", {}).get("ours") or {}).get(
        "predicted_tok_s"
    )
    return {
        "mixtral_fp16_tok_s": ours,
        "mixtral_fp16_over_predicted": ours / predicted if ours and predicted else None,
        "fp16_over_dense_schedule": ours / dense if ours and dense else None,
        "fp16_over_accelerate": ours / acc if ours and acc else None,
        "best_ours_tok_s": best,
        "best_over_accelerate": best / acc if best and acc else None,
    }


def print_table(data: dict[str, Any]) -> None:
    print(f"\n{'part':22s} {'seqs':>5s} {'prefill':>8s} {'s/step':>7s} {'tok/s':>8s} "
          f"{'predicted':>9s} {'error':>6s} {'moved/step':>10s} {'roofline':>9s}")  # fmt: skip
    for name, r in data["parts"].items():
        if name == "profile":
            continue
        why = r.get("skipped") or r.get("not_available") or r.get("error")
        if why or not r.get("runs"):
            print(f"{name:22s} {why or _failure(r)}")
            continue
        for run_name, run in r["runs"].items():
            label = name if run_name in ("ours", name) else f"{name} {run_name}"
            _print_run(label, run, r.get("model"))
        if r.get("cut_off_in"):
            print(f"{name:22s} stopped in {r['cut_off_in']}: {_failure(r)}")
    r = data.get("ratios", {})
    print(f"\nMixtral fp16: {fmt(r.get('mixtral_fp16_tok_s'))} tok/s, "
          f"{fmt(r.get('mixtral_fp16_over_predicted'), '.2f')}x its prediction, "
          f"{fmt(r.get('fp16_over_dense_schedule'))}x the dense schedule, "
          f"{fmt(r.get('fp16_over_accelerate'))}x Accelerate")  # fmt: skip


def _print_run(label: str, run: dict[str, Any], model: str | None) -> None:
    if "skipped" in run:
        print(f"{label:22s} skipped: {run['skipped']}")
        return
    if "gbps" in run:  # the CPU expert's rate
        print(f"{label:22s} int4 expert {fmt(run['gbps'])} GB/s = "
              f"{fmt(run['share_of_dram'] and 100 * run['share_of_dram'], '.0f', '%')} of the "
              f"profile's DRAM {fmt(run['profile_dram_gbps'])} GB/s")  # fmt: skip
        return
    p = run.get("predicted_tok_s")
    err = 100 * (run["tok_s"] / p - 1) if p else None
    moved = ((run.get("predicted") or {}).get("experts") or {}).get("decode_moved_bytes")
    roof = (run.get("roofline") or {}).get("over_roofline_pct")
    print(f"{label:22s} {run['sequences']:5d} {run['prefill_s']:7.1f}s "
          f"{run['decode_step_s']:7.2f} {run['tok_s']:8.2f} {fmt(p):>9s} "
          f"{fmt(err, '+.0f', '%'):>6s} {fmt(moved and moved / GB, '.1f', ' GB'):>10s} "
          f"{fmt(roof, '+.0f', '%'):>9s}")  # fmt: skip


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
        "mixtures of experts, dummy weights, prompt 512, gen 32, searched plans, each model "
        "loaded once: Mixtral-8x7B fp16 at --gpu-mem 24GB (ours with its prediction, the "
        "dense schedule, compression allowed) against Accelerate; gpt-oss-120b; "
        "DeepSeek-V2-Lite or Moonlight; Qwen3-235B-A22B int4; the CPU int4 expert rate",
    )
    env = bench.child_env()

    def run(name: str) -> dict:
        record = run_child(name, args, budget, work, env)
        profile = results.data["parts"].get("profile", {}).get("profile") or bench._profile()
        for one in (record.get("runs") or {}).values():
            if one.get("traced_step"):
                one["roofline"] = roofline(one, profile)
        return record

    def after_each(record: dict) -> str:
        results.data["ratios"] = ratios(results.data["parts"])
        if record.get("not_available"):
            return "not available"
        return "done" if record.get("run", {}).get("ok") else "failed"

    def min_seconds(name: str) -> float:
        later = LEAVES.get(name)
        keep = CAPS[later][1] if later and later in args.parts.split(",") else 0
        return CAPS[name][1] + keep

    try:
        bench.run_parts(args.parts.split(","), min_seconds, run, results, budget, after_each)
    finally:
        results.data["ratios"] = ratios(results.data["parts"])
        bench.finish(results, budget, print_table)


if __name__ == "__main__":
    main()
