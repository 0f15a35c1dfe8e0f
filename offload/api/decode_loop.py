"""`DecodeLoop`: the generation loop over a `Runner`, one batch at a time.

    tokenize (the caller) -> sort by length, cut into batches -> prefill -> sample ->
    decode ... until every sequence hit EOS, a stop string or id, or its token budget.

A request with `n` samples is n sequences; each has its own `SequenceSampler`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from offload.core.config import ModelConfig
from offload.core.outputs import (
    CompletionOutput,
    GenerationStats,
    RequestMetrics,
    RequestOutput,
)
from offload.core.sampling import SamplingParams, SequenceSampler, sample_rows
from offload.executor.runner import Runner
from offload.models.batch import PaddedBatch


@dataclass
class _Sequence:
    """One sample being generated: a request's prompt, its budget and its sampler."""

    request: int
    sample: int
    prompt_ids: list[int]
    budget: int
    params: SamplingParams
    sampler: SequenceSampler | None = None
    generated: list[int] = field(default_factory=list)
    text: str | None = None  # set when a stop string cut the completion
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # host wall times (time.time()): its block's start, its first and last tokens
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None


class DecodeLoop:
    def __init__(
        self,
        config: ModelConfig,
        tokenizer,
        eos_ids: set[int],
        stats: GenerationStats,
        phase: Callable[[str], None],
        device: torch.device,
    ) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.eos_ids, self.stats, self._phase = eos_ids, stats, phase
        self.pad_id = config.pad_token_id or 0
        self.device = device
        # called after each step's tokens are counted in `stats` (on the host: no sync is
        # added), so a progress display moves within a block
        self.on_step: Callable[[], None] | None = None

    def run(
        self,
        runner: Runner,
        requests: Sequence[tuple[list[int], SamplingParams]],
        batch_size: int,
        on_batch: Callable[[int], None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs for checked token-id prompts, in their order, batches of batch_size.
        on_batch(requests finished so far) is called after each batch."""
        arrival = time.time()
        limit = self.config.max_position_embeddings
        seqs = [
            _Sequence(r, i, list(ids), p.budget(len(ids), limit), p)
            for r, (ids, p) in enumerate(requests)
            for i in range(p.n)
        ]
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].prompt_ids))
        samples_left = [p.n for _, p in requests]
        finished = 0
        for start in range(0, len(order), batch_size):
            batch = [seqs[i] for i in order[start : start + batch_size]]
            self._generate_batch(runner, batch)
            for seq in batch:
                samples_left[seq.request] -= 1
                finished += samples_left[seq.request] == 0
            if on_batch is not None:
                on_batch(finished)
        outs = [RequestOutput(str(r), None, list(ids), []) for r, (ids, _) in enumerate(requests)]
        samples: list[list[_Sequence]] = [[] for _ in requests]
        for s in seqs:
            outs[s.request].outputs.append(self._completion(s))
            samples[s.request].append(s)
        for out, its in zip(outs, samples, strict=True):
            out.metrics = _metrics(arrival, its)
        return outs

    def _completion(self, s: _Sequence) -> CompletionOutput:
        text = s.text
        if text is None:
            ids = s.generated
            if isinstance(s.stop_reason, int) and not s.params.include_stop_str_in_output:
                ids = ids[:-1]
            text = self.tokenizer.decode(ids, skip_special_tokens=s.params.skip_special_tokens)
        return CompletionOutput(
            s.sample, text, s.generated, s.finish_reason or "length", s.stop_reason
        )

    def _generate_batch(self, runner: Runner, seqs: list[_Sequence]) -> None:
        stats = self.stats
        steps = max(s.budget for s in seqs)
        batch = PaddedBatch(self.config, [s.prompt_ids for s in seqs], steps, self.pad_id)
        for seq in seqs:
            seq.sampler = SequenceSampler(seq.params, self.eos_ids, len(seq.prompt_ids), seq.sample)
        self._phase("prefill")
        scheduled = time.time()
        for seq in seqs:
            seq.scheduled_at = scheduled
        began = time.perf_counter()
        runner.start(batch)
        started = time.perf_counter()
        start_s = started - began
        step = runner.step_inputs(batch, 0, batch.prompt_len)
        # popped when sampled, so a step's logits are not held through the next step's
        # layers (`memory.activation_plan`)
        logits = [runner.forward(batch.prompt_ids, step)]
        prefill_s = self._sync_elapsed(started)
        stats.prefill_seconds += prefill_s
        stats.prompt_tokens += sum(len(s.prompt_ids) for s in seqs)
        stats.batches += 1
        started = time.perf_counter()
        self._phase("decode")
        ahead = self._ahead(seqs)
        for t in range(steps):
            last = t == steps - 1
            if ahead:
                next_ids = self._issue_ahead(runner, batch, logits, t, last)
            else:
                next_ids = sample_rows(
                    logits.pop(),
                    [s.sampler for s in seqs],
                    [s.prompt_ids + s.generated for s in seqs],
                )
            self._append(seqs, next_ids.tolist())
            if self.on_step is not None:
                self.on_step()
            if all(s.finish_reason for s in seqs) or last:
                break  # (ahead: a step already issued for nobody is left to finish)
            if not ahead:
                step = runner.step_inputs(batch, batch.prompt_len + t, 1)
                logits.append(runner.forward(next_ids[:, None], step))
        decode_s = self._sync_elapsed(started)
        stats.decode_seconds += decode_s
        stats.timeline.append(
            {"rows": len(seqs), "prompt_len": batch.prompt_len, "steps": t + 1,
             "began_s": began, "start_s": start_s, "prefill_s": prefill_s,
             "decode_s": decode_s}
        )  # fmt: skip

    def _ahead(self, seqs: list[_Sequence]) -> bool:
        """Whether step t + 1 is issued from the GPU's tokens before the host reads them
        (`_issue_ahead`): on a GPU, where every row is plain greedy."""
        return self.device.type == "cuda" and all(s.params.plain_greedy for s in seqs)

    def _issue_ahead(
        self, runner: Runner, batch: PaddedBatch, logits: list, t: int, last: bool
    ) -> torch.Tensor:
        """Every row greedy with nothing that reads the history: step t's tokens are the
        logits' argmax on the GPU, which feeds step t + 1 there, issued before the host
        reads them (a runner that can returns as soon as the step is issued), so the
        host's bookkeeping of step t overlaps the GPU's step t + 1 and the GPU does not
        wait between steps for the host. The tokens of step t, on the CPU."""
        ids = logits.pop().argmax(dim=-1)
        host = ids.to("cpu", non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        if not last:
            step = runner.step_inputs(batch, batch.prompt_len + t, 1)
            logits.append(runner.forward(ids[:, None], step, wait=False))
        copied.synchronize()
        return host

    def _append(self, seqs: list[_Sequence], next_ids: list[int]) -> None:
        now = time.time()  # (the ids are on the host already)
        for seq, token in zip(seqs, next_ids, strict=True):
            if seq.finish_reason:
                continue
            seq.generated.append(token)
            seq.first_token_at = seq.first_token_at or now
            seq.last_token_at = now
            self.stats.generated_tokens += 1
            p = seq.params
            if token in p.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
            elif token in self.eos_ids and not p.ignore_eos:
                seq.finish_reason = "stop"
            elif p.stop and len(seq.generated) >= p.min_tokens:
                self._check_stop_strings(seq)
            if not seq.finish_reason and len(seq.generated) >= seq.budget:
                seq.finish_reason = "length"

    def _check_stop_strings(self, seq: _Sequence) -> None:
        p = seq.params
        text = self.tokenizer.decode(seq.generated, skip_special_tokens=p.skip_special_tokens)
        cuts = [(text.find(s), s) for s in p.stop if s in text]
        if cuts:
            at, stop = min(cuts)
            keep = at + len(stop) if p.include_stop_str_in_output else at
            seq.text, seq.finish_reason, seq.stop_reason = text[:keep], "stop", stop

    def _sync_elapsed(self, started: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - started


def _metrics(arrival: float, samples: list[_Sequence]) -> RequestMetrics:
    """A request's times from its samples': the first of their starts and first tokens,
    the last of their last tokens."""
    scheduled = min(s.scheduled_at for s in samples if s.scheduled_at is not None)
    first = min((s.first_token_at for s in samples if s.first_token_at), default=None)
    last = max((s.last_token_at for s in samples if s.last_token_at), default=scheduled)
    return RequestMetrics(
        arrival_time=arrival,
        last_token_time=last,
        first_scheduled_time=scheduled,
        first_token_time=first,
        time_in_queue=scheduled - arrival,
        finished_time=last,
    )
