"""OpenAI Batch API files: request lines in, result lines out.

A request line: {"custom_id", "method": "POST", "url": "/v1/completions" or
"/v1/chat/completions", "body": {...}}. A completions body has `prompt` (text, never
templated, or token ids); a chat body has `messages` (rendered with the chat template).
Sampling fields map onto `SamplingParams` (docs/compat.md lists each one: supported,
mapped or refused). A result line: {"id", "custom_id", "response": {"status_code",
"request_id", "body": {"id", "object", "created", "model", "choices", "usage"}},
"error": null}, or "response": null with "error": {"code", "message"}.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from offload.api.chat import text_content

URLS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
LINE_FIELDS = {"custom_id", "method", "url", "body"}
# body fields taken as SamplingParams fields of the same name (vLLM's server takes the
# last eight too)
SAME_NAME = [
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
]
# body fields accepted and ignored: they do not change the tokens
IGNORED = {"model", "user", "stream_options", "metadata", "store", "service_tier"}
# body fields accepted only at the value that means "off"
OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "stream": (False, None),
    "echo": (False, None),
    "logprobs": (False, None, 0),
    "top_logprobs": (None, 0),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "response_format": (None, {"type": "text"}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, False, True),
}


def is_openai_line(obj: Any) -> bool:
    return isinstance(obj, dict) and "custom_id" in obj


def parse_line(obj: Any) -> tuple[str, str, dict[str, Any]]:
    """(custom_id, kind, body) of a request line; ValueError names what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError("a line must be a JSON object")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError('"custom_id" must be a non-empty string')
    unknown = sorted(set(obj) - LINE_FIELDS)
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(unknown)}")
    if obj.get("method", "POST") != "POST":
        raise ValueError(f'"method" must be "POST", got {obj.get("method")!r}')
    url = obj.get("url")
    if url not in URLS:
        raise ValueError(f'"url" {url!r} is not served; use {" or ".join(URLS)}')
    body = obj.get("body")
    if not isinstance(body, dict):
        raise ValueError('"body" must be a JSON object')
    return custom_id, URLS[url], body


def body_request(kind: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(prompt fields, sampling overrides) of a body; ValueError names the bad field."""
    known = set(SAME_NAME) | IGNORED | set(OFF_VALUES) | {"prompt", "messages"}
    if kind == "chat":
        known.add("max_completion_tokens")
    unknown = sorted(set(body) - known)
    if unknown:
        raise ValueError(f"unknown body field(s): {', '.join(unknown)}")
    for name, allowed in OFF_VALUES.items():
        if name in body and body[name] not in allowed:
            raise ValueError(f"body field {name}={body[name]!r} is not supported (docs/compat.md)")
    overrides = {k: body[k] for k in SAME_NAME if k in body and body[k] is not None}
    if kind == "chat" and body.get("max_completion_tokens") is not None:
        overrides["max_tokens"] = body["max_completion_tokens"]
    if kind == "completions":
        if "messages" in body:
            raise ValueError('a /v1/completions body takes "prompt", not "messages"')
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return {"prompt": prompt}, overrides
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return {"prompt_token_ids": prompt}, overrides
        raise ValueError(
            'no prompt: "prompt" must be a string or a list of token ids (one prompt a line)'
        )
    if "prompt" in body:
        raise ValueError('a /v1/chat/completions body takes "messages", not "prompt"')
    return {"messages": chat_messages(body.get("messages"))}, overrides


def chat_messages(messages: Any) -> list[dict[str, str]]:
    """OpenAI messages with text content (a string, or a list of {"type": "text"} parts,
    joined by newlines as vLLM's; another part is refused by its type)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError('no prompt: "messages" must be a non-empty list of {"role", "content"}')
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError('"messages" must be a list of {"role", "content"}')
        content = m.get("content")
        if not isinstance(content, (str, list)):
            raise ValueError('each message needs a string "content"')
        content = text_content(content, f"message {len(out)}")  # (as `LLM.chat` reads it)
        out.append({"role": m["role"], "content": content})
    return out


def result_line(custom_id: str, kind: str, model: str, out: Any) -> dict[str, Any]:
    """A Batch API output line for a finished request (`RequestOutput`)."""
    chat = kind == "chat"
    choices = []
    for c in out.outputs:
        choice: dict[str, Any] = {"index": c.index}
        if chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        choice |= {"logprobs": None, "finish_reason": c.finish_reason}
        choices.append(choice)
    usage = {
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "total_tokens": out.prompt_tokens + out.completion_tokens,
    }
    body = {
        "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
    }
    response = {"status_code": 200, "request_id": uuid.uuid4().hex, "body": body}
    return {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": custom_id, "response": response, "error": None}  # fmt: skip


def error_line(custom_id: str, message: str) -> dict[str, Any]:
    return {
        "id": "batch_req_" + uuid.uuid4().hex,
        "custom_id": custom_id,
        "response": None,
        "error": {"code": "invalid_request", "message": message},
    }
