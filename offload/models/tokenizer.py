"""Tokenizers: the model's own (Hugging Face), or UTF-8 bytes where there is none.

Dummy presets (random weights) have no tokenizer; `ByteTokenizer` maps UTF-8 bytes to
ids 0..255 so text still goes in and comes out. A real checkpoint without tokenizer
files is refused, naming them: its outputs in byte ids would be garbage, unless the
model was trained on bytes, which the user says with `--byte-tokenizer`.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from offload.core.errors import UserError

log = logging.getLogger(__name__)


class Tokenizer:
    """Wraps a transformers tokenizer behind the few calls generation needs."""

    def __init__(self, hf: Any) -> None:
        self.hf = hf

    @property
    def eos_token_ids(self) -> set[int]:
        return {self.hf.eos_token_id} if self.hf.eos_token_id is not None else set()

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(
        self, messages: list[dict[str, Any]], template: str | None = None, **options: Any
    ) -> str:
        """The conversation as the prompt text, ready for the assistant's reply;
        `template` (Jinja) replaces the tokenizer's own; options: the template's keyword
        arguments (add_generation_prompt, default True; continue_final_message, tools, and
        any the template reads)."""
        options = {"add_generation_prompt": True, **options}
        return self.hf.apply_chat_template(
            messages, chat_template=template, tokenize=False, **options
        )


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; for models that ship no tokenizer."""

    has_chat_template = False

    @property
    def eos_token_ids(self) -> set[int]:
        return set()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def render_chat(
        self, messages: list[dict[str, Any]], template: str | None = None, **options: Any
    ) -> str:
        options = {"add_generation_prompt": True, **options}
        if template is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            return env.from_string(template).render(messages=messages, **options)
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        return text + ("\nassistant:" if options["add_generation_prompt"] else "")


def _gguf_tokenizer(path: Path) -> Tokenizer:
    """A GGUF file's tokenizer; the converted form is cached (conversion takes seconds)."""
    from transformers import AutoTokenizer

    from offload.models.demo import cache_dir

    stat = path.resolve().stat()
    ident = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    cached = cache_dir() / "gguf-tokenizers" / key
    if (cached / "tokenizer_config.json").is_file():
        return Tokenizer(AutoTokenizer.from_pretrained(str(cached)))
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    partial = cached.with_name(key + ".partial")
    try:
        hf.save_pretrained(str(partial))
        os.replace(partial, cached)
    except OSError as exc:  # a read-only cache only costs time
        log.debug("could not cache the GGUF tokenizer: %s", exc)
    return Tokenizer(hf)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

# what a token is for a model that ships no tokenizer, said beside its prompt lengths
BYTE_TOKENS = "tokens are UTF-8 bytes: the model ships no tokenizer"


def ships_tokenizer(directory: Path) -> bool:
    """Whether a model directory holds a tokenizer (else its text is UTF-8 bytes)."""
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(
    directory: Path | None, gguf_file: str | None = None, byte_ids: str = "refuse"
) -> Tokenizer | ByteTokenizer:
    """The tokenizer in a model directory (or GGUF file). byte_ids: what a directory
    without one gets: "refuse" (a real checkpoint), "asked" (--byte-tokenizer) or
    "dummy" (random weights: bytes are as good as any); no directory is a preset's."""
    from transformers import AutoTokenizer

    if directory is not None and gguf_file is not None:
        return _gguf_tokenizer(directory / gguf_file)
    found = [name for name in TOKENIZER_FILES if directory and (directory / name).is_file()]
    if found and byte_ids == "asked":
        raise UserError(
            f"{directory} ships a tokenizer ({found[0]}); drop --byte-tokenizer "
            "(byte_tokenizer=True), which is for checkpoints without one"
        )
    if found:
        return Tokenizer(AutoTokenizer.from_pretrained(str(directory)))
    if directory is not None and byte_ids == "refuse":
        raise UserError(
            f"model directory {directory} has no tokenizer ({', '.join(TOKENIZER_FILES)}); "
            "copy the tokenizer files from the model's repo into it, or pass "
            "--byte-tokenizer (byte_tokenizer=True) to use UTF-8 bytes as token ids (right "
            "only for a model trained on bytes)"
        )
    log.info("the model has no tokenizer; UTF-8 bytes are its token ids")
    return ByteTokenizer()
