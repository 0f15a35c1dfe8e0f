"""`offload-run --tp N [--dp M]`: one rank's side of a job, and the way into it.

`main` either starts the ranks (`launch.launch`, when not already inside a launcher) or
is one of them (`run_rank`): join the process groups, agree on the policy and the job's
sampling seed, take this data-parallel group's requests, run the engine over this
rank's shard. TP rank 0 of each group alone writes results, world rank 0 alone shows
progress, writes the trace and merges the groups' results.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from offload import data_parallel as data
from offload import jobs
from offload.engine import LLM, resolve_device, resolve_dtype
from offload.errors import UserError
from offload.models.resolve import resolve_model
from offload.parallel.comm import Topology, env_world
from offload.parallel.launch import PEER_LOST
from offload.parallel.rank import rank_nvme
from offload.parallel.shard import check_divisible, rank_config
from offload.policies.caps import Caps
from offload.policies.memory_limit import node_memory_limit, rank_cpu_bytes
from offload.policies.policy import Policy

log = logging.getLogger("offload")


def wanted(args: argparse.Namespace) -> bool:
    """Whether this command runs ranks: --tp/--dp above 1, or started by torchrun."""
    found = env_world()
    return (args.tp or 1) * args.dp > 1 or (found is not None and found[1] > 1)


def main(args: argparse.Namespace, argv: list[str]) -> int:
    """Start the ranks (from a plain command line) or run as one (inside a launcher)."""
    if env_world() is None:
        if args.prompts is not None and str(args.prompts) == "-":
            raise UserError("--prompts - (standard input) cannot feed several ranks; use a file")
        check_divisible(resolve_model(args.model, dummy=True).config, args.tp or 1)
        from offload.cli.run import main as cli_main
        from offload.parallel.launch import launch

        return launch("offload-run", cli_main, argv, (args.tp or 1) * args.dp, args.device == "cpu")
    return run_rank(args)


def run_rank(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    topo = Topology.from_env(args.tp, args.dp, device)
    if topo.rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // topo.local_world))
    try:
        return _run_rank(args, topo)
    except UserError as exc:
        print(f"offload-run[rank {topo.rank}]: error: {exc}", file=sys.stderr)
        return 2
    except dist.DistError as exc:  # a peer died under a collective: the cause is elsewhere
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"offload-run[rank {topo.rank}]: lost contact with a rank ({first})", file=sys.stderr)
        return PEER_LOST
    finally:
        topo.close()


def _policy(args, topo: Topology, params, cfg) -> tuple[Policy | None, MemoryCaps]:
    """The policy every rank runs (world rank 0's) and this rank's caps: --gpu-mem per
    GPU, --cpu-mem (default: the node's limit) shared by the node's ranks."""
    from offload.cli.common import parse_compression, parse_kv_compression, parse_size

    node_cpu, where = (
        (parse_size(args.cpu_mem), "--cpu-mem") if args.cpu_mem else node_memory_limit()
    )
    caps = Caps(
        gpu_bytes=parse_size(args.gpu_mem) if args.gpu_mem else None,
        cpu_bytes=rank_cpu_bytes(node_cpu, topo.local_world),
    )
    if args.policy is not None:
        return Policy.from_file(args.policy), caps
    if not (args.gpu_mem or args.cpu_mem or args.nvme):
        return None, caps
    policy = None
    if topo.rank == 0:
        from offload.cli.plan import _profile
        from offload.policies.search import Caps, search

        if not args.gpu_mem:
            raise UserError("give --gpu-mem with --cpu-mem or --nvme so the plan search knows it")
        log.info(
            "CPU cap %.1f GB for the node from %s, %.1f GB per rank",
            node_cpu / 1e9,
            where,
            caps.cpu_bytes / 1e9,
        )
        dtype = resolve_dtype(args.dtype, topo.device, cfg.checkpoint_dtype)
        best = search(
            rank_config(cfg, topo.tp, 0),
            dtype,
            args.prompt_len,
            params.max_new_tokens,
            _profile(args),
            Caps(caps.gpu_bytes, caps.cpu_bytes, args.nvme is not None),
            compressions=parse_compression(args.compress),
            kv_compressions=parse_kv_compression(args.kv_compress),
        )
        log.info("searched policy per rank: predicted %.1f tok/s", best.total_tok_s)
        policy = best.policy
    return topo.share(policy), caps


class _RankSink:
    """A rank that writes no file: it skips what its group's writer already holds, and
    keeps the rows only where they are printed at the end (no --output)."""

    def __init__(self, done: set[int], keep_rows: bool) -> None:
        self._done, self.done_count = done, len(done)
        self.keep_rows, self.rows = keep_rows, []

    def done(self, index: int) -> bool:
        return index in self._done

    def append(self, rows: list[dict]) -> None:
        if self.keep_rows:
            self.rows += rows


def _requests(args, params):
    """(request iterator, total, input sha256), as offload-run reads them."""
    import hashlib

    if args.prompts is not None:
        total, sha = jobs.scan(args.prompts, args.skip_invalid)
        return jobs.iter_requests(args.prompts, params), total, sha
    sha = hashlib.sha256(json.dumps(args.prompt).encode()).hexdigest()
    reqs = (jobs.make_request(i, {"prompt": t}, params) for i, t in enumerate(args.prompt))
    return reqs, len(args.prompt), sha


def _run_rank(args, topo: Topology) -> int:
    from offload.cli.run import _check_output, _fingerprint, _sampling

    params = _sampling(args)
    output = _check_output(args.output)
    if topo.dp > 1 and output is None:
        raise UserError("--dp needs --output FILE (the groups' results are merged there)")
    spec = resolve_model(args.model, dummy=args.dummy)
    policy, caps = _policy(args, topo, params, spec.config)
    requests, total, sha = _requests(args, params)
    requests = data.seeded(
        data.group_requests(requests, topo.dp, topo.dp_index), topo.share(random.getrandbits(63))
    )
    sink = None
    if topo.is_leader and output is not None:
        path = data.group_output(output, topo.dp, topo.dp_index)
        sink = jobs.ResultLog(path, _fingerprint(args, params, sha), args.restart)
        done = {i for i in range(total) if sink.done(i)}
    else:
        done = set()
    done = topo.share(done, tp_only=True)
    sink = sink or _RankSink(done, keep_rows=output is None)
    stats = jobs.JobStats(total=total, skipped=len(done))
    if stats.skipped and topo.is_leader:
        log.info("group %d resuming: %d requests already done", topo.dp_index, stats.skipped)
    started = time.perf_counter()
    llm = LLM(
        spec,
        dtype=args.dtype,
        batch_size=args.batch_size,
        progress=topo.rank == 0 and not args.quiet,
        policy=policy,
        caps=caps,
        nvme=rank_nvme(args.nvme, topo.rank),
        trace=topo.rank == 0 and args.trace is not None,
        parallel=topo.tensor_parallel(spec.config),
    )
    log.info(
        "model %s on %d ranks (tp %d x dp %d), %s; loaded in %.1f s",
        spec.name,
        topo.world,
        topo.tp,
        topo.dp,
        llm.device.type,
        time.perf_counter() - started,
    )
    chat = args.chat_template == "on" or (
        args.chat_template == "auto" and llm.tokenizer.has_chat_template
    )
    try:
        with jobs.StopFlag() as stop:

            def agree_on_stop() -> None:  # every rank of a group stops after one block
                flag = torch.tensor([int(stop.requested)])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=topo.tp_control)
                stop.requested = bool(flag.item())

            jobs.run_job(llm, requests, sink, stats, chat, stop, on_block=agree_on_stop)
    except KeyboardInterrupt:
        stats.interrupted = True
    finally:
        if args.trace is not None and topo.rank == 0:
            llm.runner.tracer.write_chrome(args.trace)
        llm.close()
    return _finish(args, topo, llm, sink, stats, output, total)


def _finish(args, topo: Topology, llm, sink, stats, output: Path | None, total: int) -> int:
    interrupted = torch.tensor([int(stats.interrupted)])
    dist.all_reduce(interrupted, op=dist.ReduceOp.MAX, group=topo.control)
    if isinstance(sink, jobs.ResultLog):
        sink.close()
    if interrupted.item():
        if topo.rank == 0:
            print(
                "offload-run: interrupted; finished blocks are kept, run the same command "
                "again to resume",
                file=sys.stderr,
            )
        return 130
    if topo.rank == 0 and output is not None and topo.dp == 1:
        sink.finalize(total)
    topo.barrier()  # every group's results are on disk
    if topo.rank == 0 and output is not None and topo.dp > 1:
        data.merge_groups(output, topo.dp, total)
    if topo.rank == 0:
        if output is None:
            rows = sorted(sink.rows, key=lambda r: r["_index"])
            for row in rows:
                print(f"[{row['id']}] {row.get('prompt', '')}\n{row['text']}\n")
        s = llm.stats
        print(
            f"offload-run: {total} requests on {topo.world} ranks (tp {topo.tp} x dp "
            f"{topo.dp}); group 0 generated {s.generated_tokens} tokens in {s.seconds:.2f} s "
            f"({s.tokens_per_second:.1f} tok/s)",
            file=sys.stderr,
        )
    return 0
