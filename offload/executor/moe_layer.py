"""A mixture-of-experts layer in the executor: experts scheduled by module.

    attention    every micro-batch as in a dense layer (`Executor._layers`' begin and
                 `_one_behind`), each ending at its MLP norm (`moe.pre`)
    route        the whole block's rows at once (one router matmul, one host read of
                 which experts were chosen)
    experts      each chosen expert once over all the block's rows that chose it, in
                 ascending order (`ExpertFetcher.run`: its weights cross PCIe at most
                 once; an expert no row chose is not moved); at decode the policy's
                 share of those in pinned memory runs on the CPU beside its weights,
                 only its rows crossing (`_on_cpu`), its output added last
    out          every micro-batch: the shared expert, the residual, stored

The dense schedule (`ExpertFetcher.dense`) is what model-based batching does with such a layer,
kept for comparison (`scripts/bench_moe.py`): each micro-batch routes alone and every
expert of the layer is fetched and run for it, chosen or not.

Both add every expert's output in ascending expert order over the same rows as the
plain runner's `moe.moe_block`, so they give its tokens; an expert computed on the
CPU is added after the others, in float32 arithmetic of its own (within a tolerance
of the GPU's: tests/test_moe.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from offload.kernels.cpu_expert import cpu_expert_mlp
from offload.models import decoder, moe
from offload.models.decoder import StepInputs
from offload.models.shapes import Weights

if TYPE_CHECKING:
    from offload.executor.executor import Executor


def moe_layer(
    ex: Executor,
    layer: int,
    w: Weights,
    hidden: list,
    steps: list[StepInputs],
    begin: Callable,
) -> None:
    """Layer `layer` for every micro-batch; hidden[k] in and out. begin(k): micro-batch
    k's attention started (`Executor._layers`). The dense schedule where
    `ex.experts.dense`."""
    cfg, lanes = ex.cfg, ex.lanes
    tokens = [(m.stop - m.start) * steps[k].positions.shape[1] for k, m in enumerate(ex._micro)]
    bounds = [slice(sum(tokens[:k]), sum(tokens[: k + 1])) for k in range(len(tokens))]
    h = torch.empty((sum(tokens), cfg.hidden_size), dtype=ex.dtype, device=ex.device)
    parts: list = [None] * len(hidden)  # per micro-batch: (its x's shape, its residual)

    def end(k: int, started) -> None:
        context, residual = started
        context = context()
        with lanes.on("compute", f"L{layer} mb{k} norm"):
            x = decoder.attn_out(cfg, w, context)
            del context
            h_k, residual = moe.pre(cfg, w, x, residual)
            h[bounds[k]] = h_k  # the block's rows, in micro-batch order
            parts[k] = (x.shape, residual)
        ex._prefetch_kv_after(layer, k, steps[k].cache_start)

    ex._one_behind(steps[0], begin, end)
    out = torch.zeros_like(h)
    if ex.experts.dense:
        _dense_experts(ex, layer, w, h, out, bounds)
    else:
        with lanes.on("compute", f"L{layer} route"):
            routing = moe.route(cfg, w, h)
        # the host reads which experts were chosen (one sync a layer: it waits for every
        # micro-batch's attention); a trace shows the wait on the host_wait lane
        with lanes.blocked(f"L{layer} route read"):
            chosen = moe.expert_rows(routing)
        rows_of = {expert: (rows, weights) for expert, rows, weights in chosen}

        def compute(expert: int, weights: tuple) -> None:
            with lanes.on("compute", f"L{layer} expert {expert}"):
                moe.apply_expert(out, h, *rows_of[expert], *weights, moe.swiglu(cfg))

        def on_cpu(expert: int, weights: tuple) -> Callable[[], None]:
            return _on_cpu(ex, f"L{layer} expert {expert}", h, out, *rows_of[expert], weights)

        experts, rows = [e for e, _, _ in chosen], [r.shape[0] for _, r, _ in chosen]
        decode = steps[0].positions.shape[1] == 1 and ex.experts.cpu_worker is not None
        ex.experts.run(layer + 1, experts, compute, rows, on_cpu if decode else None)
    for k, (shape, residual) in enumerate(parts):
        with lanes.on("compute", f"L{layer} mb{k} out"):
            y = moe.post(out[bounds[k]], moe.shared(cfg, w, h[bounds[k]]), residual)
        hidden[k] = ex.acts.store(k, y.view(shape))


def _on_cpu(
    ex: Executor,
    name: str,
    h: torch.Tensor,
    out: torch.Tensor,
    rows: torch.Tensor,
    routing_weights: torch.Tensor,
    weights: tuple,
) -> Callable[[], None]:
    """Start an expert on the CPU over its weights in pinned memory: its rows cross to
    the host, the worker thread computes (`kernels.cpu_expert`), and the returned call
    brings its output back and adds it, weighted, into the block's output."""
    lanes = ex.lanes
    lanes.wait("d2h", lanes.record("compute"))  # after the rows are computed
    with lanes.on("d2h", f"{name} rows", rows.shape[0] * h.shape[1] * h.element_size()):
        x = torch.empty((rows.shape[0], h.shape[1]), dtype=h.dtype, pin_memory=h.is_cuda)
        x.copy_(h[rows], non_blocking=True)
    ready = lanes.record("d2h")

    def work() -> torch.Tensor:
        lanes.host_wait(ready)
        started = time.perf_counter()
        y = cpu_expert_mlp(x, *weights)
        lanes.tracer.host_span("cpu_expert", name, started, time.perf_counter())
        return y

    future = ex.experts.cpu_worker.submit(work)

    def finish() -> None:
        y = future.result()
        with lanes.on("h2d", f"{name} out", y.numel() * y.element_size()):
            y = y.to(h.device, non_blocking=True)
        lanes.wait("compute", lanes.record("h2d"))
        with lanes.on("compute", f"{name} add"):
            out[rows] += (y * routing_weights[:, None]).to(out.dtype)

    return finish


def _dense_experts(
    ex: Executor, layer: int, w: Weights, h: torch.Tensor, out: torch.Tensor, bounds: list
) -> None:
    """Model-based batching's way: each micro-batch's rows routed alone, and every
    expert of the layer fetched and run for them."""
    for rows in bounds:
        chosen = {e: (r, wts) for e, r, wts in moe.expert_rows(moe.route(ex.cfg, w, h[rows]))}

        def compute(expert: int, weights: tuple, h=h[rows], out=out[rows], chosen=chosen):
            if expert in chosen:
                with ex.lanes.on("compute", f"L{layer} expert {expert}"):
                    moe.apply_expert(out, h, *chosen[expert], *weights, moe.swiglu(ex.cfg))

        ex.experts.run(layer + 1, list(range(ex.cfg.num_experts)), compute)
