"""`offload-run`: generate text for prompts with a model, print or write JSONL."""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path

from offload.cli.common import parse_size, run_cli, setup_logging
from offload.engine import LLM
from offload.errors import UserError
from offload.executor.caps import MemoryCaps
from offload.policies.policy import Policy
from offload.prompts import PromptRequest, read_prompts
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
    src.add_argument("--prompts", type=Path, help="JSONL ({'prompt', 'id'}) or text, one a line")
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
    p.add_argument("--cpu-mem", help="CPU memory cap, e.g. 100GB")
    p.add_argument("--nvme", type=Path, help="directory for the weight store and KV spill")
    p.add_argument("--trace", type=Path, help="write a Chrome/Perfetto trace of the last step here")
    p.add_argument("-q", "--quiet", action="store_true", help="print only errors and results")
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


def _write_jsonl(path: Path | None, rows: list[dict]) -> None:
    lines = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    if path is None:
        sys.stdout.write(lines)
        return
    partial = path.with_name(path.name + ".partial")
    with partial.open("w", encoding="utf-8") as f:
        f.write(lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.quiet)
    return run_cli("offload-run", lambda: _run(args))


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
        raise UserError(
            "--gpu-mem, --cpu-mem and --nvme need --policy FILE (the plan search is not built yet)"
        )
    if args.nvme is not None and args.nvme.exists() and not args.nvme.is_dir():
        raise UserError(f"--nvme {args.nvme} is not a directory")
    if args.prompts is not None:
        requests = read_prompts(args.prompts)
    else:
        requests = [PromptRequest(str(n), text) for n, text in enumerate(args.prompt, 1)]
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
    try:
        outs = llm.generate([r.prompt for r in requests], params, chat=chat)
    finally:
        if args.trace is not None and policy is not None:
            llm.runner.tracer.write_chrome(args.trace)
        report = _executor_report(llm) if policy is not None else None
        llm.close()
    rows = [
        {
            "id": req.id,
            "prompt": req.prompt,
            "text": out.text,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "finish_reason": out.finish_reason,
        }
        for req, out in zip(requests, outs, strict=True)
    ]
    if args.output is None:
        for row in rows:
            print(f"[{row['id']}] {row['prompt']}\n{row['text']}\n")
    else:
        _write_jsonl(output, rows)
    s = llm.stats
    peak_rss_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    print(
        f"offload-run: {len(rows)} prompts, {s.generated_tokens} tokens generated in "
        f"{s.seconds:.2f} s ({s.tokens_per_second:.1f} tok/s; prefill {s.prefill_seconds:.2f} s, "
        f"decode {s.decode_seconds:.2f} s); load {load_seconds:.1f} s; peak RSS {peak_rss_gb:.2f} GB",
        file=sys.stderr,
    )
    if report:
        print(report, file=sys.stderr)
    return 0


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
