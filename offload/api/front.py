"""`ModelFront`: the light half of an engine, ready before any weight loads.

The model's config, its dtype on the device, the sampling defaults of its
generation_config.json, the chat template and the tokenizer: enough to turn every
request into token ids and judge it against the model's context. offload-run measures
its job with a front before the plan search and the load (`offload.cli.sizing`); an
`LLM` keeps its front and encodes through it, so there is one path from a request to
its token ids.
"""

from __future__ import annotations

from numbers import Integral
from pathlib import Path
from typing import Any

import torch

from offload.api.args import EngineArgs
from offload.api.vllm_args import check_prequantized
from offload.core.config import resolve_dtype
from offload.core.errors import BadTokenIds, PromptTooLong, UserError
from offload.core.sampling import SamplingParams, from_generation_config
from offload.models.resolve import resolve_model

Message = dict[str, str]

# The most bytes of text a token is taken to cover, to refuse a prompt by its size before
# tokenizing it: a token covers about 4 bytes of English text on average, and the longest
# tokens are runs of spaces or punctuation (81 bytes in the demo's vocabulary, SmolLM2's:
# a newline and 80 spaces; docs/log.md). Text longer than the context times this bound
# could not fit, however the vocabulary cut it.
MAX_TOKEN_BYTES = 256


class ModelFront:
    """The model's spec, config, dtype, sampling defaults, chat template and tokenizer."""

    def __init__(self, args: EngineArgs, device: torch.device) -> None:
        self.spec = resolve_model(args.model, dummy=args.dummy, revision=args.revision)
        self.config = self.spec.config
        check_prequantized(args.prequantized, _declared_method(self.spec), args.model)
        self.device = device
        self.dtype = resolve_dtype(args.dtype, device.type == "cuda", self.config.checkpoint_dtype)
        self.generation_config = (
            self.spec.generation_config() if args.generation_config == "auto" else {}
        )
        self.default_sampling = from_generation_config(self.generation_config)
        self.chat_template = chat_template(args.chat_template)
        self.tokenizer = self.spec.tokenizer(args.byte_tokenizer)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM's)."""
        return SamplingParams(**self.default_sampling)

    def encode_prompt(self, prompt: str) -> list[int]:
        """Raw text, as vLLM's generate and the completions API: never templated."""
        self.check_text(prompt)
        return self.tokenizer.encode(prompt)

    def encode_chat(
        self, messages: list[Message], template: str | None = None, **options: Any
    ) -> list[int]:
        """options: the template's keyword arguments (`chat.ChatOptions.template_kwargs`)."""
        template = chat_template(template) or self.chat_template
        if template is None and not self.tokenizer.has_chat_template:
            raise UserError(
                "this model's tokenizer has no chat template; pass --chat-template "
                "(chat_template=) with one, or send raw prompts"
            )
        text = self.tokenizer.render_chat(messages, template, **options)
        self.check_text(text)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_text(self, text: str) -> None:
        """Before the tokenizer sees it: the text is Unicode (no lone surrogate, which
        the tokenizer refuses with a TypeError), and not so long that no tokenization of
        it fits the context (`MAX_TOKEN_BYTES`): a line of megabytes is refused in a
        moment, not after the tokenizer spent minutes and gigabytes on it."""
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise UserError(
                f"a prompt holds a lone surrogate (\\u{ord(text[exc.start]):04x} at character "
                f"{exc.start}), which is not Unicode text; fix the prompt"
            ) from None
        limit = self.config.max_position_embeddings
        if size > limit * MAX_TOKEN_BYTES:
            raise PromptTooLong(
                f"a prompt has {size} bytes of text, more than the model's context of {limit} "
                f"tokens can hold at {MAX_TOKEN_BYTES} bytes a token; shorten it"
            )

    def check_prompt(self, ids: list[int]) -> None:
        """A prompt has at least one token, every token in the vocabulary (an id past the
        embedding table would fail the job mid-run), and leaves room in the context for
        one more."""
        limit = self.config.max_position_embeddings
        if not ids:
            raise UserError("a prompt is empty; give it at least one token of text")
        vocab = self.config.vocab_size
        bad = [t for t in ids if not _is_id(t) or not 0 <= t < vocab]
        if bad:
            shown = ", ".join(map(repr, bad[:5])) + (" ..." if len(bad) > 5 else "")
            raise BadTokenIds(
                f"prompt token id(s) {shown} are not in the model's vocabulary of {vocab} "
                f"(ids 0 to {vocab - 1}); fix the ids"
            )
        if len(ids) >= limit:
            raise PromptTooLong(
                f"a prompt has {len(ids)} tokens but the model's context is {limit}; shorten it"
            )


def _declared_method(spec) -> str | None:
    """The pre-quantized method a checkpoint directory's config.json declares (None: none,
    or not a directory: a GGUF file, a preset)."""
    if spec.path is None or not spec.path.is_dir():
        return None
    from offload.models.prequant import format_of

    fmt = format_of(spec.path)
    return None if fmt is None else fmt.method


def _is_id(token: Any) -> bool:
    """An integer token id (numpy's and torch's integers too; not a bool)."""
    return isinstance(token, Integral) and not isinstance(token, bool)


def chat_template(value: str | None) -> str | None:
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


def eos_ids(front: ModelFront) -> set[int]:
    """Token ids that end a sequence: the config's, the tokenizer's, generation_config's."""
    eos: Any = front.generation_config.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return set(front.config.eos_token_ids) | front.tokenizer.eos_token_ids | set(eos)
