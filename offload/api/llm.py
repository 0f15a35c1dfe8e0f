"""`LLM`: the offline batch generation API, in vLLM's shape.

    llm = LLM("demo")
    outputs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    print(outputs[0].outputs[0].text)

Prompts are sorted by length and cut into batches (less padding), each batch is
prefilled in one step and decoded token by token with a KV cache, and results come
back in the caller's order. The loop per batch: tokenize -> prefill -> sample ->
decode ... until every sequence hit EOS, a stop string or its token budget.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from offload.api.args import EngineArgs, from_vllm_arguments, resolve_device
from offload.api.chat import ChatOptions, encode_conversations
from offload.api.decode_loop import DecodeLoop
from offload.api.front import Message, ModelFront, eos_ids
from offload.api.max_memory import caps_from_args
from offload.api.planning import Plan, front_and_plan, holds_allocator
from offload.api.profiling import MetricsAndProfiler, TorchProfile, profiler_dir
from offload.api.prompts import Prompt, checked, encode_prompts, params_for
from offload.core.config import DTYPES, resolve_dtype
from offload.core.errors import UserError
from offload.core.metrics import EngineMetrics
from offload.core.outputs import GenerationStats, RequestOutput
from offload.core.progress import PromptsBar
from offload.core.sampling import SamplingParams
from offload.executor.runner import PlainRunner, Runner
from offload.io.atomic import exclusive
from offload.policies.caps import Caps, check_block_fits, hold_gpu_allocator
from offload.policies.policy import Policy

__all__ = ["DTYPES", "LLM", "GenerationStats", "RequestOutput", "resolve_device", "resolve_dtype"]

if TYPE_CHECKING:  # the engine imports torch.distributed only for a TP rank
    from offload.parallel.comm import TensorParallel


log = logging.getLogger(__name__)


class LLM(MetricsAndProfiler):
    """A model ready to generate. `model` is anything `--model` accepts.

    Keyword arguments are `EngineArgs` fields (dtype, device, revision, batch_size,
    chat_template, ...); vLLM's where they have a meaning here (`args.from_vllm_arguments`:
    max_num_seqs, quantization, gpu_memory_utilization; the others refused with the fix)
    and its `seed` (sampled requests without a seed of their own draw one from it, in
    order, so a script samples the same text again); and accelerate's `max_memory`
    ({"cuda:0": "24GB", "cpu": "100GB"}) and `offload_folder` (the weight store and KV
    spill directory): caps without a `policy` run the same plan search as offload-run.
    `policy` (a `Policy` or a JSON path) runs the offloading executor with that placement.
    progress: a bar of the load (plain lines off a terminal), as vLLM's.
    A GPU cap holds this process's CUDA caching allocator to it until `close`
    (`caps.hold_gpu_allocator`: process-wide state, one held engine at a time), except
    under tensor parallelism; `hold_gpu_mem=False` leaves the allocator free.
    """

    def __init__(
        self,
        model: str,
        *,
        max_memory: dict[Any, Any] | None = None,
        offload_folder: str | Path | None = None,
        policy: Policy | str | Path | None = None,
        caps: Caps | None = None,
        nvme: str | Path | None = None,
        gen_len: int | None = None,
        progress: bool = True,
        trace: bool = False,
        parallel: TensorParallel | None = None,
        seed: int | None = None,
        profiler_config: Any = None,
        **engine_args: Any,
    ) -> None:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise UserError(f"seed={seed!r} is not an integer")
        trace_dir = profiler_dir(profiler_config)  # (judged before the load)
        device = resolve_device(engine_args.get("device", "auto"))
        gpu_mem, cpu_mem = caps_from_args(max_memory, engine_args, device)
        engine_args, gpu_mem = from_vllm_arguments(engine_args, device, gpu_mem)
        if caps is not None:  # byte caps given as `Caps`: the same as sizes
            gpu_mem = gpu_mem or (f"{caps.gpu_bytes}B" if caps.gpu_bytes else None)
            cpu_mem = cpu_mem or (f"{caps.cpu_bytes}B" if caps.cpu_bytes else None)
        folder = offload_folder if offload_folder is not None else nvme
        as_path = isinstance(policy, (str, Path))
        args = EngineArgs(
            model=model,
            gpu_mem=gpu_mem,
            cpu_mem=cpu_mem,
            nvme=Path(folder) if folder is not None else None,
            policy=Path(policy) if as_path else None,
            **engine_args,
        )
        front, plan = front_and_plan(args, None if as_path else policy, gen_len, parallel)
        self._open(args, front, plan, progress, trace, parallel, seed)
        self.profile.directory = trace_dir

    @classmethod
    def from_engine_args(
        cls,
        args: EngineArgs,
        gen_len: int | None = None,
        progress: bool = False,
        trace: bool = False,
        policy: Policy | None = None,
        parallel: TensorParallel | None = None,
    ) -> LLM:
        """policy: a placement chosen already (a TP job's, shared by its ranks);
        parallel: this process is one tensor-parallel rank."""
        front, plan = front_and_plan(args, policy, gen_len, parallel)
        return cls.from_plan(args, front, plan, progress, trace, parallel)

    @classmethod
    def from_plan(
        cls,
        args: EngineArgs,
        front: ModelFront,
        plan: Plan,
        progress: bool = False,
        trace: bool | int = False,
        parallel: TensorParallel | None = None,
        seed: int | None = None,
    ) -> LLM:
        """Load the weights for a plan made already (`planning.plan_run`) with this front:
        offload-run judges its job and plans before anything long runs. Every `LLM` is
        built here (`LLM(...)` and `from_engine_args` plan, then come through `_open`).
        trace: lane traces of every forward step (True), or of one in N (N)."""
        llm = cls.__new__(cls)
        llm._open(args, front, plan, progress, trace, parallel, seed)
        return llm

    def _open(
        self,
        args: EngineArgs,
        front: ModelFront,
        plan: Plan,
        progress: bool,
        trace: bool | int,
        parallel: TensorParallel | None,
        seed: int | None,
    ) -> None:
        """front -> plan -> load: the engine over a checked plan."""
        if args.hold_gpu_mem and parallel is not None:
            raise UserError(
                "--hold-gpu-mem is not supported with tensor parallelism (each rank's NCCL "
                "buffers grow outside the allocator after the plan): drop it"
            )
        self.args, self.front, self.plan, self.parallel = args, front, plan, parallel
        self.closed = False
        # vLLM's seed: the sampled requests without a seed of their own draw one from it,
        # in the order they come, so the same script samples the same text again
        self._seeds = None if seed is None else random.Random(seed)
        # process-wide allocator state, put back by `close` (or a failed load)
        self._hold = (
            hold_gpu_allocator(plan.caps, plan.baseline, self.device)
            if holds_allocator(args, plan, self.device, parallel is not None)
            else None
        )
        started = time.perf_counter()
        try:
            self.runner: Runner = self._load(progress, trace)
        except BaseException:
            self._release_hold()
            raise
        self.load_seconds = time.perf_counter() - started
        log.info("%s; loaded in %.1f s", self.provenance(), self.load_seconds)
        self.eos_ids = eos_ids(front)
        self.stats = GenerationStats()
        self.metrics = EngineMetrics(self.stats)  # `get_metrics`
        self.profile = TorchProfile(profiler_dir(None), self.device)  # `start_profile`
        self._request_ids = itertools.count()
        self.on_phase: Callable[[str], None] | None = None  # told "prefill" / "decode"
        self.loop = DecodeLoop(
            self.config, self.tokenizer, self.eos_ids, self.stats, self._phase, self.device
        )

    # -- what the front and the plan hold ---------------------------------------------
    @property
    def spec(self):
        return self.front.spec

    def provenance(self) -> str:
        """Which model runs, from where, how: the load's log line."""
        spec, where = self.spec, self.spec.path or "random weights"
        revision = f" at {self.args.revision}" if self.args.revision else ""
        return (
            f"model {self.model_name} ({spec.kind} from {where}{revision}, "
            f"{self.config.param_count() / 1e6:.0f}M parameters) on {self.device} in "
            f"{str(self.dtype).removeprefix('torch.')}"
        )

    @property
    def model_name(self) -> str:
        """The model's name as the user gave it (`served_model_name`, else `model`), for
        the log and results: never a hub snapshot's directory."""
        served = self.args.served_model_name
        if isinstance(served, (list, tuple)):  # vLLM takes several: the first names results
            served = served[0] if served else None
        return served or self.args.model

    @property
    def config(self):
        return self.front.config

    @property
    def tokenizer(self):
        return self.front.tokenizer

    @property
    def device(self):
        return self.front.device

    @property
    def dtype(self):
        return self.front.dtype

    @property
    def default_sampling(self) -> dict[str, Any]:
        return self.front.default_sampling

    @property
    def chat_template(self) -> str | None:
        return self.front.chat_template

    @property
    def rank_config(self):
        """The model config this process computes: a tensor-parallel rank's shard, or all."""
        return self.config if self.parallel is None else self.parallel.shard.config

    @property
    def policy(self) -> Policy | None:
        return self.plan.policy

    @property
    def caps(self) -> Caps:
        return self.plan.caps

    @property
    def baseline(self):
        return self.plan.baseline

    @property
    def batch_size(self) -> int:
        return self.plan.batch_size

    @property
    def holds_gpu_allocator(self) -> bool:
        """Whether the caching allocator is held to the GPU cap (`planning.holds_allocator`)."""
        return self._hold is not None

    @property
    def planned_for(self) -> tuple[int, int]:
        """The prompt length and new tokens the plan was sized for."""
        return self.plan.prompt_len, self.plan.gen_len

    def _load(self, progress: bool, trace: bool | int) -> Runner:
        nvme, policy = self.args.nvme, self.policy
        # one process at a time builds or opens a weight store directory
        lock = exclusive(nvme / "store", "weight store directory") if nvme else nullcontext()
        with self.spec.open_weights() as source, lock:
            if self.parallel is not None:
                from offload.parallel.rank import make_rank_runner

                runner = make_rank_runner(
                    source, self.parallel, policy, self.dtype, self.device, nvme, trace, progress
                )
                executor = runner.executor
            elif policy is None:
                return PlainRunner(source, self.dtype, self.device, progress=progress)
            else:
                from offload.executor.executor import Executor

                runner = executor = Executor(
                    source,
                    policy,
                    self.dtype,
                    self.device,
                    nvme_dir=nvme,
                    trace=trace,
                    progress=progress,
                )
        executor.warm_up(progress)  # (a rank's too: its kernels load before the job)
        return runner

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM's)."""
        return self.front.get_default_sampling_params()

    def get_tokenizer(self):
        return self.tokenizer

    # -- prompts (the front's: one path from a request to its token ids) --------------
    def encode_prompt(self, prompt: str) -> list[int]:
        """Raw text, as vLLM's generate and the completions API: never templated."""
        return self.front.encode_prompt(prompt)

    def encode_chat(
        self, messages: list[Message], chat_template: str | None = None, **options: Any
    ) -> list[int]:
        return self.front.encode_chat(messages, chat_template, **options)

    def check_prompt(self, ids: list[int]) -> None:
        self.front.check_prompt(ids)

    # -- generation -------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt: text (never templated), {"prompt_token_ids": [...]}
        or {"prompt": text}. One SamplingParams for all, or one per prompt; None takes
        the model's defaults. Outputs in the prompts' order. use_tqdm: a progress bar on
        stderr (plain lines where it is not a terminal), or a tqdm-like class to draw it."""
        self._check_open()
        encoded = encode_prompts(self.front, prompts)
        return self._run(encoded, sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply to one conversation (a list of {"role", "content"}) or to
        each of a list of them, rendered with the chat template; vLLM's arguments
        (`chat.ChatOptions`). A content may be OpenAI's parts: text parts are joined,
        others refused by type."""
        self._check_open()
        if messages is None:
            raise UserError(
                'chat() got no conversation (None); pass a list of {"role", "content"} '
                "messages, or a list of such lists"
            )
        options = ChatOptions(
            add_generation_prompt, continue_final_message, tools, chat_template_kwargs,
            chat_template_content_format,
        )  # fmt: skip
        encoded = encode_conversations(self.front, messages, chat_template, options)
        return self._run(encoded, sampling_params, use_tqdm)

    def _run(self, encoded, sampling_params, use_tqdm=False) -> list[RequestOutput]:
        defaults = self.get_default_sampling_params()
        params = params_for(sampling_params, len(encoded), defaults)
        for _, ids in encoded:
            self.check_prompt(ids)
        if self._seeds is not None:
            params = [
                p if p.greedy or p.seed is not None
                else dataclasses.replace(p, seed=self._seeds.getrandbits(63))
                for p in params
            ]  # fmt: skip
        params = checked(params)  # judged before any work, the bar included
        requests = [(ids, p) for (_, ids), p in zip(encoded, params, strict=True)]
        factory = use_tqdm if callable(use_tqdm) else None
        bar = PromptsBar(len(requests), self.stats, factory) if use_tqdm else None
        self.loop.on_step = bar.on_step if bar else None  # (it moves within a block)
        try:
            outs = self.generate_ids(requests, bar.on_batch if bar else None)
        finally:
            self.loop.on_step = None
            if bar is not None:
                bar.close()
        for out, (text, _) in zip(outs, encoded, strict=True):
            out.prompt = text
        return outs

    def generate_ids(
        self,
        requests: Sequence[tuple[list[int], SamplingParams]],
        on_batch: Callable[[int], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for already-checked token-id prompts, each with its own sampling (as
        it is now: `SamplingParams.checked`). Every output gets a request id unique for
        the engine's life, as vLLM's. on_batch(requests finished) after each batch."""
        self._check_open()
        params = checked([p for _, p in requests])
        requests = [(ids, p) for (ids, _), p in zip(requests, params, strict=True)]
        if self.policy is not None and requests:
            limit = self.config.max_position_embeddings
            longest = max(len(ids) for ids, _ in requests)
            budget = max(p.budget(len(ids), limit) for ids, p in requests)
            check_block_fits(
                self.rank_config,
                self.policy,
                self.dtype,
                self.device,
                self.caps,
                self.baseline,
                longest,
                budget,
            )
        outs = self.loop.run(self.runner, requests, self.batch_size, on_batch)
        for out in outs:
            out.request_id = str(next(self._request_ids))
        self.metrics.observe(outs)
        return outs

    # -- lifetime ---------------------------------------------------------------------
    def close(self) -> None:
        """Release pinned memory, spill files and reader threads of the executor, and the
        GPU allocator's limit (`hold_gpu_mem`). The engine cannot generate after it."""
        self.closed = True
        try:
            self.runner.close()
        finally:
            self._release_hold()

    def _check_open(self) -> None:
        if self.closed:
            raise UserError(
                "this LLM was closed (close(), or the end of its with-block); create a new "
                "LLM(...) to generate again"
            )

    def _release_hold(self) -> None:
        if self._hold is not None:
            self._hold.release()
            self._hold = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _phase(self, name: str) -> None:
        if self.on_phase is not None:
            self.on_phase(name)
