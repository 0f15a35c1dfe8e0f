"""The layer-wise executor: one block of num_gpu_batches x gpu_batch_size sequences,
stage by stage (embedding, each layer, head), every micro-batch through a stage before
the next stage, while the next stage's weights stream in.

The zig-zag block schedule, for stage j and micro-batch k:

    compute (j, k)  ||  load weights of stage j + 1 (once per stage, shared by all k)
                    ||  load the off-GPU KV of (j, k + 1), store the new KV of (j, k - 1)
                    ||  disk reads of stage j + 2 into pinned staging (one stage further)

Lanes are CUDA streams ordered by events; the host never synchronizes the device in
the steady state. `overlap=False` is the serial reference schedule (each load issued
right before its use and waited for), kept for debugging: both give identical tokens.

It offers the runner interface of `PlainRunner` (start, step_inputs, forward), so the
engine drives it unchanged. Tensor-parallel seam: a rank runs this executor over its
shard of every stage (a `parallel.shard.ShardSource`), with its own pool, store and
PCIe link, and hands `parallel` to the decoder, which all-reduces after each
row-parallel matmul (`offload.parallel`, docs/parallel.md).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from offload.core.config import ModelConfig
from offload.executor.activations import ActivationHomes, StoredAct
from offload.executor.graphs import DecodeGraphs
from offload.executor.kv import KVManager
from offload.executor.lanes import Lanes, Tracer, busy_seconds
from offload.executor.placing import SharedWeights, place_weights
from offload.executor.runner import LaneReports
from offload.io.layout import DISK_BUFFERS
from offload.io.spill import SWITCH_INTERVAL_S
from offload.io.tiers import MemoryLedger, Tier
from offload.kernels import cpu_attention
from offload.models import decoder, ops
from offload.models.batch import PaddedBatch
from offload.models.decoder import Parallel, StepInputs
from offload.models.shapes import Weights
from offload.models.weights import WeightSource
from offload.policies.job import warm_up_prompt
from offload.policies.latent import check_latent_policy
from offload.policies.memory import row_splits
from offload.policies.policy import Policy

log = logging.getLogger(__name__)


@dataclass
class StepTrace:
    """Per-forward lane accounting, for summaries and benchmarks."""

    seconds: float
    lanes: dict[str, dict[str, float]]
    prefill: bool = False  # a step over the prompts (more than one new token)

    @property
    def busiest(self) -> tuple[str, float]:
        lane = max(self.lanes, key=lambda name: self.lanes[name]["busy_s"])
        return lane, self.lanes[lane]["busy_s"]


class Executor(LaneReports):  # implements runner.Runner
    def __init__(
        self,
        source: WeightSource,
        policy: Policy,
        dtype: torch.dtype,
        device: torch.device,
        nvme_dir: Path | None = None,
        trace: bool = False,
        progress: bool = False,
        cuda_graphs: bool = True,
        parallel: Parallel | None = None,
        disk_buffers: int = DISK_BUFFERS,
        shared_weights: SharedWeights | None = None,
    ) -> None:
        """cuda_graphs: replay decode steps from CUDA graphs where every stage's weights
        are on the GPU (`graphs.DecodeGraphs`); False runs every step eagerly.
        parallel: a tensor-parallel rank's collectives (`decoder.Parallel`); None is one
        device. disk_buffers: the KV manager's disk staging blocks; the memory plan
        counts `io.layout.DISK_BUFFERS` (another depth is for measuring one against it,
        `scripts/executor_ab.py`). shared_weights: the weights' CPU homes in one pinned
        copy shared with other processes of the node (`placing.SharedWeights`)."""
        self.parallel = parallel
        # the GIL's switch interval while the executor runs (`spill.SWITCH_INTERVAL_S`)
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.cfg: ModelConfig = source.config
        check_latent_policy(self.cfg, policy)  # (a latent cache lives on the GPU only)
        self.policy, self.dtype, self.device = policy, dtype, device
        self.ledger = MemoryLedger()
        self.tracer = Tracer(enabled=bool(trace), every=max(1, int(trace)))
        self.lanes = Lanes(device, self.tracer)
        self.weights = place_weights(
            source, policy, dtype, device, self.lanes, self.ledger, nvme_dir, progress,
            shared_weights,
        )  # fmt: skip
        self.homes, self.fetcher = self.weights.homes, self.weights.fetcher
        self.experts = self.weights.experts
        self.load_seconds = self.weights.seconds
        # the parts `policies.job.load_estimate` predicts (the warm-up adds its own)
        self.load_parts = dict(self.weights.parts)
        spill_dir = nvme_dir if nvme_dir is not None else Path(".")
        self.kv = KVManager(
            self.cfg,
            self.lanes,
            device,
            dtype,
            self.ledger,
            spill_dir,
            policy.attention_on_cpu,
            policy.overlap,
            policy.kv_compression,
            disk_buffers,
        )
        self.rotary = ops.Rotary.of(self.cfg, device)
        self._micro: list[slice] = []
        self.acts = ActivationHomes(self.lanes, device, dtype)
        self.traces: list[StepTrace] = []
        self.prefill_spans: list | None = None  # the last traced prefill's
        self.last_spans: list | None = None  # the last traced decode step's
        # (the graphs capture no collectives: tensor-parallel ranks run eagerly; nor a
        # mixture of experts' routing, which the host reads every layer)
        self.cuda_graphs = (
            cuda_graphs and device.type == "cuda" and parallel is None and not self.cfg.num_experts
        )
        self._graphs: list[DecodeGraphs] = []
        self._graph_rows: tuple[int, ...] = ()  # micro-batch rows the graphs are for
        self._warm_rows: tuple[int, ...] = ()  # ran one eager decode step (compiled)
        self._graph_bytes = 0  # what the graphs' buffers hold, in the ledger

    # -- before the job -------------------------------------------------------------------
    def warm_up(self, progress: bool = False) -> float:
        """Compile the kernels and capture the decode graphs at the block's shapes before
        the job, on a short made-up block (its time counts as loading). The block runs
        only where decode replays graphs (every weight on the GPU): a step there takes
        milliseconds, and a cold Triton cache's compiles and the first capture would
        otherwise take most of a short job (docs/throughput.md). Where weights
        stream, a step takes a weight pass and a warm-up block would cost more than it
        saves. Returns its seconds.

        A policy that attends on the CPU has the CPU attention's C kernel built here
        first (once a machine, cached): the build takes seconds, which would otherwise
        fall in the first decode step.

        Every plan on a GPU first launches the decoder's kernels on a few rows
        (`decoder.warm_kernels`, no weights read): the Triton runtime's start and the
        libraries' first launches otherwise fell in a streamed plan's first prefill."""
        started = time.perf_counter()
        if self.policy.attention_on_cpu:
            cpu_attention.available(compressed=self.policy.kv_compression is not None)
        if self.device.type == "cuda":
            decoder.warm_kernels(self.cfg, self.dtype, self.device)
        if not (self.cuda_graphs and self.policy.decode_graphs) or (
            self.tracer.every == 1 and self.tracer.enabled
        ):
            seconds = time.perf_counter() - started  # (a run traced whole replays no graphs)
            self.load_seconds += seconds
            self.load_parts["warm_s"] = seconds
            if progress and seconds > 0.5:
                log.info("warmed up in %.1f s (kernels loaded)", seconds)
            return seconds
        rows = self.policy.block_size
        prompt = warm_up_prompt(self.cfg, self.policy)
        # the first decode step runs eagerly (compiling), the second captures the graphs
        batch = PaddedBatch(self.cfg, [[0] * prompt] * rows, 3, pad_id=0)
        self.start(batch)
        self.forward(batch.prompt_ids, self.step_inputs(batch, 0, batch.prompt_len))
        token = torch.zeros((rows, 1), dtype=torch.long)
        for t in range(2):
            self.forward(token, self.step_inputs(batch, batch.prompt_len + t, 1))
        seconds = time.perf_counter() - started
        self.load_seconds += seconds
        self.load_parts["warm_s"] = seconds
        if progress:
            log.info("warmed up in %.1f s (kernels compiled, decode graphs captured)", seconds)
        return seconds

    # -- runner interface -------------------------------------------------------------
    def start(self, batch: PaddedBatch) -> None:
        """Split the batch into micro-batches and allocate their KV homes."""
        size = self.policy.gpu_batch_size
        assert batch.size <= self.policy.block_size, "batch larger than the policy's block"
        self._micro = [slice(s, min(s + size, batch.size)) for s in range(0, batch.size, size)]
        splits = row_splits(self.policy.kv_cache, [m.stop - m.start for m in self._micro])
        elt = self.dtype.itemsize
        act_bytes, act_gpu_rows = [], []
        for m in self._micro:
            gpu_rows, cpu_rows, _ = self.policy.activations.split(m.stop - m.start)
            act_gpu_rows.append(gpu_rows)
            act_bytes.append(cpu_rows * batch.prompt_len * self.cfg.hidden_size * elt)
        self.acts.start(act_gpu_rows, self.kv.start(splits, batch.max_slots, act_bytes))

    def step_inputs(self, batch: PaddedBatch, cache_start: int, num_new: int) -> StepInputs:
        return batch.step_inputs(cache_start, num_new, self.dtype, self.device, self.rotary)

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        step: StepInputs,
        last_only: bool = True,
        wait: bool = True,
    ) -> torch.Tensor:
        """All stages for all micro-batches; fp32 logits [B, V] (or [B, T, V]).

        wait=False: a decode step replayed from the graphs with every KV row on the GPU
        returns once issued (no host buffer or transfer thread takes part in it), so the
        caller can issue the next step while this one runs (`decode_loop`); every other
        step waits for the GPU, as all do with wait=True."""
        self.tracer.next_step()
        self.experts.rebalance()  # (a mixture of experts' placement by routing)
        self.tracer.spans.clear()
        self.tracer.begin(self.device.type == "cuda")
        started = time.perf_counter()
        token_ids = token_ids.to(self.device)
        steps = [_slice_step(step, m) for m in self._micro]
        graphs = self._decode_graphs(step) if last_only else None
        if graphs is not None:
            out = self._forward_graphs(graphs, token_ids, steps)
            if wait or not self.kv.all_on_gpu:
                self._sync()
            return out
        num_stages = len(self.homes.images)
        hidden: list[StoredAct | None] = [None] * len(self._micro)
        logits: list = [None] * len(self._micro)
        self.fetcher.fetch(0)
        for stage in range(num_stages):
            weights = self.fetcher.get(stage)
            if self.policy.overlap:
                if 0 < stage < num_stages - 1:  # this layer's KV, then the next weights
                    copy_follows = not self.homes.images[stage + 1].resident
                    self.kv.load_layer(stage - 1, step.cache_start, copy_follows)
                self.fetcher.fetch(stage + 1)
            if 0 < stage < num_stages - 1:
                self._layers(stage - 1, weights, hidden, steps)
            for k, rows in enumerate(self._micro):
                if stage == 0:
                    with self.lanes.on("compute", f"embed mb{k}"):
                        x = decoder.embed(
                            self.cfg, weights, token_ids[rows], steps[k].positions, self.parallel
                        )
                        hidden[k] = self.acts.store(k, x)
                elif stage == num_stages - 1:
                    x = self.acts.load(k, hidden[k])
                    with self.lanes.on("compute", f"head mb{k}"):
                        logits[k] = decoder.head(self.cfg, weights, x[:, -1:] if last_only else x)
            self.fetcher.done(stage)
            if not self.policy.overlap:
                self.fetcher.fetch(stage + 1)
                self._sync()
        out = torch.cat(logits, dim=0)
        self._sync()
        if self.tracer.enabled:
            spans = self.tracer.resolved()
            prefill = token_ids.shape[1] > 1
            self.traces.append(
                StepTrace(time.perf_counter() - started, busy_seconds(spans), prefill)
            )
            if prefill:
                self.prefill_spans = spans
            else:
                self.last_spans = spans
        return out[:, -1] if last_only else out

    # -- a decode step from CUDA graphs ----------------------------------------------------
    def _decode_graphs(self, step: StepInputs) -> list[DecodeGraphs] | None:
        """Each micro-batch's graphs, or None where this step runs eagerly: not a decode
        step, a policy with weights or activations off the GPU (`Policy.decode_graphs`),
        tracing on, or the first decode step of these micro-batch sizes (it compiles
        every kernel before any capture)."""
        if not (
            self.cuda_graphs
            and self.policy.decode_graphs
            and not self.tracer.enabled
            and step.positions.shape[1] == 1
            and step.cache_start > 0
        ):
            return None
        rows = tuple(m.stop - m.start for m in self._micro)
        if rows != self._graph_rows:
            if rows != self._warm_rows:
                self._warm_rows = rows
                return None
            assert all(image.resident for image in self.homes.images), "weights.gpu is 1"
            self._drop_graphs()  # the old sizes' graphs and memory go first
            self.kv.settle()  # no transfer thread's CUDA call inside the capture
            stages = [self.fetcher.get(s) for s in range(len(self.homes.images))]
            before = torch.cuda.memory_allocated(self.device)
            self._graphs = [
                DecodeGraphs(self.cfg, stages, n, self.dtype, self.device, step) for n in rows
            ]
            self._graph_rows = rows
            self._graph_bytes = max(0, torch.cuda.memory_allocated(self.device) - before)
            self.ledger.add(Tier.GPU, self._graph_bytes)
        return self._graphs

    def _drop_graphs(self) -> None:
        self._graphs, self._graph_rows = [], ()
        if self._graph_bytes:
            self.ledger.release(Tier.GPU, self._graph_bytes)
            self._graph_bytes = 0

    def _forward_graphs(
        self, graphs: list[DecodeGraphs], token_ids: torch.Tensor, steps: list[StepInputs]
    ) -> torch.Tensor:
        """The eager schedule's order (each layer for every micro-batch, then the next)
        with the work between attentions replayed."""
        for graph, rows, step in zip(graphs, self._micro, steps, strict=True):
            graph.begin(token_ids[rows], step)
        for layer in range(self.cfg.num_layers):
            if self.policy.overlap:  # the layer's off-GPU KV loads, ahead of its attentions
                self.kv.load_layer(layer, steps[0].cache_start, copy_follows=False)

            def begin(k: int, layer=layer):
                graph, step = graphs[k], decoder.layer_step(self.cfg, steps[k], layer)
                q, k_new, v_new = graph.qkv(layer)
                return self.kv.attention(
                    layer, k, q, k_new, v_new, step.bias, step.cache_start, step.causal,
                    out=graph.ctx,
                )  # fmt: skip

            def end(k: int, context, layer=layer) -> None:
                graphs[k].after_attention(layer, context())
                self._prefetch_kv_after(layer, k, steps[k].cache_start)

            self._one_behind(steps[0], begin, end)
        return torch.cat([graph.logits() for graph in graphs], dim=0)

    # -- one layer, micro-batch by micro-batch ------------------------------------------
    def _layers(self, layer: int, w: Weights, hidden: list, steps: list[StepInputs]) -> None:
        """Layer `layer` for every micro-batch; hidden[k] in and out."""

        def begin(k: int):
            x = self.acts.load(k, hidden[k])
            step = decoder.layer_step(self.cfg, steps[k], layer)
            with self.lanes.on("compute", f"L{layer} mb{k} qkv"):
                q, k_new, v_new, residual = decoder.attn_in(self.cfg, w, x, step)
            context = self.kv.attention(
                layer, k, q, k_new, v_new, step.bias, step.cache_start, step.causal,
                sinks=w.get("sinks"),
            )  # fmt: skip
            return context, residual

        if self.cfg.is_moe_layer(layer):  # experts by module (`moe_layer`)
            return self.experts.layer(self, layer, w, hidden, steps, begin)

        def end(k: int, started) -> None:
            context, residual = started
            context = context()
            with self.lanes.on("compute", f"L{layer} mb{k} mlp"):
                # with `parallel`: an all-reduce after the output projection and the MLP
                x = decoder.attn_out(self.cfg, w, context, self.parallel)
                del context  # not held through the MLP (`memory._layer_transient`)
                out = decoder.mlp_block(self.cfg, w, x, residual, self.parallel)
            self._prefetch_kv_after(layer, k, steps[k].cache_start)
            hidden[k] = self.acts.store(k, out)

        self._one_behind(steps[0], begin, end)

    def _one_behind(self, step: StepInputs, begin: Callable, end: Callable) -> None:
        """begin(k) then end(k, begin's result) for every micro-batch k. Where the CPU
        attends a decode step's off-GPU rows (in end, on this thread), micro-batch k + 1
        begins before k ends: the GPU computes k + 1's projections and copies its query
        out while the CPU attends k, and the CPU attends k + 1 right after, so the CPU
        never waits for a micro-batch's projections (docs/executor.md). Elsewhere
        each micro-batch ends before the next begins: a prefill's q, K and V ([B, T, 3 x
        hidden]) are not held beside the next micro-batch's; and so does the serial
        reference schedule (`overlap=False`)."""
        decode = step.positions.shape[1] == 1 and step.cache_start > 0
        lag = 1 if self.policy.overlap and self.policy.attention_on_cpu and decode else 0
        pending: list = []
        for k in range(len(self._micro)):
            pending.append((k, begin(k)))
            if len(pending) > lag:
                end(*pending.pop(0))
        for k, started in pending:
            end(k, started)

    def _prefetch_kv_after(self, layer: int, k: int, cache_start: int) -> None:
        if cache_start and self.policy.overlap:
            self.kv.prefetch_after(layer, k, cache_start)

    # -- memory and lifetime -------------------------------------------------------------
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def kv_pool_bytes(self) -> int:
        return self.kv.pool.capacity if self.kv.pool is not None else 0

    def expert_report(self) -> dict | None:
        return self.experts.report()

    def memory_report(self) -> dict[str, dict[str, int]]:
        report = self.ledger.snapshot()
        report["weights_pool"] = self.weights.pool.stats()
        if self.kv.pool is not None:
            report["kv_pool"] = self.kv.pool.stats()
        return report

    def close(self) -> None:
        sys.setswitchinterval(self._switch_interval)
        self._drop_graphs()
        self.kv.close()
        self.weights.close()


def _slice_step(step: StepInputs, rows: slice) -> StepInputs:
    rope = None if step.rope is None else (step.rope[0][rows], step.rope[1][rows])
    local = None if step.local is None else _slice_step(step.local, rows)
    return dataclasses.replace(
        step, positions=step.positions[rows], bias=step.bias[rows], rope=rope, local=local
    )
