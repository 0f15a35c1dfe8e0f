"""Reading prompt files: JSONL (`{"id": ..., "prompt": ...}` a line) or plain text."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from offload.errors import UserError


@dataclass(frozen=True)
class PromptRequest:
    id: str
    prompt: str


def _is_jsonl(path: Path, lines: list[str]) -> bool:
    if path.suffix in (".jsonl", ".json"):
        return True
    first = next((line for line in lines if line.strip()), "")
    return first.lstrip().startswith("{")


def read_prompts(path: Path) -> list[PromptRequest]:
    """All requests in a prompts file; a malformed line is a `UserError` naming it."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"prompts file {path} does not exist; check the path") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"prompts file {path} is not UTF-8 text ({exc.reason})") from None
    if not _is_jsonl(path, lines):
        return [PromptRequest(str(n), line) for n, line in enumerate(lines, 1) if line.strip()]
    requests = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(
                f"{path}:{n}: not valid JSON ({exc.msg}); fix or remove the line"
            ) from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise UserError(f'{path}:{n}: each line needs a "prompt" string')
        requests.append(PromptRequest(str(obj.get("id", n)), obj["prompt"]))
    if not requests:
        raise UserError(f"prompts file {path} holds no prompts")
    return requests
