"""Job-level validation of the cost model, and the A/B of the GPU allocator's hold, in one
command (also `scripts/validate_cost_model.py --jobs`).

    python scripts/validate_jobs.py [--time-budget 540]          # one H200, about 9 minutes
    python scripts/validate_jobs.py --smoke                      # CPU, toy models, minutes

Parts, in order of importance; each run is a subprocess with its own time limit inside
the budget, and a part that cannot start with its least time left is recorded as skipped:
    profile    offload-profile --quick --nvme DIR: this machine and this code, the profile
               every prediction below is made with (--profile FILE skips it)
    jobs       for each model: B, the block offload-plan plans for a long job (the run's own
               road); then offload-run over jobs of B/3 to 6 B requests (1 to 6 blocks) of
               mixed prompt lengths (scripts/make_prompts.py; dummy
               presets count UTF-8 bytes as tokens), --ignore-eos, each planned for its own
               job: the run's prediction (`policies.job`: load + every block) beside its
               measured load + generation (target: within 15%)
    hold-w1c   W1c (OPT-30B int4 W + KV at 24 GB; scripts/bench_throughput.py's workload:
               one searched block of 512-token prompts, 32 new tokens), the allocator held
               (the default) and free (--no-hold-gpu-mem): tok/s, allocated and reserved
               bytes with the context, the allocator's retries at the hold's limit
    caps-test  pytest -m gpu tests/test_gpu_caps.py: under the default hold, reserved bytes
               within the cap for an int4 and a float16 plan (Llama-3.1-8B, dummy weights)
    hold-w1u   the same for W1u (OPT-30B float16 at 24 GB), 16 new tokens (two runs fit)
    hold-bloom BLOOM-176B int4 W + KV at 24 GB with --nvme, held and free (only if it fits)
Writes benchmarks/results/validate_jobs_<stamp>.json (and $OUT) after every part, and
prints the tables last.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import benchlib as bench  # noqa: E402
from benchlib import fmt  # noqa: E402

PARTS = ("profile", "jobs", "hold-w1c", "caps-test", "hold-w1u", "hold-bloom")
# part -> (time limit of one run, least time worth starting the part with), seconds
TIMES = {
    "profile": (170, 60),
    "jobs": (120, 60),
    "hold-w1c": (120, 100),
    "caps-test": (150, 80),
    "hold-w1u": (120, 170),
    "hold-bloom": (240, 420),
}
INT4 = "--compress int4 --kv-compress int4"
# the job matrix: name -> (engine flags, new tokens, prompt characters (min, max), the
# jobs' sizes in blocks of the plan B for a long job). Short (8) and long (128) generations,
# 1 to 6 blocks, int4 and fp16, attention on the GPU and (long prompts, KV off the GPU) on
# the CPU
JOB_MODELS = {
    "llama-3.1-8b int4 W+KV, 8 GB": (
        f"--model llama-3.1-8b --dummy --gpu-mem 8GB {INT4}",
        128,
        (64, 256),
        ("B/3", "1.1 B", "3 B"),
    ),
    "opt-6.7b fp16, 6 GB": (
        "--model opt-6.7b --dummy --gpu-mem 6GB",
        8,
        (64, 256),
        ("B/3", "1.1 B", "3 B", "6 B"),
    ),
    "llama-2-13b fp16, 10 GB": (
        "--model llama-2-13b --dummy --gpu-mem 10GB",
        8,
        (64, 256),
        ("B/3", "1.1 B", "3 B"),
    ),
    "llama-2-13b fp16, 10 GB, long prompts": (
        "--model llama-2-13b --dummy --gpu-mem 10GB",
        32,
        (1024, 2000),
        ("1.1 B",),
    ),
}
# a job's size in requests, from the plan's block B
SIZES = {
    "B/3": lambda b: math.ceil(b / 3),
    "1.1 B": lambda b: math.ceil(1.1 * b),
    "3 B": lambda b: 3 * b,
    "6 B": lambda b: 6 * b,
}
# the hold's workloads: part -> (engine flags, prompt tokens, new tokens)
HOLDS = {
    "hold-w1c": (f"--model opt-30b --dummy --gpu-mem 24GB {INT4}", 512, 32),
    "hold-w1u": ("--model opt-30b --dummy --gpu-mem 24GB", 512, 16),
    "hold-bloom": (f"--model bloom --dummy --gpu-mem 24GB {INT4} --nvme {{nvme}}", 512, 32),
}
SMOKE_PRESETS = {"jobs": ("llama-3.1-8b", "llama-2-7b", "opt-6.7b"), "hold": "opt-30b"}


def parse_args() -> argparse.Namespace:
    p = bench.doc_parser(__doc__)
    p.add_argument("--smoke", action="store_true", help="CPU, toy models: the plumbing only")
    p.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset, in order")
    p.add_argument("--time-budget", type=float, default=540, help="seconds for everything")
    p.add_argument("--profile", type=Path, help="a profile of this machine and code (no measuring)")  # fmt: skip
    p.add_argument("--nvme", type=Path, help="where the profile measures the disk and BLOOM spills")  # fmt: skip
    args = p.parse_args()
    bench.check_names(p, "--parts", args.parts, PARTS)
    return args


# -- the runs ---------------------------------------------------------------------------
def run_job(
    name: str, flags: list[str], prompts: Path, gen_len: int, work: Path, env, timeout_s: float,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:  # fmt: skip
    """offload-run over a prompts file, as a user runs it: its summary (--stats) holds the
    prediction it printed before the load and the measured seconds."""
    part = work / name
    part.mkdir(parents=True, exist_ok=True)
    out, stats = part / "out.jsonl", part / "stats.json"
    cmd = [sys.executable, "-m", "offload.cli.run", *flags, "--max-tokens", str(gen_len)]
    cmd += ["--ignore-eos", "-i", str(prompts), "-o", str(out), "--stats", str(stats), *extra]
    record = bench.run_part(name, cmd, timeout_s, part, env)
    if stats.is_file():
        record["stats"] = json.loads(stats.read_text())
        record["summary"] = _job_summary(record["stats"], record["seconds"])
    return record


def _job_summary(stats: dict[str, Any], process_s: float) -> dict[str, Any]:
    seconds, predicted, peak = stats["seconds"], stats.get("predicted"), stats["peak_memory"]
    measured = seconds["loading"] + seconds["wall"]
    out: dict[str, Any] = {
        "requests": stats["requests"],
        "policy": stats["policy"],
        "generated_tokens": stats["generated_tokens"],
        "tok_s": stats["tokens_per_second"],
        "load_s": seconds["loading"],
        "generate_s": seconds["wall"],
        "job_s": measured,
        "process_s": process_s,  # beyond job_s: Python's start, the plan search, writing out
        "peak_gpu_bytes": peak.get("gpu_bytes"),
        "peak_gpu_reserved_bytes": peak.get("gpu_reserved_bytes"),
        "gpu_held": peak.get("gpu_held"),
        "gpu_allocator": peak.get("gpu_allocator"),
        "blocks": len((stats.get("blocks") or {}).get("each", [])),
        # the job's time outside its blocks' start, prefill and decode (`--stats`' blocks)
        "outside_blocks_s": seconds["wall"] - (stats.get("blocks") or {}).get("in_blocks_s", 0.0),
    }
    if predicted:
        out |= {
            "predicted_job_s": predicted["seconds"],
            "predicted_load_s": predicted["load"]["seconds"],
            "predicted_generate_s": predicted["generate_seconds"],
            "predicted_blocks": predicted["blocks"],
            "job_error_pct": 100 * (measured / predicted["seconds"] - 1),
            "generate_error_pct": 100 * (seconds["wall"] / predicted["generate_seconds"] - 1)
            if predicted["generate_seconds"]
            else None,
        }
    return out


def block_of(flags: list[str], prompt_len: int, gen_len: int, env) -> int:
    """The block offload-plan plans for these flags and a long job (1000 requests) at
    these lengths: the plan the run's own road makes (`planning.plan`), in a subprocess
    (no CUDA in this one)."""
    cmd = [sys.executable, "-m", "offload.cli.plan", *flags, "--prompt-len", str(prompt_len)]
    cmd += ["--max-tokens", str(gen_len), "--num-prompts", "1000", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    policy = json.loads(done.stdout)["policy"]
    return policy["gpu_batch_size"] * policy["num_gpu_batches"]


def make_prompts(path: Path, count: int, chars: tuple[int, int], seed: int) -> None:
    cmd = [sys.executable, str(bench.SCRIPTS / "make_prompts.py"), str(count), str(path)]
    cmd += ["--min-chars", str(chars[0]), "--max-chars", str(chars[1]), "--seed", str(seed)]
    subprocess.run(cmd, check=True)


# -- the parts --------------------------------------------------------------------------
def profile_part(args, budget: bench.Budget, work: Path, env) -> dict[str, Any]:
    """--profile, else this machine's cached profile of this code, else measured now
    (offload-profile --quick: what offload-run measures on its first run)."""
    from offload.policies.hardware import load_profile, save_profile

    if args.profile is not None:
        return {"given": str(args.profile), "path": str(args.profile)}
    cached = load_profile()  # (None where it was measured with other code)
    if cached is not None:
        args.profile = save_profile(cached, work / "profile.json")
        return {"cached": True, "path": str(args.profile), "profile": json.loads(cached.to_json())}
    limit = budget.left() if args.smoke else min(TIMES["profile"][0], budget.left())
    cmd = [sys.executable, "-m", "offload.cli.profile", "--quick", "--nvme", str(args.nvme)]
    record = bench.run_part("profile", cmd, limit, work, env)
    if record["ok"]:
        text = Path(record["stdout"]).read_text()
        path = work / "profile.json"
        path.write_text(text)
        args.profile, record["path"] = path, str(path)
        record["profile"] = json.loads(text)
    return record


def jobs_part(args, budget: bench.Budget, work: Path, env) -> dict[str, Any]:
    """Each model's three jobs, in order; a run that cannot start with 30 s left is skipped."""
    out: dict[str, Any] = {}
    for model, (flags_text, gen_len, chars, sizes) in _job_models(args, work).items():
        flags = [*flags_text.split(), "--profile", str(args.profile), *_device(args)]
        block = block_of(flags, chars[1], gen_len, env)
        out[model] = {"flags": flags_text, "block": block, "gen_len": gen_len, "jobs": {}}
        for label in sizes:
            count = SIZES[label](block)
            key = f"{model}, {label}"
            if budget.left() < 30:
                out[model]["jobs"][label] = {"skipped": "time budget"}
                continue
            prompts = work / f"prompts-{len(out)}-{count}.jsonl"
            make_prompts(prompts, count, chars, seed=count)
            name = f"job-{len(out)}-{label.replace(' ', '').replace('/', '-')}"
            limit = min(TIMES["jobs"][0], budget.left())
            out[model]["jobs"][label] = run_job(name, flags, prompts, gen_len, work, env, limit)
            print(f"  {key}: {_job_status(out[model]['jobs'][label])}", flush=True)
    return out


def hold_part(name: str, args, budget: bench.Budget, work: Path, env) -> dict[str, Any]:
    """One block of the workload, the allocator held (the default) then free."""
    flags_text, prompt_len, gen_len = HOLDS[name]
    flags = flags_text.format(nvme=args.nvme).split()
    if args.smoke:
        flags = _smoke_flags(flags, work, SMOKE_PRESETS["hold"])
        prompt_len, gen_len = 32, 4
    flags = [*flags, "--profile", str(args.profile), *_device(args)]
    block = block_of(flags, prompt_len, gen_len, env)
    prompts = work / f"{name}-prompts.jsonl"
    bench.write_prompts(prompts, block, prompt_len)
    record: dict[str, Any] = {"flags": " ".join(flags), "block": block, "runs": {}}
    for label, extra in (("held", ()), ("free", ("--no-hold-gpu-mem",))):
        limit = min(TIMES[name][0], budget.left())
        run = run_job(
            f"{name}-{label}", flags, prompts, gen_len, work, env, limit, ("--quiet", *extra)
        )
        record["runs"][label] = run
        print(f"  {name} {label}: {_job_status(run)}", flush=True)
    return record


def _job_models(args, work: Path) -> dict[str, tuple[str, int, tuple[int, int]]]:
    if not args.smoke:
        return JOB_MODELS
    return {
        f"toy {preset}": (
            " ".join(
                _smoke_flags(["--model", preset, "--dummy", "--gpu-mem", "8MB"], work, preset)
            ),
            4,
            (16, 48),
            ("B/3", "1.1 B", "3 B"),
        )
        for preset in SMOKE_PRESETS["jobs"]
    }


def _smoke_flags(flags: list[str], work: Path, preset: str) -> list[str]:
    """The flags with --model a toy config of the preset's architecture (two KV heads,
    a narrow MLP) and a toy GPU cap (int4's quantizer needs a GPU cap of its own)."""
    toy = bench.smoke_model(_value(flags, "--model") or preset, work / "toys")
    config = json.loads((toy / "config.json").read_text())
    for key, size in (("num_key_value_heads", 2), ("intermediate_size", 256)):
        if key in config:
            config[key] = size
    (toy / "config.json").write_text(json.dumps(config, indent=1))
    out = list(flags)
    out[out.index("--model") + 1] = str(toy)
    out[out.index("--gpu-mem") + 1] = "2GB" if "--compress" in flags else "8MB"
    return out


def _value(flags: list[str], name: str) -> str | None:
    """A flag's value in an argument list (None: not given)."""
    return flags[flags.index(name) + 1] if name in flags else None


def _device(args) -> list[str]:
    return ["--device", "cpu", "--dtype", "float32"] if args.smoke else ["--dtype", "float16"]


def _job_status(record: dict[str, Any]) -> str:
    s = record.get("summary")
    if not s:
        return f"failed (rc {record.get('rc')}): {record.get('stderr_tail', '')[-300:]}"
    if "predicted_job_s" not in s:
        return f"{s['job_s']:.1f} s, no prediction"
    return (
        f"{s['job_s']:.1f} s against {s['predicted_job_s']:.1f} predicted "
        f"({s['job_error_pct']:+.1f}%); load {s['load_s']:.1f} / {s['predicted_load_s']:.1f} s"
    )


# -- the report -------------------------------------------------------------------------
def report(data: dict[str, Any]) -> None:
    parts = data["parts"]
    jobs = parts.get("jobs", {})
    if isinstance(jobs, dict) and "skipped" not in jobs and "error" not in jobs:
        print(f"\n{'job':52s} {'plan':>8s} {'blk':>4s} {'load s':>13s} {'generate s':>13s} {'outside':>8s} {'job s':>13s} {'error':>7s}")  # fmt: skip
        for model, m in jobs.items():
            for label, r in m.get("jobs", {}).items():
                s = r.get("summary")
                name = f"{model}, {label} ({s['requests'] if s else '?'} req.)"
                if not s or "predicted_job_s" not in s:
                    print(f"{name:52s} {r.get('skipped') or 'failed'}")
                    continue
                p = s["policy"]
                plan = f"{p['num_gpu_batches']}x{p['gpu_batch_size']}"
                pair = lambda a, b: f"{a:5.1f} / {b:5.1f}"  # noqa: E731
                print(
                    f"{name:52s} {plan:>8s} {s['blocks']:4d} "
                    f"{pair(s['load_s'], s['predicted_load_s']):>13s} "
                    f"{pair(s['generate_s'], s['predicted_generate_s']):>13s} "
                    f"{s['outside_blocks_s']:8.1f} "
                    f"{pair(s['job_s'], s['predicted_job_s']):>13s} {s['job_error_pct']:+6.1f}%"
                )
    caps = parts.get("caps-test")
    if caps and "cmd" in caps:
        last = (caps.get("stdout_tail") or "").strip().splitlines()[-1:]
        print(f"\ncaps test (tests/test_gpu_caps.py): rc {caps['rc']}, {' '.join(last)}")
    print(f"\n{'hold A/B':22s} {'tok/s':>8s} {'alloc GB':>9s} {'reserved GB':>12s} {'retries':>8s}")
    for name in ("hold-w1c", "hold-w1u", "hold-bloom"):
        part = parts.get(name, {})
        for label, r in part.get("runs", {}).items():
            s = r.get("summary") or {}
            alloc, reserved = s.get("peak_gpu_bytes"), s.get("peak_gpu_reserved_bytes")
            retries = (s.get("gpu_allocator") or {}).get("num_alloc_retries")
            print(
                f"{name + ' ' + label:22s} {fmt(s.get('tok_s'), '8.1f')} "
                f"{fmt(alloc and alloc / 1e9, '9.2f')} {fmt(reserved and reserved / 1e9, '12.2f')} "
                f"{fmt(retries, '8d')}"
            )


def main() -> int:
    args = parse_args()
    budget, work, results = bench.start(args, "validate_jobs", __doc__.split("\n\n")[0])
    env = bench.child_env()
    wanted = args.parts.split(",")
    if args.profile is None and "profile" not in wanted:
        wanted.insert(0, "profile")

    def run(name: str) -> dict[str, Any]:
        if name == "profile":
            return profile_part(args, budget, work, env)
        if args.profile is None:
            return {"skipped": "no profile"}
        if name == "jobs":
            return jobs_part(args, budget, work, env)
        if name == "hold-bloom" and args.smoke:
            return {"skipped": "a smoke run's hold is W1c's and W1u's toys"}
        if name == "caps-test":
            cmd = [sys.executable, "-m", "pytest", "--quiet", "-m", "gpu", "tests/test_gpu_caps.py"]
            return bench.run_part(name, cmd, min(TIMES[name][0], budget.left()), work, env)
        return hold_part(name, args, budget, work, env)

    bench.run_parts(wanted, lambda name: TIMES[name][1], run, results, budget)
    results.data["seconds"] = budget.elapsed()
    results.save()
    report(results.data)
    print(f"\nresults: {results.paths[-1]} ({time.strftime('%H:%M:%S')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
