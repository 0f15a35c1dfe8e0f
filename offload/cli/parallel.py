"""`offload-run --tp N [--dp M]`: one rank's side of a job, and the way into it.

`main` either starts the ranks (`launch.launch`, when not already inside a launcher) or
is one of them (`run_rank`): join the process groups, agree on the policy and the job's
sampling seed, take this data-parallel group's requests, run the engine over this
rank's shard. The pieces are offload-run's own (`sources`, `job_loop.run_job`, the flags'
`EngineArgs` and `SamplingParams`). TP rank 0 of each group alone writes results,
world rank 0 alone shows progress, writes the trace, merges the groups' results and
decides the exit code (offload-run's EXIT_*), which it hands to the launching process.
"""

from __future__ import annotations

import argparse
import json
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
from offload.api.front import ModelFront
from offload.api.llm import LLM
from offload.api.planning import rank_engine
from offload.cli import common, report, sizing, sources
from offload.cli.common import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, engine_args, sampling_params
from offload.core.errors import UserError
from offload.io.atomic import atomic_write
from offload.jobs import data_parallel as data
from offload.jobs import job_loop
from offload.jobs.resultlog import MemorySink, ResultLog
from offload.models.resolve import resolve_model
from offload.parallel.affinity import pin_rank
from offload.parallel.comm import Topology, env_world
from offload.parallel.launch import PEER_LOST, report_failure
from offload.parallel.rank import share_weights
from offload.parallel.shard import check_divisible
from offload.policies.memory import weight_plan

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
    engine, source = _check_before_ranks(args)
    from offload.parallel.launch import launch

    fd, status = tempfile.mkstemp(prefix="offload-run-status-")
    os.close(fd)
    os.environ[STATUS_ENV] = status
    try:
        argv = [*argv, *_copies(args, engine, source)]
        code = launch("offload-run", entry, argv, (args.tp or 1) * args.dp, args.device == "cpu")
        text = Path(status).read_text().strip()
        return int(text) if text else code or EXIT_OK
    finally:
        os.environ.pop(STATUS_ENV, None)
        Path(status).unlink(missing_ok=True)
        if source.spooled is not None:
            source.spooled.unlink(missing_ok=True)


def _copies(args: argparse.Namespace, engine: EngineArgs, source: sources.Source) -> list[str]:
    """Flags that hand the ranks the files the checks read a pipe into (`-i <(cmd)`:
    its copy; `--policy <(cmd)`: the file `api.args.policy_file` kept): a pipe is read once,
    so a rank given the pipe itself would find it empty or gone. Given after the user's
    own flags, they take their place (argparse keeps a flag's last value)."""
    flags = []
    if source.spooled is not None:
        flags += ["--input", str(source.spooled)]
    if engine.policy is not None and str(engine.policy) != str(args.policy):
        flags += ["--policy", str(engine.policy)]
    return flags


def _check_before_ranks(args: argparse.Namespace) -> tuple[EngineArgs, sources.Source]:
    """What every rank would refuse, refused once before any starts: the flags, the
    input, the output paths, and a --tp the model's shapes cannot be cut into. The
    engine's args and the job's source as the checks found them (`_copies`)."""
    if args.input is not None and str(args.input) == "-":
        raise UserError("-i - (standard input) cannot feed several ranks; use a file")
    if args.dp > 1 and args.output in (None, "-"):
        raise UserError("--dp needs --output FILE (the groups' results are merged there)")
    engine = engine_args(args)
    sampling_params(args, {})
    output = sources.check_output(args.output, args.restart)
    sources.check_reports(args)
    source = sources.open_source(args, output)
    try:
        check_divisible(_model_config(engine), args.tp or 1)
    except BaseException:
        if source.spooled is not None:
            source.spooled.unlink(missing_ok=True)
        raise
    return engine, source


def _model_config(engine: EngineArgs):
    """The model's own config (the one its weights have), as every rank resolves it."""
    return resolve_model(engine.model, dummy=engine.dummy, revision=engine.revision).config


def run_rank(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher stops ranks with it
    device = resolve_device(args.device)
    topo = Topology.from_env(args.tp, args.dp, device)  # (its GPU set: no other's context)
    # before any pool starts: the threads made from now on (OpenMP's, the readers')
    # inherit the rank's cores
    pin_rank(topo.local_rank, topo.local_world, topo.device)
    if topo.rank != 0:
        for name in ("", "offload"):  # (offload's logger has its own level: `core.logs`)
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        code = _run_rank(args, topo)
    except Refused as exc:  # every rank refused the job together: said once
        if topo.rank == 0:
            print(f"offload-run: error: {exc}", file=sys.stderr)
        code = EXIT_USAGE
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


def rank_trace(path: Path, rank: int) -> Path:
    """Where rank `rank` writes its trace for --trace PATH: <stem>.rank<i><suffix>."""
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


class Refused(UserError):
    """A refusal every rank of the job reached together (world rank 0's, shared)."""


def _sized_plan(
    args: argparse.Namespace,
    topo: Topology,
    front: ModelFront,
    rank_args: EngineArgs,
    source: sources.Source,
    params,
    gen_len: int | None,
    where: str,
) -> sizing.SizedPlan:
    """The job's plan on every rank: world rank 0 measures the job and plans one rank's
    shard for it through offload-run's own sizing (`cli.sizing`: the job's prompts,
    refusals before any load) and hands the plan to every rank, or its refusal
    (`Refused`, raised on every rank)."""
    found: tuple | str | None = None
    if topo.rank == 0:
        log.info("CPU cap from %s, %.1f GB per rank", where, (rank_args.cpu_bytes or 0) / 1e9)
        try:
            shape = sizing.measure(
                front, source.requests(params), source.from_flags, args.skip_invalid
            )
            sized = sizing.plan_for_job(
                front, rank_args, shape, gen_len, args.skip_invalid, topo.layout
            )
            found = (sized.plan, sized.engine.prompt_len, sized.prompt_limit)
        except UserError as exc:
            found = str(exc)
    found = topo.share(found)
    if isinstance(found, str):
        raise Refused(found)
    plan, prompt_len, prompt_limit = found
    if topo.rank == 0 and plan.policy is not None:
        log.info("policy per rank %s", plan.policy.to_json())
    return sizing.SizedPlan(rank_args.replace(prompt_len=prompt_len), plan, prompt_limit)


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
    """source -> front -> the job's plan (world rank 0's, shared) -> load -> run -> merge."""
    engine = engine_args(args)
    flag_params = sampling_params(args, {})  # sampling flags judged before any long work
    output = sources.check_output(args.output, args.restart)
    if topo.dp > 1 and output is None:
        raise UserError("--dp needs --output FILE (the groups' results are merged there)")
    source = sources.open_source(args, output)
    rank_args, where = rank_engine(engine, topo.local_world, topo.rank)
    front = ModelFront(rank_args, topo.device)  # config and tokenizer only
    params = sampling_params(args, front.default_sampling)
    sized = _sized_plan(args, topo, front, rank_args, source, params, flag_params.max_tokens, where)
    started = time.perf_counter()
    parallel = topo.tensor_parallel(front.config)
    policy = sized.plan.policy
    cpu_weights = weight_plan(parallel.shard.config, policy, front.dtype)["weights_cpu"] if policy else 0  # fmt: skip
    parallel.shared_weights = share_weights(topo, cpu_weights)
    llm = LLM.from_plan(
        sized.engine,
        front,
        sized.plan,
        progress=topo.rank == 0 and not args.quiet,
        trace=common.trace_sampling(args),
        parallel=parallel,
    )
    topo.barrier()  # every rank is loaded (a shared copy of the weights is complete)
    load_seconds = time.perf_counter() - started
    log.info(
        "model %s on %d ranks (tp %d x dp %d), %s; loaded in %.1f s",
        llm.model_name,
        topo.world,
        topo.tp,
        topo.dp,
        llm.device.type,
        load_seconds,
    )
    sink: ResultLog | MemorySink | None = None
    try:
        if topo.is_leader:
            path = data.group_output(output, topo.dp, topo.dp_index) if output else None
            fingerprint = common.fingerprint(args, engine, params, source.sha256, llm.policy)
            sink = sources.open_sink(path, fingerprint, args.restart)
        done = {i for i in range(source.total) if sink is not None and sink.done(i)}
        done = topo.share(done, tp_only=True)
        sink = sink or _RankSink(done, keep_rows=False)
        todo = data.group_requests(source.requests(params), topo.dp, topo.dp_index)
        todo = data.seeded(todo, topo.share(random.getrandbits(63)))
        stats = job_loop.JobStats(total=source.total, skipped=len(done))
        if stats.skipped and topo.is_leader:
            log.info("group %d resuming: %d requests already done", topo.dp_index, stats.skipped)
        _generate(args, topo, llm, todo, sink, stats, sized.prompt_limit)
        return _finish(args, topo, llm, sink, stats, output, source.total, load_seconds)
    finally:
        llm.close()
        if isinstance(sink, ResultLog):
            sink.close()


def _generate(
    args, topo: Topology, llm: LLM, todo, sink, stats: job_loop.JobStats, prompt_limit: int | None
) -> None:
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
        prompt_limit,
        show_bar=topo.rank == 0,
        agree_to_stop=agree_to_stop,
        trace_path=rank_trace(args.trace, topo.rank) if args.trace is not None else None,
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
    node = _node_stats(topo, llm)
    if topo.rank == 0:
        print(
            f"offload-run: {total} requests on {topo.world} ranks (tp {topo.tp} x dp "
            f"{topo.dp}); {node['generated_tokens']} tokens generated in {node['seconds']:.2f} s "
            f"({node['tokens_per_second']:.1f} tok/s for the node)",
            file=sys.stderr,
        )
        if args.stats is not None:
            report.report(llm, stats, load_seconds, args.stats)  # group 0's, and the node's:
            summary = json.loads(args.stats.read_text())
            atomic_write(args.stats, json.dumps({**summary, "node": node}, indent=1, default=str))
    return common.exit_code(errors, total)


def _node_stats(topo: Topology, llm: LLM) -> dict:
    """Every group's generated tokens and seconds (from its TP rank 0), and the node's:
    the tokens of all groups over the longest group's time (they run side by side)."""
    s = llm.stats
    mine = {"generated_tokens": s.generated_tokens, "seconds": s.seconds,
            "prefill_seconds": s.prefill_seconds, "decode_seconds": s.decode_seconds}  # fmt: skip
    every: list = [None] * topo.world
    dist.all_gather_object(every, mine if topo.is_leader else None, group=topo.control)
    groups = [g for g in every if g is not None]
    tokens, seconds = sum(g["generated_tokens"] for g in groups), max(g["seconds"] for g in groups)
    rate = tokens / seconds if seconds else 0.0
    return {
        "generated_tokens": tokens,
        "seconds": seconds,
        "tokens_per_second": rate,
        "groups": groups,
    }
