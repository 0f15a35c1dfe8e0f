"""Chat conversations as vLLM's `LLM.chat` and OpenAI's messages give them.

A message's content is a string or a list of OpenAI content parts; the text parts are
joined with newlines (vLLM's "string" content format) before the chat template sees
them, since most templates concatenate `message['content']` as a string. A part that is
not text (an image, audio, a file) is refused by its type: the models here read text.
`ChatOptions` carries what `LLM.chat` passes to the template besides the messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from offload.core.errors import UserError

TEXT_PART_TYPES = ("text", "input_text")  # (the Responses API names a text part input_text)


def text_content(content: Any, where: str) -> str:
    """A message's content as text: a string as it is, text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise UserError(
            f"{where}: content must be a string or a list of content parts, got "
            f"{type(content).__name__}"
        )
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PART_TYPES:
            named = f"of type {kind!r}" if kind else f"{part!r:.40}"
            raise UserError(
                f"{where}: a content part {named} is not text; offload generates from text "
                'only: send {"type": "text", "text": ...} parts'
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise UserError(f'{where}: a text part needs a string "text"')
        texts.append(text)
    return "\n".join(texts)


def text_messages(messages: list[Any], raw_parts: bool = False) -> list[dict[str, Any]]:
    """The conversation with each message's content as text (`text_content`); the
    message's other keys (name, tool_calls, ...) are kept for the template. raw_parts:
    content parts are left as given (vLLM's chat_template_content_format="openai", for
    a template that reads them), after the same check."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise UserError(
                f'message {i}: each message is a {{"role", "content"}} dict, got {message!r:.60}'
            )
        text = text_content(message.get("content", ""), f"message {i}")
        out.append(message if raw_parts else {**message, "content": text})
    return out


CONTENT_FORMATS = ("auto", "string", "openai")


@dataclass(frozen=True)
class ChatOptions:
    """What vLLM's `LLM.chat` passes to the chat template besides the conversation:
    add_generation_prompt (the assistant's header after the last message),
    continue_final_message (the last message left open for the model to go on: its
    reply's prefix), tools, and chat_template_kwargs (e.g. Qwen3's enable_thinking)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    content_format: str = "auto"

    def __post_init__(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise UserError(
                "continue_final_message=True continues the last message, and "
                "add_generation_prompt=True starts a new one: pass add_generation_prompt=False"
            )
        kwargs = self.chat_template_kwargs
        if kwargs is not None and not (
            isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)
        ):
            raise UserError(
                f"chat_template_kwargs must be a dict of names to values, got {kwargs!r:.60}"
            )
        if self.content_format not in CONTENT_FORMATS:
            raise UserError(
                f"chat_template_content_format {self.content_format!r}: choose "
                + ", ".join(CONTENT_FORMATS)
            )

    def template_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of the template's rendering."""
        out: dict[str, Any] = dict(self.chat_template_kwargs or {})
        out["add_generation_prompt"] = self.add_generation_prompt
        out["continue_final_message"] = self.continue_final_message
        if self.tools is not None:
            out["tools"] = self.tools
        return out


def encode_conversations(
    front: Any, messages: Any, template: str | None, options: ChatOptions
) -> list[tuple[str, list[int]]]:
    """(the prompt's text, its token ids) of one conversation or each of a list of them,
    rendered by the front's tokenizer with the template (`ModelFront.encode_chat`)."""
    conversations = [messages] if messages and isinstance(messages[0], dict) else messages
    raw = options.content_format == "openai"
    encoded = []
    for conversation in conversations:
        turns = text_messages(list(conversation), raw_parts=raw)
        ids = front.encode_chat(turns, template, **options.template_kwargs())
        encoded.append((front.tokenizer.decode(ids, skip_special_tokens=False), ids))
    return encoded
