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

import logging
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from offload.args import EngineArgs, caps_from_max_memory, resolve_device
from offload.config import DTYPES, resolve_dtype
from offload.decode_loop import DecodeLoop
from offload.errors import UserError
from offload.io.atomic import exclusive
from offload.models.resolve import resolve_model
from offload.outputs import GenerationStats, RequestOutput
from offload.policies.caps import Baseline, Caps, check_block_fits, check_weights_fit
from offload.policies.policy import Policy
from offload.runner import PlainRunner, Runner
from offload.sampling import SamplingParams, from_generation_config

__all__ = ["DTYPES", "LLM", "GenerationStats", "RequestOutput", "resolve_device", "resolve_dtype"]

if TYPE_CHECKING:  # the engine imports torch.distributed only for a TP rank
    from offload.parallel.comm import TensorParallel

log = logging.getLogger(__name__)

Prompt = str | dict[str, Any] | list[int]
Message = dict[str, str]


class LLM:
    """A model ready to generate. `model` is anything `--model` accepts.

    Keyword arguments are `EngineArgs` fields (dtype, device, revision, batch_size,
    chat_template, ...), plus accelerate's `max_memory` ({"cuda:0": "24GB", "cpu":
    "100GB"}) and `offload_folder` (the weight store and KV spill directory): caps
    without a `policy` run the same plan search as offload-run. `policy` (a `Policy` or
    a JSON path) runs the offloading executor with that placement.
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
        progress: bool = False,
        trace: bool = False,
        parallel: TensorParallel | None = None,
        **engine_args: Any,
    ) -> None:
        device = resolve_device(engine_args.get("device", "auto"))
        gpu_mem, cpu_mem = caps_from_max_memory(max_memory, device)
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
        self._build(args, None if as_path else policy, gen_len, progress, trace, parallel)

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
        llm = cls.__new__(cls)
        llm._build(args, policy, gen_len, progress, trace, parallel)
        return llm

    def _build(
        self,
        args: EngineArgs,
        policy: Policy | None,
        gen_len: int | None,
        progress: bool,
        trace: bool,
        parallel: TensorParallel | None = None,
    ) -> None:
        """parallel: this process is one tensor-parallel rank (`offload.parallel`): the
        executor runs over the rank's shard, and caps and nvme are the rank's own."""
        self.args = args
        self.parallel = parallel
        self.spec = resolve_model(args.model, dummy=args.dummy, revision=args.revision)
        self.config = self.spec.config
        self.device = resolve_device(args.device) if parallel is None else parallel.device
        # tensor parallelism: memory is planned and checked for the rank's shard
        self.rank_config = self.config if parallel is None else parallel.shard.config
        self.dtype = resolve_dtype(
            args.dtype, self.device.type == "cuda", self.config.checkpoint_dtype
        )
        gen_config = self.spec.generation_config() if args.generation_config == "auto" else {}
        self.default_sampling = from_generation_config(gen_config)
        self.chat_template = _chat_template(args.chat_template)
        if args.policy is not None:
            policy = Policy.from_file(args.policy)
        gen_len = gen_len or self.get_default_sampling_params().max_tokens or 256
        if policy is None and args.wants_search:
            policy = self._search(gen_len)
        if parallel is not None and policy is None:
            policy = Policy(gpu_batch_size=args.batch_size, num_gpu_batches=1)
        self.policy = policy
        self.caps = Caps(args.gpu_bytes, args.cpu_bytes, nvme=args.nvme is not None)
        self.batch_size = policy.block_size if policy else args.batch_size
        # what the process holds before any weights: the baseline of the one accounting
        self.baseline = Baseline.measure(self.device)
        if policy is not None:
            check_weights_fit(
                self.rank_config, policy, self.dtype, self.device, self.caps, self.baseline
            )
            # the block as planned (prompt_len + gen_len) fits, before anything loads
            check_block_fits(
                self.rank_config,
                policy,
                self.dtype,
                self.device,
                self.caps,
                self.baseline,
                args.planned_prompt_len,
                gen_len,
            )
        self.tokenizer = self.spec.tokenizer()
        self.runner: Runner = self._load(progress, trace)
        eos = gen_config.get("eos_token_id")
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        self.eos_ids = set(self.config.eos_token_ids) | self.tokenizer.eos_token_ids | set(eos)
        self.stats = GenerationStats()
        self.on_phase: Callable[[str], None] | None = None  # told "prefill" / "decode"
        self.loop = DecodeLoop(
            self.config,
            self.tokenizer,
            self.eos_ids,
            self.stats,
            self._phase,
            self.device,
        )

    def _search(self, gen_len: int) -> Policy:
        from offload.policies.choose import choose_policy

        choice = choose_policy(
            self.rank_config,
            self.dtype,
            self.args.gpu_bytes,
            self.args.cpu_bytes,
            self.args.nvme,
            self.args.planned_prompt_len,
            gen_len,
            self.args.profile,
            compressions=self.args.compressions(),
            kv_compressions=self.args.kv_compressions(),
        )
        best = choice.best
        log.info(
            "searched policy: predicted %.1f tok/s, bottleneck %s",
            best.total_tok_s,
            best.bottleneck,
        )
        return best.policy

    def _load(self, progress: bool, trace: bool) -> Runner:
        nvme, policy = self.args.nvme, self.policy
        # one process at a time builds or opens a weight store directory
        lock = exclusive(nvme / "store", "weight store directory") if nvme else nullcontext()
        with self.spec.open_weights() as source, lock:
            if self.parallel is not None:
                from offload.parallel.rank import make_rank_runner

                return make_rank_runner(
                    source, self.parallel, policy, self.dtype, self.device, nvme, trace, progress
                )
            if policy is None:
                return PlainRunner(source, self.dtype, self.device, progress=progress)
            from offload.executor.executor import Executor

            return Executor(
                source,
                policy,
                self.dtype,
                self.device,
                nvme_dir=nvme,
                trace=trace,
                progress=progress,
            )

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM's)."""
        return SamplingParams(**self.default_sampling)

    def get_tokenizer(self):
        return self.tokenizer

    # -- prompts ----------------------------------------------------------------------
    def encode_prompt(self, prompt: str) -> list[int]:
        """Raw text, as vLLM's generate and the completions API: never templated."""
        return self.tokenizer.encode(prompt)

    def encode_chat(self, messages: list[Message], chat_template: str | None = None) -> list[int]:
        template = _chat_template(chat_template) or self.chat_template
        if template is None and not self.tokenizer.has_chat_template:
            raise UserError(
                "this model's tokenizer has no chat template; pass --chat-template "
                "(chat_template=) with one, or send raw prompts"
            )
        text = self.tokenizer.render_chat(messages, template)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_prompt(self, ids: list[int]) -> None:
        limit = self.config.max_position_embeddings
        if not ids:
            raise UserError("a prompt is empty; give it at least one token of text")
        if len(ids) >= limit:
            raise UserError(
                f"a prompt has {len(ids)} tokens but the model's context is {limit}; shorten it"
            )

    def _prompt_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.encode_prompt(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.encode_prompt(prompt["prompt"])
            raise UserError('a prompt dict needs "prompt" (text) or "prompt_token_ids"')
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise UserError(
            f"a prompt must be text, a token-id list or a dict, got {type(prompt).__name__}"
        )

    # -- generation -------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for each prompt: text (never templated), {"prompt_token_ids": [...]}
        or {"prompt": text}. One SamplingParams for all, or one per prompt; None takes
        the model's defaults. Outputs in the prompts' order."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        encoded = [self._prompt_ids(p) for p in prompts]
        return self._run(encoded, sampling_params)

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply to one conversation (a list of {"role", "content"}) or to
        each of a list of them, rendered with the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        encoded = []
        for conversation in conversations:
            ids = self.encode_chat(list(conversation), chat_template)
            encoded.append((self.tokenizer.decode(ids, skip_special_tokens=False), ids))
        return self._run(encoded, sampling_params)

    def _run(self, encoded, sampling_params) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(encoded)
        else:
            params = list(sampling_params)
            if len(params) != len(encoded):
                raise ValueError(
                    f"{len(params)} sampling params for {len(encoded)} prompts; give one, "
                    "or one per prompt"
                )
        for _, ids in encoded:
            self.check_prompt(ids)
        outs = self.generate_ids([(ids, p) for (_, ids), p in zip(encoded, params, strict=True)])
        for out, (text, _) in zip(outs, encoded, strict=True):
            out.prompt = text
        return outs

    def generate_ids(
        self, requests: Sequence[tuple[list[int], SamplingParams]]
    ) -> list[RequestOutput]:
        """Generate for already-checked token-id prompts, each with its own sampling."""
        if self.policy is not None and requests:
            limit = self.config.max_position_embeddings
            longest = max(len(ids) for ids, _ in requests)
            budget = max(min(p.max_tokens or limit, limit - len(ids)) for ids, p in requests)
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
        return self.loop.run(self.runner, requests, self.batch_size)

    # -- lifetime ---------------------------------------------------------------------
    def close(self) -> None:
        """Release pinned memory, spill files and reader threads of the executor."""
        self.runner.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _phase(self, name: str) -> None:
        if self.on_phase is not None:
            self.on_phase(name)


def _chat_template(value: str | None) -> str | None:
    """--chat-template: a file holding a Jinja template, or the template itself."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if len(value) < 4096 and path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise UserError(
        f"--chat-template {value!r} is neither a file nor a Jinja template; give a path or "
        "the template text"
    )
