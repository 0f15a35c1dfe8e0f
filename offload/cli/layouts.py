"""`offload-plan --gpus N`: one GPU, tensor parallelism over N and N data-parallel groups
on this node, each planned as offload-run plans that layout (`planning.plan`, a rank's
caps from `planning.rank_engine`), side by side.

    one GPU  the plan offload-run makes on one GPU (the node's CPU memory)
    TP=N     one rank's shard, --gpu-mem a GPU, the node's CPU memory / N a rank (--cpu-mem
             is the node's; without it the node's limit less a tenth), the node's cores, DRAM and disk shared by N ranks (`policies.node.rank_profile`),
             the all-reduce as offload-profile measured it; the group's tok/s
    DP=N     the whole model a GPU, the CPU memory / N a group but one pinned copy of the
             weights for all (`Caps.shared_weights`), the node shared by N; N x a group's
             tok/s, each group taking 1/N of the job's requests

The recommendation is the layout with the highest predicted tok/s for the node, with
the lane each one is bound by: a plan bound by what each GPU has (its link, its HBM, its
compute) scales with the GPUs; one bound by what the node shares (CPU attention, DRAM,
the disk) does not.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from offload.api.args import EngineArgs
from offload.api.front import ModelFront
from offload.api.planning import PlanRequest, plan, rank_engine
from offload.core.errors import UserError
from offload.parallel.shard import rank_config
from offload.policies.caps import Machine
from offload.policies.cost import Estimate, estimate
from offload.policies.job import Job
from offload.policies.node import Layout

GB = 1e9


@dataclass(frozen=True)
class Option:
    name: str
    tp: int
    dp: int
    node_tok_s: float | None  # predicted for the whole node (None: no plan fits)
    best: Estimate | None  # one rank's (one group's) plan
    why_not: str | None = None

    def to_dict(self) -> dict:
        out: dict = {"layout": self.name, "tp": self.tp, "dp": self.dp}
        if self.best is None:
            return out | {"node_tok_s": None, "why_not": self.why_not}
        return out | {
            "node_tok_s": self.node_tok_s,
            "rank_tok_s": self.best.total_tok_s,
            "bottleneck": self.best.bottleneck,
            "lanes_decode_step_s": self.best.lanes_decode_s,
            "policy": self.best.policy.to_dict(),
        }


def compare(
    front: ModelFront,
    engine: EngineArgs,
    gpus: int,
    job: Job | None,
    machine: Machine | None = None,
) -> list[Option]:
    """One GPU, TP=gpus and DP=gpus, each planned as offload-run plans that layout
    (`planning.plan` with the rank's caps, `planning.rank_engine`), with the weight
    formats the run may use (a pre-quantized checkpoint's own: no TP)."""
    out = []
    for name, tp, dp in (("one GPU", 1, 1), (f"TP={gpus}", gpus, 1), (f"DP={gpus}", 1, gpus)):
        layout = Layout(tp, dp) if tp * dp > 1 else None
        rank_args = engine if layout is None else rank_engine(engine, layout.ranks, 0)[0]
        try:
            found = plan(PlanRequest.build(front, rank_args, None, None, layout, job, False, machine))  # fmt: skip
        except UserError as exc:
            out.append(Option(name, tp, dp, None, None, str(exc)))
            continue
        assert found.policy is not None and found.profile is not None, "searched with a GPU cap"
        cfg = rank_config(front.config, tp, 0) if tp > 1 else front.config
        best = estimate(
            cfg, found.policy, front.dtype, found.prompt_len, found.gen_len, found.profile, tp=tp
        )
        out.append(Option(name, tp, dp, dp * best.total_tok_s, best))
    return out


def recommendation(layouts: list[Option]) -> str:
    fitting = [lay for lay in layouts if lay.best is not None]
    if not fitting:
        raise UserError("no layout has a plan that fits: " + layouts[0].why_not)
    best = max(fitting, key=lambda lay: lay.node_tok_s)
    one = next((lay for lay in fitting if lay.tp * lay.dp == 1), None)
    gain = f", {best.node_tok_s / one.node_tok_s:.2f}x one GPU" if one and one is not best else ""
    return f"recommended: {best.name} ({best.node_tok_s:.1f} tok/s{gain}); " + "; ".join(
        f"{lay.name} is bound by {_bound(lay)}" for lay in fitting
    )


def _bound(layout: Option) -> str:
    lane = layout.best.bottleneck
    shared = lane in ("cpu_attn", "disk", "rank_wait")
    whose = "the node's, shared by its ranks" if shared else "each GPU's own"
    return f"{lane} ({whose})" if layout.tp * layout.dp > 1 else lane


def main(
    front: ModelFront,
    engine: EngineArgs,
    args: argparse.Namespace,
    job: Job | None,
    machine: Machine | None = None,
) -> int:
    if args.gpus < 2:
        raise UserError(f"--gpus compares layouts over two or more GPUs, got {args.gpus}")
    if engine.gpu_bytes is None:
        raise UserError("--gpus compares plans searched for a GPU budget: give --gpu-mem")
    layouts = compare(front, engine, args.gpus, job, machine)
    verdict = recommendation(layouts)
    if args.json:
        print(json.dumps({"layouts": [lay.to_dict() for lay in layouts], "recommendation": verdict}, indent=1))  # fmt: skip
        return 0
    cfg = front.config
    print(f"{cfg.name} on {args.gpus} GPUs of this node; prompt {engine.planned_prompt_len}")
    for lay in layouts:
        if lay.best is None:
            print(f"  {lay.name:8s} no plan fits: {lay.why_not}")
            continue
        p = lay.best.policy
        print(
            f"  {lay.name:8s} {lay.node_tok_s:8.1f} tok/s for the node; a rank: {p.num_gpu_batches} x "
            f"{p.gpu_batch_size}, weights {p.weights.gpu:.0%} GPU, KV {p.kv_cache.gpu:.0%} GPU, "
            f"attention on the {'CPU' if p.attention_on_cpu else 'GPU'}; bound by {lay.best.bottleneck}"
        )  # fmt: skip
    print(verdict)
    return 0
