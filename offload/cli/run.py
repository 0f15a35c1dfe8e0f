"""`offload-run`: generate text for prompts with a model, print or write JSONL."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

from offload import jobs
from offload.cli.common import (
    COMPRESS_HELP,
    KV_COMPRESS_HELP,
    parse_compression,
    parse_kv_compression,
    parse_size,
    run_cli,
    setup_logging,
)
from offload.engine import LLM
from offload.errors import UserError
from offload.executor.caps import MemoryCaps
from offload.io.tiers import Tier
from offload.policies.policy import Policy
from offload.sampling import SamplingParams

log = logging.getLogger("offload")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="offload-run",
        description="Generate completions for prompts. --model takes 'demo' (the built-in "
        "SmolLM2-135M-Instruct), a preset name (dummy weights), a hub repo id or a local "
        "path (Hugging Face directory or .gguf file).",
    )
    p.add_argument("--model", required=True, help="demo, a preset, a hub repo id or a path")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    src.add_argument(
        "--prompts",
        type=Path,
        help="JSONL (id, prompt or messages, optional max_new_tokens, temperature, top_p, "
        "top_k, seed, stop) or plain text, one request a line; '-' reads standard input",
    )
    p.add_argument("--output", help="write results as JSONL here ('-' for stdout)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 switches top-k off")
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument(
        "--chat-template",
        choices=("auto", "on", "off"),
        default="auto",
        help="render prompts as user messages with the tokenizer's chat template "
        "(auto: when it has one)",
    )
    p.add_argument("--batch-size", type=int, default=16, help="sequences per batch")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--dummy", action="store_true", help="random weights of the model's shape")
    p.add_argument(
        "--policy", type=Path, help="placement policy JSON (runs the offloading executor)"
    )
    p.add_argument("--gpu-mem", help="GPU memory cap, e.g. 24GB")
    p.add_argument("--cpu-mem", help="CPU memory cap, e.g. 100GB (default: 90%% of the RAM)")
    p.add_argument("--nvme", type=Path, help="directory for the weight store and KV spill")
    p.add_argument("--trace", type=Path, help="write a Chrome/Perfetto trace of the last step here")
    p.add_argument(
        "--prompt-len", type=int, default=512, help="typical prompt tokens (plan search)"
    )
    p.add_argument("--profile", type=Path, help="hardware profile JSON for the plan search")
    p.add_argument("--compress", default="none", help=COMPRESS_HELP)
    p.add_argument("--kv-compress", default="none", help=KV_COMPRESS_HELP)
    p.add_argument(
        "--restart", action="store_true", help="discard an unfinished job's results and start over"
    )
    p.add_argument(
        "--skip-invalid", action="store_true", help="record malformed lines as errors and go on"
    )
    p.add_argument("--stats", type=Path, help="write the run's summary as JSON here")
    p.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bar; errors and results only"
    )
    # tensor / data parallelism (offload.parallel, docs/parallel.md)
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        help="tensor-parallel ranks, one per GPU (started through torch.distributed's "
        "elastic launcher; under torchrun: its world size / --dp)",
    )
    p.add_argument(
        "--dp", type=int, default=1, help="data-parallel groups of --tp ranks (needs --output)"
    )
    return p


def _check_output(output: str | None) -> Path | None:
    """Fail before any model loading when the output cannot be written."""
    if output in (None, "-"):
        return None
    path = Path(output)
    if path.is_dir():
        raise UserError(f"--output {path} is a directory; give a file path")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UserError(f"cannot write --output {path}: directory {parent} is missing or read-only")
    if path.exists() and not os.access(path, os.W_OK):
        raise UserError(f"cannot write --output {path}: the file is read-only")
    return path


def _sampling(args: argparse.Namespace) -> SamplingParams:
    try:
        return SamplingParams(
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop=tuple(args.stop),
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None


class _MemorySink:
    """Results of a job that is not written to a file (printed at the end)."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.done_count = 0

    def done(self, index: int) -> bool:
        return False

    def append(self, rows: list[dict]) -> None:
        self.rows += rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.quiet)
    from offload.parallel import job as parallel_job

    if parallel_job.wanted(args):  # several ranks: start them, or run as one
        argv = sys.argv[1:] if argv is None else argv
        return run_cli("offload-run", lambda: parallel_job.main(args, argv))
    return run_cli("offload-run", lambda: _run(args))


def _searched_policy(args: argparse.Namespace, params: SamplingParams) -> Policy:
    """The plan search's policy for these caps (offload-plan's answer), printed at start."""
    from offload.cli.plan import _caps, _profile
    from offload.engine import resolve_device, resolve_dtype
    from offload.models.resolve import resolve_model
    from offload.policies.search import search

    if not args.gpu_mem:
        raise UserError(
            "give --gpu-mem with --cpu-mem or --nvme so the plan search knows the GPU budget"
        )
    cfg = resolve_model(args.model, dummy=True).config
    hw = _profile(args)
    caps = _caps(args, hw)
    dtype = resolve_dtype(args.dtype, resolve_device(args.device), cfg.checkpoint_dtype)
    best = search(
        cfg,
        dtype,
        args.prompt_len,
        params.max_new_tokens,
        hw,
        caps,
        compressions=parse_compression(args.compress),
        kv_compressions=parse_kv_compression(args.kv_compress),
    )
    log.info(
        "searched policy: predicted %.1f tok/s, bottleneck %s", best.total_tok_s, best.bottleneck
    )
    return best.policy


def _fingerprint(args: argparse.Namespace, params: SamplingParams, input_sha: str) -> dict:
    """What must match for a job to resume: the input bytes and the generation settings."""
    return {
        "input_sha256": input_sha,
        "model": args.model,
        "dummy": args.dummy,
        "dtype": args.dtype,
        "sampling": json.loads(json.dumps(params.__dict__)),
        "chat_template": args.chat_template,
        "skip_invalid": args.skip_invalid,
    }


def _run(args: argparse.Namespace) -> int:
    params = _sampling(args)
    if args.batch_size < 1:
        raise UserError(f"--batch-size must be >= 1, got {args.batch_size}")
    output = _check_output(args.output)
    policy = Policy.from_file(args.policy) if args.policy else None
    caps = MemoryCaps(
        gpu_bytes=parse_size(args.gpu_mem) if args.gpu_mem else None,
        cpu_bytes=parse_size(args.cpu_mem) if args.cpu_mem else None,
    )
    if policy is None and (args.gpu_mem or args.cpu_mem or args.nvme):
        policy = _searched_policy(args, params)
    if args.nvme is not None and args.nvme.exists() and not args.nvme.is_dir():
        raise UserError(f"--nvme {args.nvme} is not a directory")
    # Input: check every line before any model loading or generation.
    spooled = None
    if args.prompts is not None:
        path = args.prompts
        if str(path) == "-":
            path = spooled = jobs.spool_stdin(
                output.parent if output else Path(tempfile.gettempdir())
            )
        total, input_sha = jobs.scan(path, args.skip_invalid)
        requests = jobs.iter_requests(path, params)
    else:
        texts = args.prompt
        total = len(texts)
        input_sha = hashlib.sha256(json.dumps(texts).encode()).hexdigest()
        requests = (jobs.make_request(i, {"prompt": t}, params) for i, t in enumerate(texts))
    sink = (
        jobs.ResultLog(output, _fingerprint(args, params, input_sha), args.restart)
        if output
        else _MemorySink()
    )
    stats = jobs.JobStats(total=total, skipped=sink.done_count)
    if stats.skipped:
        log.info("resuming: %d of %d requests already done", stats.skipped, total)
    started = time.perf_counter()
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        dummy=args.dummy,
        batch_size=args.batch_size,
        progress=not args.quiet,
        policy=policy,
        caps=caps,
        nvme=args.nvme,
        trace=args.trace is not None,
    )
    load_seconds = time.perf_counter() - started
    chat = args.chat_template == "on" or (
        args.chat_template == "auto" and llm.tokenizer.has_chat_template
    )
    if args.chat_template == "on" and not llm.tokenizer.has_chat_template:
        raise UserError("--chat-template on, but this model's tokenizer has no chat template")
    log.info(
        "model %s (%s, %.0fM parameters) on %s in %s; loaded in %.1f s",
        llm.spec.name,
        llm.spec.kind,
        llm.config.param_count() / 1e6,
        llm.device,
        str(llm.dtype).removeprefix("torch."),
        load_seconds,
    )
    if policy is not None:
        log.info("policy %s", policy.to_json())
    if args.prompt:  # command-line prompts: a bad one fails the run before generating
        requests = list(requests)
        for req in requests:
            if req.error:
                llm.close()
                raise UserError(f"prompt {req.id}: {req.error}")
            try:
                llm.check_prompt(jobs.encode_request(llm, req, chat))
            except UserError:
                llm.close()
                raise
    bar = _progress(args, stats, llm)
    try:
        with jobs.StopFlag() as stop:
            jobs.run_job(
                llm, requests, sink, stats, chat, stop, on_block=bar.update if bar else None
            )
    except KeyboardInterrupt:
        stats.interrupted = True
    finally:
        if bar:
            bar.close()
        if args.trace is not None and policy is not None:
            llm.runner.tracer.write_chrome(args.trace)
        report = _executor_report(llm) if policy is not None else None
        llm.close()
        if spooled is not None and not stats.interrupted:
            spooled.unlink(missing_ok=True)
    done = stats.done + stats.skipped
    if stats.interrupted:
        if isinstance(sink, jobs.ResultLog):
            sink.close()
            print(
                f"offload-run: interrupted with {done} of {total} requests done (kept in "
                f"{sink.partial}); run the same command again to resume",
                file=sys.stderr,
            )
        return 130
    if isinstance(sink, jobs.ResultLog):
        sink.finalize(total)
    elif args.output == "-":
        rows = sorted(sink.rows, key=lambda r: r["_index"])
        for row in rows:
            row.pop("_index")
        sys.stdout.write("".join(json.dumps(_order(r), ensure_ascii=False) + "\n" for r in rows))
    else:
        for row in sorted(sink.rows, key=lambda r: r["_index"]):
            text = row["text"] if row["finish_reason"] != "error" else f"error: {row['error']}"
            print(f"[{row['id']}] {row.get('prompt', '')}\n{text}\n")
    summary = _summary(args, llm, stats, load_seconds, policy)
    if args.stats is not None:
        args.stats.write_text(json.dumps(summary, indent=1))
    s = llm.stats
    print(
        f"offload-run: {total} requests, {s.generated_tokens} tokens generated in "
        f"{s.seconds:.2f} s ({s.tokens_per_second:.1f} tok/s; prefill {s.prefill_seconds:.2f} s, "
        f"decode {s.decode_seconds:.2f} s); load {load_seconds:.1f} s; peak RSS "
        f"{summary['peak_memory']['cpu_rss_bytes'] / 1e9:.2f} GB; "
        + ", ".join(f"{k} {v}" for k, v in sorted(stats.reasons.items())),
        file=sys.stderr,
    )
    if report:
        print(report, file=sys.stderr)
    return 0


def _order(row: dict) -> dict:
    keys = ("id", "prompt", "text", "prompt_tokens", "completion_tokens", "finish_reason", "error")
    return {k: row[k] for k in keys if k in row}


def _peak_rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _peak_memory(llm: LLM) -> dict:
    import torch

    out = {"cpu_rss_bytes": _peak_rss(), "gpu_bytes": 0, "disk_bytes": 0}
    if llm.device.type == "cuda":
        from offload.executor.caps import cuda_context_bytes

        out["gpu_bytes"] = torch.cuda.max_memory_allocated(llm.device) + cuda_context_bytes(
            llm.device
        )
    ledger = getattr(llm.runner, "ledger", None)
    if ledger is not None:
        out["disk_bytes"] = ledger.peak(Tier.DISK)
    return out


def _summary(args, llm: LLM, stats: jobs.JobStats, load_seconds: float, policy) -> dict:
    s = llm.stats
    return {
        "requests": stats.total,
        "done_now": stats.done,
        "done_before": stats.skipped,
        "finish_reasons": dict(stats.reasons),
        "generated_tokens": s.generated_tokens,
        "tokens_per_second": s.tokens_per_second,
        "seconds": {
            "loading": load_seconds,
            "prefill": s.prefill_seconds,
            "decode": s.decode_seconds,
            "wall": time.perf_counter() - stats.started,
        },
        "policy": policy.to_dict() if policy else None,
        "peak_memory": _peak_memory(llm),
    }


def _progress(args, stats: jobs.JobStats, llm: LLM):
    """A progress bar: requests, tokens, tok/s now and on average, phase, peak memory."""
    if args.quiet:
        return None
    from tqdm import tqdm

    bar = tqdm(
        total=stats.total, initial=stats.skipped, unit="req", dynamic_ncols=True, file=sys.stderr
    )
    last = {"t": time.perf_counter(), "tokens": 0, "rate": 0.0}

    def set_phase(name: str) -> None:
        stats.phase = name
        bar.set_postfix_str(_postfix(), refresh=True)

    def _postfix() -> str:
        gen, avg, cur = llm.stats.generated_tokens, llm.stats.tokens_per_second, last["rate"]
        mem = _peak_memory(llm)
        gpu = f" GPU {mem['gpu_bytes'] / 1e9:.1f}GB" if mem["gpu_bytes"] else ""
        return (
            f"{gen} tok, {cur:.1f} tok/s now, {avg:.1f} avg, {stats.phase}, "
            f"RSS {mem['cpu_rss_bytes'] / 1e9:.1f}GB{gpu}"
        )

    def update() -> None:
        now, gen = time.perf_counter(), llm.stats.generated_tokens
        last["rate"] = (gen - last["tokens"]) / max(now - last["t"], 1e-9)  # over the last block
        last["t"], last["tokens"] = now, gen
        bar.n = stats.done + stats.skipped
        bar.set_postfix_str(_postfix(), refresh=True)

    llm.on_phase = set_phase

    class _Bar:
        def update(self) -> None:
            update()

        def close(self) -> None:
            bar.close()

    return _Bar()


def _executor_report(llm: LLM) -> str:
    """Per-lane busy time and bandwidth, overlap efficiency, and measured peaks."""
    import torch

    runner = llm.runner
    lines = []
    if runner.traces:
        last = runner.traces[-1]
        lane, busy = last.busiest
        lines.append(
            f"last step {last.seconds * 1e3:.1f} ms; busiest lane {lane} {busy * 1e3:.1f} ms; "
            f"overlap efficiency {busy / last.seconds:.2f}"
        )
        for name, stats in last.lanes.items():
            rate = stats["bytes"] / stats["busy_s"] / 1e9 if stats["busy_s"] else 0.0
            lines.append(f"  {name:9s} busy {stats['busy_s'] * 1e3:8.1f} ms  {rate:7.2f} GB/s")
    gpu_peak = 0
    if llm.device.type == "cuda":
        from offload.executor.caps import cuda_context_bytes

        gpu_peak = torch.cuda.max_memory_allocated(llm.device) + cuda_context_bytes(llm.device)
    hwm = 0
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
    lines.append(
        f"peak GPU {gpu_peak / 1e9:.2f} GB (allocated + CUDA context); peak host RSS {hwm / 1e9:.2f} GB"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
