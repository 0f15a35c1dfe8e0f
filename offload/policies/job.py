"""A job's predicted wall time: its load, then every block as the job cuts them.

    load    the weight store (where a plan reads weights from disk and no store holds
            them yet), pinning the weights' pool, placing every stage's weights, and the
            warm-up block (where decode replays CUDA graphs): bytes over the rates the
            profile measured (`pin_gbps`, `place_gbps`, the disk's)
    blocks  the requests in windows of whole blocks, each window sorted by prompt
            length and cut into blocks (`window_requests`: `jobs.job_loop.run_job` cuts the same
            way), each block costed at its own shape by `cost.estimate`: its rows, its
            longest prompt and its largest budget. A last block of 4 rows under a plan
            of 36 streams every weight for its 4 rows, so it costs nearly what a full
            block costs, not a ninth of it.

The search ranks plans by this time for the job's request count (`search.ranked` with
a `Job`), so a job of 40 prompts is not planned as a block of 36 and a block of 4 when
a block of 40, or two of 20, fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from offload.core.config import ModelConfig
from offload.io.layout import store_bytes
from offload.io.store import find_store
from offload.kernels import qmatmul
from offload.policies.cost import Estimate, estimate
from offload.policies.hardware import GB, HardwareProfile
from offload.policies.memory import micro_batch_sizes, weight_plan
from offload.policies.policy import Policy

# requests a job reads before it sorts them by length and cuts blocks: at least this
# many, and a whole number of blocks (64 requests in blocks of 14 would leave a block
# of 8 after every four of 14)
WINDOW_REQUESTS = 64
WINDOW_BLOCKS = 8
# the warm-up block's shortest prompt: a multiple of 16, as Triton specializes integers
WARM_PROMPT = 16
# distinct block shapes a job is costed at, at most: past it, prompt lengths are taken
# up to a coarser multiple (an upper bound; a cost estimate takes about a millisecond)
MAX_SHAPES = 128


def window_requests(block_size: int) -> int:
    """Requests a job sorts and cuts at a time: whole blocks, WINDOW_BLOCKS at least and
    WINDOW_REQUESTS requests at least."""
    return block_size * max(WINDOW_BLOCKS, math.ceil(WINDOW_REQUESTS / block_size))


def warm_up_prompt(cfg: ModelConfig, policy: Policy) -> int:
    """The warm-up block's prompt tokens: enough rows a micro-batch that prefill's
    matmuls take the dense path the job's will (`qmatmul.DENSE_ROWS`), a multiple of 16."""
    prompt = -(-qmatmul.DENSE_ROWS // policy.gpu_batch_size)
    prompt = max(WARM_PROMPT, -(-prompt // 16) * 16)
    return min(prompt, cfg.max_position_embeddings - 3)


@dataclass(frozen=True)
class Block:
    """A block as the job runs it: its rows, its longest prompt, its largest budget."""

    rows: int
    prompt_len: int
    gen_len: int


class Job:
    """The requests of a job in the order it reads them: each one's prompt tokens and the
    new tokens it may generate."""

    def __init__(self, prompt_lens: list[int], gen_lens: list[int]) -> None:
        if len(prompt_lens) != len(gen_lens) or not prompt_lens:
            raise ValueError("a job needs a prompt, and one generation budget a prompt")
        self.prompt_lens, self.gen_lens = list(prompt_lens), list(gen_lens)

    @classmethod
    def uniform(cls, count: int, prompt_len: int, gen_len: int) -> Job:
        return cls([prompt_len] * count, [gen_len] * count)

    @property
    def count(self) -> int:
        return len(self.prompt_lens)

    @property
    def longest(self) -> tuple[int, int]:
        """(the longest prompt, the largest budget)."""
        return max(self.prompt_lens), max(self.gen_lens)

    @property
    def is_uniform(self) -> bool:
        return self.longest == (min(self.prompt_lens), min(self.gen_lens))

    def blocks(self, block_size: int) -> list[tuple[Block, int]]:
        """The job's blocks in the order they run, as (block, times in a row): windows
        of `window_requests` in order, each sorted by prompt length (stably) and cut
        into blocks of `block_size`."""
        if self.is_uniform:  # every window whole but the last, whose rest is one block
            prompt, gen = self.longest
            full, rest = divmod(self.count, block_size)
            runs = [(Block(block_size, prompt, gen), full)] if full else []
            return runs + ([(Block(rest, prompt, gen), 1)] if rest else [])
        runs: list[tuple[Block, int]] = []
        window = window_requests(block_size)
        for start in range(0, self.count, window):
            end = start + window
            pairs = sorted(
                zip(self.prompt_lens[start:end], self.gen_lens[start:end], strict=True),
                key=lambda pair: pair[0],
            )
            for first in range(0, len(pairs), block_size):
                chunk = pairs[first : first + block_size]
                block = Block(len(chunk), chunk[-1][0], max(gen for _, gen in chunk))
                if runs and runs[-1][0] == block:
                    runs[-1] = (block, runs[-1][1] + 1)
                else:
                    runs.append((block, 1))
        return runs


def _coarse_shapes(runs: list[tuple[Block, int]]) -> dict[Block, Block]:
    """Each block's shape as costed: itself, or, past MAX_SHAPES shapes, its prompt
    rounded up to 16, 32, ... tokens until there are no more, or every prompt is one
    length (each shape is one cost estimate, about a millisecond; rounding up is an
    upper bound)."""
    shapes = {block: block for block, _ in runs}
    longest = max(block.prompt_len for block in shapes)
    step = 16
    while len(set(shapes.values())) > MAX_SHAPES and step < 2 * longest:
        shapes = {
            block: Block(block.rows, -(-block.prompt_len // step) * step, block.gen_len)
            for block in shapes
        }
        step *= 2
    return shapes


@dataclass(frozen=True)
class LoadEstimate:
    """Seconds of a load: the weight store's build, pinning the weights' pool, placing
    every stage, reading a checkpoint, and the warm-up block."""

    store_s: float = 0.0
    pin_s: float = 0.0
    place_s: float = 0.0
    read_s: float = 0.0
    warm_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.store_s + self.pin_s + self.place_s + self.read_s + self.warm_s


def load_estimate(
    cfg: ModelConfig,
    policy: Policy,
    dtype: torch.dtype,
    hw: HardwareProfile,
    store_ready: bool = False,
    checkpoint_bytes: int = 0,
) -> LoadEstimate:
    """The load's predicted seconds. store_ready: a store under --nvme already holds
    what the plan reads from disk; checkpoint_bytes: the bytes read from a checkpoint
    (0: dummy weights, drawn on the device), read at the disk's measured rate, once for
    the homes and once more for a store being built. A rate the profile has not
    measured leaves its term out (0)."""
    plan = weight_plan(cfg, policy, dtype)
    pool = plan["weights_cpu"] + plan["weight_staging_cpu"]
    pin_s = pool / (hw.pin_gbps * GB) if hw.pin_gbps else 0.0
    place_s = _place_s(plan["weights_gpu"], hw.place_rate(policy.weight_compression, "gpu"))
    off_gpu = plan["weights_cpu"] + plan["weights_disk"]
    place_s += _place_s(off_gpu, hw.place_rate(policy.weight_compression, "cpu"))
    reads = 1
    store_s = 0.0
    if policy.weights.disk > 0 and not store_ready:
        written = store_bytes(cfg, dtype, policy.weight_compression, policy.weights)
        store_s = written / (hw.disk_write_gbps * GB)
        store_s += _place_s(written, hw.place_rate(policy.weight_compression, "cpu"))
        reads = 2
    read_s = reads * checkpoint_bytes / (hw.disk_read_gbps * GB)
    return LoadEstimate(store_s, pin_s, place_s, read_s, _warm_up_s(cfg, policy, dtype, hw))


def _place_s(nbytes: float, rate_gbps: float) -> float:
    return nbytes / (rate_gbps * GB) if rate_gbps and nbytes else 0.0


def _warm_up_s(cfg: ModelConfig, policy: Policy, dtype: torch.dtype, hw: HardwareProfile) -> float:
    """The warm-up block where decode replays graphs on a GPU (`Executor.warm_up`): a
    prefill of a full block at `warm_up_prompt` and two decode steps run eagerly (the
    first compiles, the second captures)."""
    if not (hw.has_gpu and policy.decode_graphs):
        return 0.0
    est = estimate(cfg, policy, dtype, warm_up_prompt(cfg, policy), 3, hw)
    return est.prefill_s + 2 * (est.decode_step_s + _eager_host_s(cfg, policy, hw))


def _eager_host_s(cfg: ModelConfig, policy: Policy, hw: HardwareProfile) -> float:
    """A decode step's host time run eagerly (not replayed): what a step that compiles or
    captures graphs adds to a replayed one."""
    stages = cfg.num_layers + 2
    return stages * (hw.layer_fixed_s + policy.num_gpu_batches * hw.micro_fixed_s)


@dataclass(frozen=True)
class JobEstimate:
    """A job's predicted wall time under a plan: the load, then each block shape's
    estimate times its count (shapes in order of first appearance), plus what blocks
    pay beyond their steps: pinning the KV pool, capturing graphs at a new shape."""

    policy: Policy
    load: LoadEstimate
    blocks: tuple[tuple[Block, int, Estimate], ...]
    extra_s: float  # pinning the KV pool, capturing graphs at new block shapes

    @property
    def blocks_s(self) -> float:
        return sum(n * (e.prefill_s + e.decode_s) for _, n, e in self.blocks) + self.extra_s

    @property
    def seconds(self) -> float:
        return self.load.seconds + self.blocks_s

    @property
    def tokens(self) -> int:
        return sum(n * b.rows * b.gen_len for b, n, _ in self.blocks)

    @property
    def requests(self) -> int:
        return sum(n * b.rows for b, n, _ in self.blocks)

    @property
    def tok_s(self) -> float:
        """New tokens a second over the whole job, its load included."""
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def generate_tok_s(self) -> float:
        """New tokens a second of the blocks alone (after the load)."""
        return self.tokens / self.blocks_s if self.blocks_s else 0.0

    def summary(self) -> str:
        """One line: the job's predicted time, its parts and its throughput."""
        count = sum(n for _, n, _ in self.blocks)
        return (
            f"predicted for the job: {self.seconds:.1f} s (load {self.load.seconds:.1f} s, "
            f"{count} block{'s' if count != 1 else ''} {self.blocks_s:.1f} s) for "
            f"{self.requests} requests and {self.tokens} new tokens: {self.tok_s:.1f} tok/s "
            f"({self.generate_tok_s:.1f} after the load)"
        )

    def to_dict(self) -> dict:
        return {
            "seconds": self.seconds,
            "tok_s": self.tok_s,
            "generate_seconds": self.blocks_s,
            "generate_tok_s": self.generate_tok_s,
            "tokens": self.tokens,
            "requests": self.requests,
            "load": {**vars(self.load), "seconds": self.load.seconds},
            "blocks": [
                {
                    "rows": b.rows,
                    "prompt_len": b.prompt_len,
                    "gen_len": b.gen_len,
                    "count": n,
                    "seconds_each": e.prefill_s + e.decode_s,
                }
                for b, n, e in self.blocks
            ],
            "extra_seconds": self.extra_s,
        }


def estimate_job(
    cfg: ModelConfig,
    policy: Policy,
    dtype: torch.dtype,
    job: Job,
    hw: HardwareProfile,
    tp: int = 1,
    load: LoadEstimate | None = None,
    known: tuple[Block, Estimate] | None = None,
) -> JobEstimate:
    """The job's predicted wall time under `policy`: the sum of its blocks, each at its
    own shape, and its load. load: default `load_estimate` of dummy weights and no
    store; known: a block shape's estimate made already (the search's full block)."""
    runs = job.blocks(policy.block_size)
    shapes = _coarse_shapes(runs)
    made: dict[Block, Estimate] = dict([known]) if known is not None else {}
    counts: dict[Block, int] = {}
    for block, times in runs:
        shape = shapes[block]
        if shape not in made:
            made[shape] = estimate(
                cfg, policy, dtype, shape.prompt_len, shape.gen_len, hw, shape.rows, tp
            )
        counts[shape] = counts.get(shape, 0) + times
    if load is None:
        load = load_estimate(cfg, policy, dtype, hw)
    rows = tuple((shape, n, made[shape]) for shape, n in counts.items())
    extra = _kv_pool_pin_s(policy, rows, hw) + _recapture_s(cfg, policy, runs, hw, tp)
    return JobEstimate(policy, load, rows, extra)


def predict_job(
    cfg: ModelConfig,
    policy: Policy,
    dtype: torch.dtype,
    job: Job,
    hw: HardwareProfile,
    nvme: Path | None = None,
    checkpoint_bytes: int = 0,
    tp: int = 1,
) -> JobEstimate:
    """`estimate_job` with the load this machine will do: no store to build where one
    under `nvme` holds what the plan reads from disk; checkpoint_bytes read (0: dummy)."""
    ready = False
    if nvme is not None and policy.weights.disk > 0:
        found = find_store(nvme, cfg, dtype, policy.weight_compression, policy.weights)
        ready = found[0] is not None
    load = load_estimate(cfg, policy, dtype, hw, ready, checkpoint_bytes)
    return estimate_job(cfg, policy, dtype, job, hw, tp, load)


def _kv_pool_pin_s(policy: Policy, rows, hw: HardwareProfile) -> float:
    """The KV homes' pinned pool is pinned for the first block and again where a block
    needs more (`kv_homes`): the largest block's CPU homes, disk staging and CPU
    activations, pinned once (the memory plan's for a full block, by rows)."""
    if not hw.pin_gbps:
        return 0.0
    need = 0.0
    for block, _, est in rows:
        d = est.memory.detail
        full = d["kv_cpu"] + d.get("kv_staging_cpu", 0) + d.get("act_cpu", 0)
        need = max(need, full * block.rows / policy.block_size)
    return need / (hw.pin_gbps * GB)


def _recapture_s(
    cfg: ModelConfig, policy: Policy, runs: list[tuple[Block, int]], hw: HardwareProfile, tp: int
) -> float:
    """Where decode replays graphs, a block whose micro-batch sizes differ from the
    graphs' (the warm-up captured the full block's) runs its first decode step eagerly
    (compiling) and captures in the second (`Executor._decode_graphs`): two eager steps'
    host time beyond two replayed steps, at each change of sizes in run order."""
    if not (hw.has_gpu and policy.decode_graphs and tp == 1):
        return 0.0
    graphs = micro_batch_sizes(policy, policy.block_size)
    changes = 0
    for block, _ in runs:
        sizes = micro_batch_sizes(policy, block.rows)
        if sizes != graphs:
            changes, graphs = changes + 1, sizes
    return changes * 2 * _eager_host_s(cfg, policy, hw)
