"""What the end-to-end benchmark scripts share (scripts/bench_throughput.py and
scripts/bench_176b.py): every part runs as a subprocess with its own timeout inside
one time budget, the machine's copy ceilings are measured beside the runs, prompts
have an exact length, and the results JSON is rewritten after every part, so a part
that fails, hangs or is cut off by the budget still leaves the others' numbers.

    python scripts/benchlib.py ceilings OUT.json [--disk-dir DIR] [--bytes N]

measures the ceilings in a process of its own (the parent never touches CUDA: a CUDA
context in it would count in its children's GPU peaks, which read the device's free
memory).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

GB = 1e9
ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
RESULTS = ROOT / "benchmarks" / "results"
# a smoke run's model: the preset's architecture at toy sizes (keys the preset lacks stay out)
SMOKE_SIZES = {
    "hidden_size": 64,
    "word_embed_proj_dim": 64,
    "ffn_dim": 256,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "vocab_size": 512,
}


# -- the machine ----------------------------------------------------------------------
def measure_ceilings(disk_dir: Path | None, nbytes: int = 2**29) -> dict[str, Any]:
    """This machine's copy rates now, GB/s: pinned host -> GPU and GPU -> host (PCIe),
    GPU -> GPU and host -> host (HBM and DRAM, bytes read + written, as the hardware
    profile counts them) and O_DIRECT disk read and write in `disk_dir`. Without CUDA,
    host copies stand in for PCIe and HBM (as in `policies.measure`). A figure that
    cannot be measured is None, with the reason under "errors"."""
    import torch

    from offload.policies.measure_disk import disk_rates
    from offload.policies.timers import copy_rate

    out: dict[str, Any] = {"bytes": nbytes, "torch": torch.__version__, "errors": {}}
    out["cuda"] = torch.version.cuda
    out["has_cuda"] = torch.cuda.is_available()
    try:
        src, dst = (torch.empty(nbytes, dtype=torch.uint8) for _ in range(2))
        out["dram_copy_gbps"] = 2 * copy_rate(src, dst)
        del src, dst
    except RuntimeError as exc:
        out["dram_copy_gbps"], out["errors"]["dram"] = None, str(exc)
    if out["has_cuda"]:
        out["device"] = torch.cuda.get_device_name()
        try:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            gpu, gpu2 = (torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2))
            out["h2d_pinned_gbps"] = copy_rate(host, gpu)
            out["d2h_pinned_gbps"] = copy_rate(gpu, host)
            out["hbm_copy_gbps"] = 2 * copy_rate(gpu, gpu2)
            del host, gpu, gpu2
        except RuntimeError as exc:
            out["errors"]["gpu"] = str(exc)
    else:
        out["device"] = f"CPU only ({platform.processor() or 'cpu'})"
        out["stand_in"] = "no CUDA: host-to-host copies stand in for PCIe and HBM"
        copy = out["dram_copy_gbps"]
        out["h2d_pinned_gbps"] = out["d2h_pinned_gbps"] = copy / 2 if copy else None
        out["hbm_copy_gbps"] = copy
    if disk_dir is not None:
        try:
            read, write = disk_rates(Path(disk_dir), min(2 * nbytes, 2**30))
            out["disk_read_gbps"], out["disk_write_gbps"] = read, write
            out["disk_dir"] = str(disk_dir)
        except OSError as exc:
            out["errors"]["disk"] = str(exc)
    return out


def machine_info() -> dict[str, Any]:
    """Where and with what the numbers were taken (no CUDA call: see the module doc)."""
    from offload.policies.memory_limit import node_memory_limit

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    def git(*args: str) -> str:  # "" where there is no git or no .git (a copied tree)
        try:
            done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT)
        except OSError:
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    limit, source = node_memory_limit()
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "node_memory_bytes": limit,
        "node_memory_source": source,
        "python": platform.python_version(),
        "torch": version("torch"),
        "triton": version("triton"),
        "flexgen": version("flexgen"),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "source_sha256": source_digest(),
    }


def source_digest() -> str:
    """sha256 over offload/ (*.py and the C kernels' *.c) and scripts/ (*.py), by path:
    the code's version where the tree was copied without its .git."""
    digest = hashlib.sha256()
    package = [p for p in (ROOT / "offload").rglob("*") if p.suffix in (".py", ".c")]
    for path in sorted([*package, *SCRIPTS.glob("*.py")]):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


# -- parts as subprocesses --------------------------------------------------------------
@dataclass
class Budget:
    """Seconds the whole script may take; `reserve_s` is kept for the final report."""

    seconds: float
    reserve_s: float = 15.0
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - self.reserve_s - (time.monotonic() - self.started)

    def elapsed(self) -> float:
        return time.monotonic() - self.started


def child_env() -> dict[str, str]:
    """The children's environment: this one, with this checkout first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


SMOKE_CACHE = Path(tempfile.gettempdir()) / "offload-bench-smoke-cache"


def smoke_environment() -> None:
    """A smoke run, this process and its children: no CUDA, and a hardware profile of
    its own in SMOKE_CACHE, kept for the next smoke run (measuring it takes most of a
    minute on a small machine); the user's cached profile is neither read nor replaced."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["OFFLOAD_CACHE"] = str(SMOKE_CACHE)


def _tail(path: Path, chars: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - chars))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the child's process group, SIGKILL after 10 s."""
    for sig, wait_s in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _hung_after_traceback(err_path: Path, quiet_s: float, last_growth: float) -> bool:
    """A Python traceback on stderr and no output since: a child whose non-daemon
    threads keep it alive after its main thread died (FlexGen's copy threads do)."""
    return (
        time.monotonic() - last_growth > quiet_s
        and "Traceback (most recent call last)" in _tail(err_path, 20000)
    )


def run_part(
    name: str,
    cmd: Sequence[str],
    timeout_s: float,
    log_dir: Path,
    env: dict[str, str],
    hung_after_traceback_s: float | None = None,
) -> dict[str, Any]:
    """Run `cmd` until it exits, `timeout_s` passes, or (given `hung_after_traceback_s`)
    it prints a traceback and then nothing for that long; then its process group is
    killed. (Only for children whose tracebacks are fatal: offload-run with --quiet is
    silent for minutes while it loads.) stdout and stderr go to files in `log_dir`; the
    record holds the command, the exit code, the wall time and the output's tails
    (longer on failure)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out_path, err_path = log_dir / f"{name}.stdout", log_dir / f"{name}.stderr"
    started = last_growth = time.monotonic()
    deadline = started + max(1.0, timeout_s)
    killed, size = None, 0
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(
            list(cmd), stdout=out, stderr=err, env=env, cwd=ROOT, start_new_session=True
        )
        try:
            while proc.poll() is None:
                now = time.monotonic()
                grown = out_path.stat().st_size + err_path.stat().st_size
                if grown != size:
                    size, last_growth = grown, now
                if now >= deadline:
                    killed = "timed out"
                elif hung_after_traceback_s is not None and _hung_after_traceback(
                    err_path, hung_after_traceback_s, last_growth
                ):
                    killed = f"hung {hung_after_traceback_s:.0f} s after a traceback"
                if killed:
                    _kill_group(proc)
                    break
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=min(2.0, max(0.1, deadline - now)))
        except BaseException:  # this script interrupted: take the child down with it
            _kill_group(proc)
            raise
    failed = killed is not None or proc.returncode != 0
    chars = 6000 if failed else 1500
    return {
        "cmd": shlex.join(cmd),
        "rc": proc.returncode,
        "timed_out": killed == "timed out",
        "killed": killed,
        "timeout_s": round(timeout_s, 1),
        "seconds": round(time.monotonic() - started, 2),
        "ok": not failed,
        "stdout": str(out_path),
        "stderr_tail": _tail(err_path, chars),
        "stdout_tail": _tail(out_path, chars // 2),
    }


def exit_on_sigterm() -> None:
    """SIGTERM (a wall-clock limit) unwinds like Ctrl-C: the running child is killed
    and the results written so far stay written."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


class Results:
    """The results JSON, rewritten whole after every part: in benchmarks/results/ and,
    where the environment names one, in $OUT."""

    def __init__(self, name: str, data: dict[str, Any], out_dir: Path = RESULTS) -> None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.data = {"started": stamp, **data}
        self.paths = [out_dir / f"{name}_{stamp}.json"]
        if os.environ.get("OUT"):
            self.paths.append(Path(os.environ["OUT"]) / self.paths[0].name)

    def save(self) -> None:
        from offload.io.atomic import atomic_write

        text = json.dumps(self.data, indent=1, default=str)
        for path in self.paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(path, text)


def ceilings_part(
    budget: Budget, log_dir: Path, env: dict[str, str], disk_dir: Path | None, nbytes: int
) -> dict[str, Any]:
    """The ceilings, measured in a child process (at most 120 s)."""
    out = log_dir / "ceilings.json"
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "ceilings",
        str(out),
        "--bytes",
        str(nbytes),
    ]
    if disk_dir is not None:
        cmd += ["--disk-dir", str(disk_dir)]
    record = run_part("ceilings", cmd, min(120.0, budget.left()), log_dir, env)
    if out.is_file():
        record["measured"] = json.loads(out.read_text())
    return record


# -- our engine: plan, then run one block ---------------------------------------------
def doc_parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring's first paragraph as the description, the
    rest (its parts and commands) as the epilog, as written."""
    return argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        epilog=doc.split("\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def check_names(p: argparse.ArgumentParser, flag: str, value: str, known: Sequence[str]) -> None:
    """Refuse a comma-separated flag value that names anything not in `known`."""
    unknown = set(value.split(",")) - set(known)
    if unknown:
        p.error(f"{flag}: unknown {', '.join(sorted(unknown))}; choose from {', '.join(known)}")


def add_probe_args(p: argparse.ArgumentParser) -> None:
    """The flags of the scripts that probe a policy's steps on a model with dummy
    weights (scripts/lab/decode_step.py)."""
    p.add_argument("--model", default="opt-30b", help="a preset (dummy weights)")
    p.add_argument("--policy", type=Path, required=True, help="policy JSON (offload-plan's)")
    p.add_argument("--compress", default="none")
    p.add_argument("--kv-compress", default="none")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))


def probe_llm(args: argparse.Namespace, gen_len: int):
    """The engine on `add_probe_args`' model and policy, fp16 dummy weights (loaded and
    warmed up)."""
    from offload.api.llm import LLM

    return LLM(
        args.model,
        dummy=True,
        dtype="float16",
        compress=args.compress,
        kv_compress=args.kv_compress,
        policy=args.policy,
        gen_len=gen_len,
    )


def write_prompts(path: Path, count: int, length: int) -> None:
    """`count` requests of exactly `length` ASCII characters: `length` tokens under the
    byte tokenizer of dummy presets. Drawn by scripts/make_prompts.py (seed 0), cut."""
    raw = path.with_name(path.stem + ".raw.jsonl")
    cmd = [sys.executable, str(SCRIPTS / "make_prompts.py"), str(count), str(raw)]
    cmd += ["--min-chars", str(length + 1), "--max-chars", str(length + 64)]
    subprocess.run(cmd, check=True)
    with open(raw) as src, open(path, "w") as dst:
        for line in src:
            row = json.loads(line)
            row["prompt"] = row["prompt"][:length]
            assert len(row["prompt"].encode()) == length, row
            dst.write(json.dumps(row) + "\n")
    raw.unlink()


def smoke_model(preset: str, directory: Path) -> Path:
    """A Hugging Face config directory of `preset`'s architecture at toy sizes."""
    from offload.core.presets import PRESETS

    config = {k: SMOKE_SIZES.get(k, v) for k, v in PRESETS[preset].items()}
    if isinstance(config.get("layer_types"), list):  # one a layer (transformers checks it)
        config["layer_types"] = config["layer_types"][: config["num_hidden_layers"]]
    path = directory / f"smoke-{preset}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def compression_flag(c: dict[str, Any] | None) -> str:
    """A policy's compression as the --compress / --kv-compress value."""
    if c is None:
        return "none"
    return f"int{c['bits']}-g{c['group_size']}{'-sym' if c['symmetric'] else ''}"


def _flag_value(flags: list[str], name: str) -> str | None:
    return flags[flags.index(name) + 1] if name in flags else None


def _with_flag(flags: list[str], name: str, value: str) -> list[str]:
    if name not in flags:
        return [*flags, name, value]
    i = flags.index(name)
    return [*flags[: i + 1], value, *flags[i + 2 :]]


def plan_and_run(
    name: str,
    engine_flags: list[str],
    prompt_len: int,
    gen_len: int,
    budget: Budget,
    cap_s: float,
    work: Path,
    env: dict[str, str],
    run_flags: Sequence[str] = (),
) -> dict[str, Any]:
    """offload-plan --json with `engine_flags`, then offload-run with the same flags over
    exactly one searched block of `prompt_len`-token prompts, every sequence generating
    `gen_len` tokens (--ignore-eos). Where the flags let the search choose a format
    (auto), the run is given the formats the plan chose, which spares it a second search
    over every format pair; the record says whether its policy matches the plan's."""
    deadline = time.monotonic() + min(cap_s, budget.left())
    part_dir = work / name
    part_dir.mkdir(parents=True, exist_ok=True)
    shape = ["--prompt-len", str(prompt_len), "--max-tokens", str(gen_len)]
    plan_flags = [f for f in engine_flags if f != "--dummy"]  # offload-plan reads configs only
    record: dict[str, Any] = {"engine_flags": shlex.join(engine_flags)}
    cmd = [sys.executable, "-m", "offload.cli.plan", *plan_flags, *shape, "--json"]
    record["plan"] = run_part(f"{name}-plan", cmd, deadline - time.monotonic(), part_dir, env)
    if not record["plan"]["ok"]:
        return record
    try:
        plan = json.loads(Path(record["plan"]["stdout"]).read_text())
    except ValueError as exc:
        record["plan"].update(ok=False, error=f"plan output is not JSON: {exc}")
        return record
    record["plan"]["json"] = plan
    record["profile"] = _profile()
    policy = plan["policy"]
    block = policy["gpu_batch_size"] * policy["num_gpu_batches"]
    run_engine = list(engine_flags)
    for flag, key in (("--compress", "weight_compression"), ("--kv-compress", "kv_compression")):
        if _flag_value(run_engine, flag) == "auto":
            run_engine = _with_flag(run_engine, flag, compression_flag(policy[key]))
    prompts, outputs, stats = (part_dir / n for n in ("prompts.jsonl", "out.jsonl", "stats.json"))
    write_prompts(prompts, block, prompt_len)
    record |= {"sequences": block, "run_engine_flags": shlex.join(run_engine)}
    cmd = [sys.executable, "-m", "offload.cli.run", *run_engine, *shape, "--ignore-eos"]
    cmd += ["-i", str(prompts), "-o", str(outputs), "--stats", str(stats), "--quiet", *run_flags]
    record["run"] = run_part(f"{name}-run", cmd, deadline - time.monotonic(), part_dir, env)
    if stats.is_file():
        record["stats"] = json.loads(stats.read_text())
        record["policy_matches_plan"] = record["stats"].get("policy") == policy
    record["outputs"] = _check_outputs(outputs, prompt_len, gen_len)
    record["summary"] = _summary(record, block, prompt_len, gen_len)
    return record


def _profile() -> dict[str, Any] | None:
    """The hardware profile the plan searched with (cached by the plan's child)."""
    from offload.core.errors import UserError
    from offload.policies.hardware import load_profile

    try:
        hw = load_profile()
    except UserError:
        return None
    return asdict(hw) if hw else None


def _check_outputs(path: Path, prompt_len: int, gen_len: int) -> dict[str, Any]:
    """Every result: the prompt's tokens and the generated ones as asked?"""
    if not path.is_file():
        return {"rows": 0}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    exact = [
        r.get("prompt_tokens") == prompt_len and r.get("completion_tokens") == gen_len for r in rows
    ]
    return {
        "rows": len(rows),
        "exact_lengths": sum(exact),
        "errors": sum("error" in r for r in rows),
    }


def _summary(record: dict[str, Any], block: int, prompt_len: int, gen_len: int) -> dict[str, Any]:
    """Measured against predicted, from the stats and the plan."""
    predicted = record["plan"]["json"]["predicted"]
    memory = record["plan"]["json"]["memory"]
    out: dict[str, Any] = {
        "sequences": block,
        "predicted_tok_s": predicted["total_tok_s"],
        "predicted_prefill_s": predicted["prefill_s"],
        "predicted_decode_step_s": predicted["decode_step_s"],
        "predicted_gpu_bytes": memory["gpu_bytes"],
        "predicted_cpu_bytes": memory["cpu_bytes"],
    }
    stats = record.get("stats")
    if not stats:
        return out
    seconds, peak = stats["seconds"], stats["peak_memory"]
    out |= {
        "tok_s": stats["tokens_per_second"],
        "generated_tokens": stats["generated_tokens"],
        "load_s": seconds["loading"],
        "prefill_s": seconds["prefill"],
        "decode_s": seconds["decode"],
        "decode_step_s": seconds["decode"] / max(1, gen_len - 1),
        "prefill_tok_s": block * prompt_len / seconds["prefill"] if seconds["prefill"] else None,
        "peak_gpu_bytes": peak["gpu_bytes"],
        "peak_gpu_reserved_bytes": peak.get("gpu_reserved_bytes"),
        "peak_rss_bytes": peak["cpu_rss_bytes"],
        "peak_disk_bytes": peak["disk_bytes"],
    }
    out["prediction_error_pct"] = 100 * (out["tok_s"] / out["predicted_tok_s"] - 1)
    checked = record.get("outputs", {})
    out["all_exact_lengths"] = checked.get("rows") == checked.get("exact_lengths") == block
    return out


def temp_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def fmt(value: float | None, spec: str = ".1f", unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def _ceilings_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python scripts/benchlib.py ceilings")
    p.add_argument("out", type=Path)
    p.add_argument("--disk-dir", type=Path)
    p.add_argument("--bytes", type=int, default=2**29)
    args = p.parse_args(argv)
    measured = measure_ceilings(args.disk_dir, args.bytes)
    args.out.write_text(json.dumps(measured, indent=1))
    print(json.dumps(measured, indent=1))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] != ["ceilings"]:
        sys.exit("usage: python scripts/benchlib.py ceilings OUT.json [--disk-dir DIR] [--bytes N]")
    sys.exit(_ceilings_main(sys.argv[2:]))


def start(args, name: str, what: str) -> tuple[Budget, Path, Results]:
    """A benchmark script's start: SIGTERM handled, its time budget, a work directory
    (and `args.nvme` in it unless given), the smoke environment when asked, and its
    results file with what the run is and where."""
    exit_on_sigterm()
    budget = Budget(args.time_budget)
    work = temp_dir(name.replace("_", "-") + "-")
    if args.smoke:
        smoke_environment()
    args.nvme = args.nvme or work / "nvme"
    results = Results(
        name + ("_smoke" if args.smoke else ""),
        {
            "what": what,
            "smoke": args.smoke,
            "args": {k: str(v) for k, v in vars(args).items()},
            "machine": machine_info(),
            "workdir": str(work),
            "parts": {},
        },
    )
    return budget, work, results


def finish(results: Results, budget: Budget, print_table: Callable[[dict], None]) -> None:
    """A benchmark's end, whatever happened: its seconds saved with the results, the
    table printed and where the JSON went."""
    results.data["seconds"] = budget.elapsed()
    results.save()
    print_table(results.data)
    print("wrote " + ", ".join(map(str, results.paths)))


def run_parts(
    names: list[str],
    min_seconds: Callable[[str], float],
    run: Callable[[str], dict[str, Any]],
    results: Results,
    budget: Budget,
    status: Callable[[dict[str, Any]], str] = lambda record: "done",
) -> None:
    """Each part in order, if the budget still holds its minimum time: `run(name)`'s
    record lands in the results (saved after every part); a harness fault in one part
    is recorded as its error and never loses the others."""
    parts = results.data["parts"]
    for name in names:
        min_s = min_seconds(name)
        if budget.left() < min_s:
            parts[name] = {"skipped": f"time budget: {budget.left():.0f} s left, needs {min_s}"}
            print(f"[{budget.elapsed():5.0f} s] {name}: skipped (time budget)", flush=True)
            continue
        print(f"[{budget.elapsed():5.0f} s] {name} ...", flush=True)
        try:
            parts[name] = run(name)
        except Exception as exc:  # a harness fault in one part must not lose the others
            parts[name] = {"error": f"{type(exc).__name__}: {exc}"}
        results.save()
        print(f"[{budget.elapsed():5.0f} s] {name}: {status(parts[name])}", flush=True)
