"""`LLM`: the offline batch generation API.

    llm = LLM("demo")
    outs = llm.generate(["The capital of France is"], SamplingParams(max_new_tokens=16))
    print(outs[0].text)

Prompts are sorted by length and cut into batches (less padding), each batch is
prefilled in one step and decoded token by token with a KV cache, and results come
back in the caller's order. The loop per batch: tokenize -> prefill -> sample ->
decode ... until every sequence hit EOS, a stop string or its token budget.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from offload.batch import PaddedBatch
from offload.errors import UserError
from offload.executor.caps import MemoryCaps, check_block_fits, check_weights_fit, process_rss
from offload.executor.executor import Executor
from offload.models.resolve import ModelSpec, resolve_model
from offload.policies.policy import Policy
from offload.runner import PlainRunner
from offload.sampling import SamplingParams, make_generators, sample_rows

if TYPE_CHECKING:  # the engine imports torch.distributed only for a TP rank
    from offload.parallel.comm import TensorParallel

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RequestOutput:
    prompt: str | None
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) or "length"


@dataclass
class GenerationStats:
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    batches: int = 0

    @property
    def seconds(self) -> float:
        return self.prefill_seconds + self.decode_seconds

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(
            "--device cuda was asked for but no CUDA device is visible; use --device cpu"
        )
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str) -> torch.dtype:
    if name != "auto":
        if name not in DTYPES:
            raise UserError(f"unknown dtype {name!r}; choose auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if checkpoint_dtype == "float16" else torch.bfloat16


@dataclass
class _Sequence:
    prompt: str | None
    prompt_ids: list[int]
    budget: int
    params: SamplingParams
    generator: torch.Generator | None = None
    generated: list[int] = field(default_factory=list)
    text: str | None = None  # set when a stop string cut the completion
    finish_reason: str | None = None


class LLM:
    """A model ready to generate. `model` is anything `--model` accepts."""

    def __init__(
        self,
        model: str | ModelSpec,
        dtype: str = "auto",
        device: str = "auto",
        dummy: bool = False,
        batch_size: int = 16,
        progress: bool = False,
        policy: Policy | None = None,
        caps: MemoryCaps | None = None,
        nvme: Path | None = None,
        trace: bool = False,
        parallel: TensorParallel | None = None,
    ) -> None:
        """policy=None runs everything on one device (the plain runner); a `Policy` runs
        the offloading executor with its placement, batch shape and the memory caps.
        parallel: this process is one tensor-parallel rank (`offload.parallel`): the
        executor runs over the rank's shard, caps and nvme are the rank's own."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.spec = model if isinstance(model, ModelSpec) else resolve_model(model, dummy=dummy)
        self.config = self.spec.config
        # tensor parallelism: caps are checked for the rank's shard (its ModelConfig)
        self._rank_config = self.config if parallel is None else parallel.shard.config
        if parallel is not None and policy is None:
            policy = Policy(gpu_batch_size=batch_size, num_gpu_batches=1)
        self.device = resolve_device(device) if parallel is None else parallel.device
        self.dtype = resolve_dtype(dtype, self.device, self.config.checkpoint_dtype)
        self.policy, self.caps = policy, caps or MemoryCaps()
        self.batch_size = policy.block_size if policy else batch_size
        if policy is not None:
            check_weights_fit(self._rank_config, policy, self.dtype, self.device, self.caps, nvme)
        self.tokenizer = self.spec.tokenizer()
        with self.spec.open_weights() as source:
            if parallel is not None:
                from offload.parallel.rank import make_rank_runner

                self.runner = make_rank_runner(
                    source, parallel, policy, self.dtype, self.device, nvme, trace, progress
                )
            elif policy is None:
                self.runner = PlainRunner(source, self.dtype, self.device, progress=progress)
            else:
                self.runner = Executor(
                    source,
                    policy,
                    self.dtype,
                    self.device,
                    nvme_dir=nvme,
                    trace=trace,
                    progress=progress,
                )
        self.eos_ids = set(self.config.eos_token_ids) | self.tokenizer.eos_token_ids
        self.pad_id = self.config.pad_token_id or 0
        self.stats = GenerationStats()
        self.on_phase: Callable[[str], None] | None = None  # told "prefill" / "decode"

    # -- prompts ----------------------------------------------------------------------
    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        if chat:
            text = self.tokenizer.render_chat([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    def check_prompt(self, ids: list[int]) -> None:
        limit = self.config.max_position_embeddings
        if not ids:
            raise UserError("a prompt is empty; give it at least one token of text")
        if len(ids) >= limit:
            raise UserError(
                f"a prompt has {len(ids)} tokens but the model's context is {limit}; shorten it"
            )

    # -- generation -------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str] | Sequence[list[int]],
        params: SamplingParams | None = None,
        chat: bool = False,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, or token ids); outputs in the same order.

        chat=True renders each text prompt as a user message with the tokenizer's chat
        template.
        """
        params = params or SamplingParams()
        requests = []
        for prompt in prompts:
            if isinstance(prompt, str):
                ids = self.encode_prompt(prompt, chat=chat and self.tokenizer.has_chat_template)
            else:
                ids = list(prompt)
            self.check_prompt(ids)
            requests.append((ids, params))
        outs = self.generate_ids(requests)
        for out, prompt in zip(outs, prompts, strict=True):
            out.prompt = prompt if isinstance(prompt, str) else None
        return outs

    def generate_ids(
        self, requests: Sequence[tuple[list[int], SamplingParams]]
    ) -> list[RequestOutput]:
        """Generate for already-checked token-id prompts, each with its own sampling."""
        seqs = []
        for ids, params in requests:
            budget = min(params.max_new_tokens, self.config.max_position_embeddings - len(ids))
            seqs.append(_Sequence(None, list(ids), budget, params))
        if not seqs:
            return []
        if self.policy is not None:
            longest = max(len(s.prompt_ids) for s in seqs)
            budget = max(s.budget for s in seqs)
            resident = process_rss() - self.runner.kv_pool_bytes
            check_block_fits(
                self._rank_config,
                self.policy,
                self.dtype,
                self.device,
                self.caps,
                longest,
                budget,
                resident,
            )
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].prompt_ids))
        for start in range(0, len(order), self.batch_size):
            self._generate_batch([seqs[i] for i in order[start : start + self.batch_size]])
        return [
            RequestOutput(
                prompt=s.prompt,
                text=s.text if s.text is not None else self.tokenizer.decode(s.generated),
                token_ids=s.generated,
                prompt_tokens=len(s.prompt_ids),
                completion_tokens=len(s.generated),
                finish_reason=s.finish_reason or "length",
            )
            for s in seqs
        ]

    def _generate_batch(self, seqs: list[_Sequence]) -> None:
        runner, stats = self.runner, self.stats
        steps = max(s.budget for s in seqs)
        batch = PaddedBatch(self.config, [s.prompt_ids for s in seqs], steps, self.pad_id)
        for seq in seqs:
            gens = make_generators(seq.params, 1)
            seq.generator = gens[0] if gens else None
        self._phase("prefill")
        runner.start(batch)
        started = time.perf_counter()
        step = runner.step_inputs(batch, 0, batch.prompt_len)
        logits = runner.forward(batch.prompt_ids, step)
        stats.prefill_seconds += self._sync_elapsed(started)
        stats.prompt_tokens += sum(len(s.prompt_ids) for s in seqs)
        stats.batches += 1
        started = time.perf_counter()
        self._phase("decode")
        for t in range(steps):
            next_ids = sample_rows(logits, [s.params for s in seqs], [s.generator for s in seqs])
            self._append(seqs, next_ids.tolist())
            if all(s.finish_reason for s in seqs) or t == steps - 1:
                break
            step = runner.step_inputs(batch, batch.prompt_len + t, 1)
            logits = runner.forward(next_ids[:, None], step)
        stats.decode_seconds += self._sync_elapsed(started)

    def close(self) -> None:
        """Release pinned memory, spill files and reader threads of the executor."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _sync_elapsed(self, started: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def _phase(self, name: str) -> None:
        if self.on_phase is not None:
            self.on_phase(name)

    def _append(self, seqs: list[_Sequence], next_ids: list[int]) -> None:
        for seq, token in zip(seqs, next_ids, strict=True):
            if seq.finish_reason:
                continue
            seq.generated.append(token)
            self.stats.generated_tokens += 1
            if token in self.eos_ids:
                seq.finish_reason = "stop"
            if seq.params.stop:
                text = self.tokenizer.decode(seq.generated)
                cuts = [i for i in (text.find(stop) for stop in seq.params.stop) if i >= 0]
                if cuts:
                    seq.text, seq.finish_reason = text[: min(cuts)], "stop"
            if not seq.finish_reason and len(seq.generated) >= seq.budget:
                seq.finish_reason = "length"
