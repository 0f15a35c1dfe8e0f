"""CUDA graphs of a decode step's work between attentions, for GPU-resident weights.

A decode step of a 30B model launches a few hundred small kernels, and the host
thread's launching, not the GPU, set the step's time (profiled: GPU busy 22 ms of a
33.5 ms step). When every stage's weights live on the GPU, everything but the attention
is the same work on the same addresses every step: it is captured once per
micro-batch into CUDA graphs and replayed.

Graph 0 is the embedding and layer 0's attention input (norm, QKV, RoPE); graph i + 1
is layer i's output projection and MLP and then layer i + 1's attention input, or the
head after the last layer. The attention itself, which writes the step's K/V at a
position that moves every step and reads a cache that grows, runs eagerly between the
replays, from the graphs' q, k, v into `ctx`. Inputs that change every step (token
ids, positions, RoPE's cos/sin) are copied into the graphs' static buffers first.

One `DecodeGraphs` per micro-batch: its buffers must not be shared, since the executor
runs a stage for every micro-batch before the next stage.
"""

from __future__ import annotations

import torch

from offload.core.config import ModelConfig
from offload.models import decoder
from offload.models.decoder import StepInputs
from offload.models.shapes import Weights


class DecodeGraphs:
    def __init__(
        self,
        cfg: ModelConfig,
        stages: list[Weights],
        rows: int,
        dtype: torch.dtype,
        device: torch.device,
        like: StepInputs,
    ) -> None:
        """stages: every stage's GPU-resident weights (embed, layers, head); like: a
        decode step's inputs, whose rope tables (and local ones) the buffers copy."""
        self.ids = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.positions = torch.zeros((rows, 1), dtype=torch.long, device=device)

        def buffers(rope):
            if rope is None:
                return None
            shape = (rows, 1, rope[0].shape[-1])
            return tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in "cs")

        self.rope = buffers(like.rope)
        self.ctx = torch.zeros((rows, 1, cfg.num_heads * cfg.head_dim), dtype=dtype, device=device)
        # attention reads none of the step's other fields inside the graphs
        self.local_rope = None if like.local is None else buffers(like.local.rope)
        local = None
        if like.local is not None:  # the windowed layers' own rope tables
            local = StepInputs(self.positions, self.ctx, 0, self.local_rope)
        step = StepInputs(self.positions, self.ctx, 0, self.rope, local=local)
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.outputs: list = []  # per graph: (q, k, v, residual), the last: logits
        layers = cfg.num_layers
        pool = torch.cuda.graph_pool_handle()  # shared by these graphs: replayed in order
        with self._capture(pool):
            x = decoder.embed(cfg, stages[0], self.ids, self.positions)
            self.outputs.append(
                decoder.attn_in(cfg, stages[1], x, decoder.layer_step(cfg, step, 0))
            )
        for layer in range(layers):
            with self._capture(pool):
                residual = self.outputs[layer][3]
                h = decoder.attn_out_and_mlp(cfg, stages[1 + layer], self.ctx, residual)
                if layer + 1 < layers:
                    after = decoder.layer_step(cfg, step, layer + 1)
                    self.outputs.append(decoder.attn_in(cfg, stages[2 + layer], h, after))
                else:
                    self.outputs.append(decoder.head(cfg, stages[-1], h))

    def _capture(self, pool):
        """The capture binds only this thread: the KV transfer threads (their event
        waits, the disk reads ahead) run on beside it. In the default ("global") mode
        their CUDA calls invalidated the capture whenever they fell inside it
        (cudaErrorStreamCaptureInvalidated in cuBLAS; the compressed KV with CPU and
        disk homes: 4 of 9 GPU suite runs under xdist on the H100 machine)."""
        graph = torch.cuda.CUDAGraph()
        self.graphs.append(graph)
        return torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local")

    def begin(self, token_ids: torch.Tensor, step: StepInputs) -> None:
        """The step's inputs into the static buffers; embedding and layer 0's QKV."""
        self.ids.copy_(token_ids)
        self.positions.copy_(step.positions)
        for buffers, rope in (
            (self.rope, step.rope),
            (self.local_rope, step.local and step.local.rope),
        ):
            if buffers is not None:
                assert rope is not None
                buffers[0].copy_(rope[0])
                buffers[1].copy_(rope[1])
        self.graphs[0].replay()

    def qkv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v, _ = self.outputs[layer]
        return q, k, v

    def after_attention(self, layer: int, context: torch.Tensor) -> None:
        """Layer's attention output in (the attention may have written it into `ctx`
        already); its MLP and the next layer's QKV (or the head)."""
        if context.data_ptr() != self.ctx.data_ptr():
            self.ctx.copy_(context)
        self.graphs[layer + 1].replay()

    def logits(self) -> torch.Tensor:
        """fp32 logits [rows, V] of the step (a copy: the buffer is the next step's)."""
        return self.outputs[-1][:, -1].clone()
