"""`offload-run --tp N [--dp M]`: one rank's side of a job, and the way into it.

`main` either starts the ranks (`launch.launch`, when not already inside a launcher) or
is one of them (`run_rank`): join the process groups, agree on the policy and the job's
sampling seed, take this data-parallel group's requests, run the engine over this
rank's shard. The pieces are offload-run's own (`sources`, `job.run_job`, the flags'
`EngineArgs` and `SamplingParams`). TP rank 0 of each group alone writes results,
world rank 0 alone shows progress, writes the trace, merges the groups' results and
decides the exit code (offload-run's EXIT_*), which it hands to the launching process.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from offload.api.args import EngineArgs, resolve_device
from offload.api.llm import LLM
from offload.cli import common, report, sources
from offload.cli.common import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, engine_args, sampling_params
from offload.core.config import resolve_dtype
from offload.core.errors import UserError
from offload.jobs import data_parallel as data
from offload.jobs import job
from offload.jobs.resultlog import MemorySink, ResultLog
from offload.models.resolve import resolve_model
from offload.parallel.comm import Topology, env_world
from offload.parallel.launch import PEER_LOST, report_failure
from offload.parallel.rank import rank_nvme
from offload.parallel.shard import check_divisible, rank_config
from offload.policies.memory_limit import node_memory_limit, rank_cpu_bytes
from offload.policies.policy import Policy

log = logging.getLogger("offload")

# where world rank 0 writes the job's exit code for the process that launched the ranks
# (a rank's own non-zero exit means "failed" to the launcher)
STATUS_ENV = "OFFLOAD_RUN_STATUS_FILE"


def wanted(args: argparse.Namespace) -> bool:
    """Whether this command runs ranks: --tp/--dp above 1, or started by torchrun."""
    found = env_world()
    return (args.tp or 1) * args.dp > 1 or (found is not None and found[1] > 1)


def main(args: argparse.Namespace, argv: list[str], entry: Callable[[list[str]], int]) -> int:
    """Start the ranks (from a plain command line) or run as one (inside a launcher).
    entry: offload-run's own `main`, which each rank runs with the same argv."""
    if (args.tp or 1) > 1 and args.hold_gpu_mem:  # (`LLM._open` refuses it too)
        raise UserError("--hold-gpu-mem is not supported with tensor parallelism: drop it")
    if env_world() is not None:
        return run_rank(args)
    _check_before_ranks(args)
    from offload.parallel.launch import launch

    fd, status = tempfile.mkstemp(prefix="offload-run-status-")
    os.close(fd)
    os.environ[STATUS_ENV] = status
    try:
        code = launch("offload-run", entry, argv, (args.tp or 1) * args.dp, args.device == "cpu")
        text = Path(status).read_text().strip()
        return int(text) if text else code or EXIT_OK
    finally:
        os.environ.pop(STATUS_ENV, None)
        Path(status).unlink(missing_ok=True)


def _check_before_ranks(args: argparse.Namespace) -> None:
    """What every rank would refuse, refused once before any starts: the flags, the
    input, the output paths, and a --tp the model's shapes cannot be cut into."""
    if args.input is not None and str(args.input) == "-":
        raise UserError("-i - (standard input) cannot feed several ranks; use a file")
    if args.dp > 1 and args.output in (None, "-"):
        raise UserError("--dp needs --output FILE (the groups' results are merged there)")
    engine = engine_args(args)
    sampling_params(args, {})
    output = sources.check_output(args.output, args.restart)
    sources.check_reports(args)
    sources.open_source(args, output)
    check_divisible(_model_config(engine), args.tp or 1)


def _model_config(engine: EngineArgs):
    """The model's own config (the one its weights have), as every rank resolves it."""
    return resolve_model(engine.model, dummy=engine.dummy, revision=engine.revision).config


def run_rank(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher stops ranks with it
    device = resolve_device(args.device)
    topo = Topology.from_env(args.tp, args.dp, device)
    if topo.rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // topo.local_world))
    try:
        code = _run_rank(args, topo)
    except UserError as exc:  # its one line, which the launcher prints as the cause
        report_failure(f"offload-run[rank {topo.rank}]: error: {exc}", str(exc))
        return EXIT_USAGE
    except dist.DistError as exc:  # a peer died under a collective: the cause is elsewhere
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"offload-run[rank {topo.rank}]: lost contact with a rank ({first})", file=sys.stderr)
        return PEER_LOST
    finally:
        topo.close()
    status = os.environ.get(STATUS_ENV)
    if status is None:  # under torchrun: the exit code is the rank's own
        return code
    if topo.rank == 0:
        Path(status).write_text(f"{code}\n")
    return 0


def _rank_engine(engine: EngineArgs, topo: Topology) -> tuple[EngineArgs, str]:
    """This rank's EngineArgs: --gpu-mem per GPU, --cpu-mem (default: the node's limit)
    shared by the node's ranks, its own --nvme directory. And where the CPU cap came from."""
    if engine.cpu_bytes is not None:
        node_cpu, where = engine.cpu_bytes, "--cpu-mem"
    else:
        node_cpu, where = node_memory_limit()
    cpu_bytes = rank_cpu_bytes(node_cpu, topo.local_world)
    nvme = rank_nvme(engine.nvme, topo.rank)
    return engine.replace(cpu_mem=f"{cpu_bytes}B", nvme=nvme, policy=None), where


def _policy(engine: EngineArgs, rank_args: EngineArgs, topo: Topology, gen_len: int, where):
    """The policy every rank runs: --policy, world rank 0's plan search over a rank's
    shard (with caps or --nvme), else one block of --batch-size on the GPU."""
    if engine.policy is not None:
        return Policy.from_file(engine.policy)
    if not engine.wants_search:
        return Policy(gpu_batch_size=engine.batch_size, num_gpu_batches=1)
    policy = None
    if topo.rank == 0:
        from offload.executor.probe import measure_profile
        from offload.policies.choose import choose_policy

        log.info("CPU cap from %s, %.1f GB per rank", where, (rank_args.cpu_bytes or 0) / 1e9)
        cfg = _model_config(engine)
        choice = choose_policy(
            rank_config(cfg, topo.tp, 0),
            resolve_dtype(engine.dtype, topo.device.type == "cuda", cfg.checkpoint_dtype),
            rank_args.gpu_bytes,
            rank_args.cpu_bytes,
            rank_args.nvme,
            engine.planned_prompt_len,
            gen_len,
            engine.profile,
            compressions=engine.compressions(),
            kv_compressions=engine.kv_compressions(),
            tp=topo.tp,
            measure_machine=measure_profile,
        )
        log.info("searched policy per rank: predicted %.1f tok/s", choice.best.total_tok_s)
        policy = choice.best.policy
    return topo.share(policy)


class _RankSink(MemorySink):
    """A rank that writes no file: it skips what its group's writer already holds, and
    keeps the rows only where they are printed at the end (no --output)."""

    def __init__(self, done: set[int], keep_rows: bool) -> None:
        super().__init__()
        self._done, self.done_count = done, len(done)
        self.keep_rows = keep_rows

    def done(self, index: int) -> bool:
        return index in self._done

    def append(self, rows: list[dict]) -> None:
        if self.keep_rows:
            super().append(rows)


def _run_rank(args: argparse.Namespace, topo: Topology) -> int:

    engine = engine_args(args)
    flag_params = sampling_params(args, {})  # sampling flags judged before any long work
    output = sources.check_output(args.output, args.restart)
    if topo.dp > 1 and output is None:
        raise UserError("--dp needs --output FILE (the groups' results are merged there)")
    source = sources.open_source(args, output)
    rank_args, where = _rank_engine(engine, topo)
    gen_len = flag_params.max_tokens or 256
    policy = _policy(engine, rank_args, topo, gen_len, where)
    started = time.perf_counter()
    llm = LLM.from_engine_args(
        rank_args,
        gen_len=gen_len,
        progress=topo.rank == 0 and not args.quiet,
        trace=topo.rank == 0 and args.trace is not None,
        policy=policy,
        parallel=topo.tensor_parallel(_model_config(engine)),
    )
    load_seconds = time.perf_counter() - started
    log.info(
        "model %s on %d ranks (tp %d x dp %d), %s; loaded in %.1f s",
        llm.spec.name,
        topo.world,
        topo.tp,
        topo.dp,
        llm.device.type,
        load_seconds,
    )
    sink: ResultLog | MemorySink | None = None
    try:
        params = sampling_params(args, llm.default_sampling)
        if topo.is_leader:
            path = data.group_output(output, topo.dp, topo.dp_index) if output else None
            fingerprint = common.fingerprint(args, engine, params, source.sha256, policy)
            sink = sources.open_sink(path, fingerprint, args.restart)
        done = {i for i in range(source.total) if sink is not None and sink.done(i)}
        done = topo.share(done, tp_only=True)
        sink = sink or _RankSink(done, keep_rows=False)
        todo = data.group_requests(source.requests(params), topo.dp, topo.dp_index)
        todo = data.seeded(todo, topo.share(random.getrandbits(63)))
        if source.from_flags:  # command-line prompts: a bad one fails the run
            todo = list(todo)
            for req in todo:
                llm.check_prompt(job.encode_request(llm, req))
        stats = job.JobStats(total=source.total, skipped=len(done))
        if stats.skipped and topo.is_leader:
            log.info("group %d resuming: %d requests already done", topo.dp_index, stats.skipped)
        _generate(args, topo, llm, todo, sink, stats)
        return _finish(args, topo, llm, sink, stats, output, source.total, load_seconds)
    finally:
        llm.close()
        if isinstance(sink, ResultLog):
            sink.close()


def _generate(args, topo: Topology, llm: LLM, todo, sink, stats: job.JobStats) -> None:
    def agree_to_stop(requested: bool) -> bool:  # every rank of a group stops after one block
        flag = torch.tensor([int(requested)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=topo.tp_control)
        return bool(flag.item())

    common.generate(
        args,
        llm,
        todo,
        sink,
        stats,
        show_bar=topo.rank == 0,
        agree_to_stop=agree_to_stop,
        write_trace=topo.rank == 0,
    )


def _finish(args, topo: Topology, llm, sink, stats, output: Path | None, total: int,
            load_seconds: float) -> int:  # fmt: skip
    counts = torch.tensor([int(stats.interrupted), sink.error_count if topo.is_leader else 0])
    dist.all_reduce(counts[:1], op=dist.ReduceOp.MAX, group=topo.control)
    dist.all_reduce(counts[1:], op=dist.ReduceOp.SUM, group=topo.control)
    interrupted, errors = bool(counts[0]), int(counts[1])
    if isinstance(sink, ResultLog) and (interrupted or topo.dp > 1):
        sink.close()  # a group's partial file is complete (the merge reads it)
    if interrupted:
        if topo.rank == 0:
            print(
                "offload-run: interrupted; finished blocks are kept, run the same command "
                "again to resume",
                file=sys.stderr,
            )
        return EXIT_INTERRUPTED
    if topo.rank == 0 and topo.dp == 1:
        sources.write_results(sink, total, args.output == "-")
    topo.barrier()  # every group's results are on disk
    if topo.rank == 0 and topo.dp > 1:
        assert output is not None
        data.merge_groups(output, topo.dp, total)
    if topo.rank == 0:
        s = llm.stats
        print(
            f"offload-run: {total} requests on {topo.world} ranks (tp {topo.tp} x dp "
            f"{topo.dp}); group 0 generated {s.generated_tokens} tokens in {s.seconds:.2f} s "
            f"({s.tokens_per_second:.1f} tok/s)",
            file=sys.stderr,
        )
        if args.stats is not None:
            report.report(llm, stats, load_seconds, args.stats)
    return common.exit_code(errors, total)
