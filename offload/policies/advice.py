"""The formats as advice: how much faster the same machine runs the job with int4
weights and KV cache where the user's flags did not allow them.

Uncompressed stays the default (the outputs change slightly with int4, and the user
decides on accuracy), but a plan that streams 227 GB of BLOOM's float16 weights from
disk predicts 0.5 tok/s where int4 weights and KV predict 16: `offload-plan` names the
formats among what would help, offload-run warns before the load where they would be
`WARN_SPEEDUP` times faster or more, and a plan refused for want of disk space says it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload.core.config import ModelConfig
from offload.core.errors import UserError
from offload.kernels.formats import Compression
from offload.policies.caps import Caps
from offload.policies.cost import Estimate
from offload.policies.hardware import HardwareProfile
from offload.policies.job import Block, Job, estimate_job
from offload.policies.search import search

INT4 = Compression(4, 64, False)
# offload-run warns before the load where a format is at least this much faster
WARN_SPEEDUP = 3.0


@dataclass(frozen=True)
class FormatHint:
    """Flags that allow int4 formats, the throughput they predict and its ratio to the
    plan's (over the whole job where there is one)."""

    flags: str
    tok_s: float
    speedup: float

    def text(self) -> str:
        return (
            f"{self.flags} -> {self.tok_s:.1f} tok/s ({self.speedup:.1f}x); outputs change "
            "slightly, see docs/compression.md"
        )


def format_hint(
    cfg: ModelConfig,
    dtype: torch.dtype,
    prompt_len: int,
    gen_len: int,
    hw: HardwareProfile,
    caps: Caps,
    best: Estimate,
    compressions: tuple[Compression | None, ...],
    kv_compressions: tuple[Compression | None, ...],
    job: Job | None = None,
    tp: int = 1,
) -> FormatHint | None:
    """int4 weights where only uncompressed weights were allowed, and int4 KV likewise,
    searched on the same machine and caps; None where the flags allow compression
    already, or where the formats plan nothing faster."""
    flags, weights, kv = [], compressions, kv_compressions
    if compressions == (None,):
        flags, weights = [*flags, "--compress int4"], (INT4,)
    if kv_compressions == (None,) and cfg.attn_softcap is None:  # (`search.kv_formats`)
        flags, kv = [*flags, "--kv-compress int4"], (INT4,)
    if not flags:
        return None
    try:
        other = search(cfg, dtype, prompt_len, gen_len, hw, caps, None, weights, kv, tp, job=job)
    except UserError:
        return None
    if job is None:
        ours, theirs = best.total_tok_s, other.total_tok_s
    else:
        uniform = Job.uniform(job.count, prompt_len, gen_len)
        ours, theirs = (
            _job_tok_s(cfg, dtype, hw, uniform, est, prompt_len, gen_len, tp)
            for est in (best, other)
        )
    if theirs <= ours:
        return None
    return FormatHint(" ".join(flags), theirs, theirs / ours)


def _job_tok_s(cfg, dtype, hw, job: Job, est: Estimate, prompt_len, gen_len, tp) -> float:
    known = (Block(est.policy.block_size, prompt_len, gen_len), est)
    return estimate_job(cfg, est.policy, dtype, job, hw, tp, known=known).tok_s
