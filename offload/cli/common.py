"""What every CLI shares: user-error handling, logging set-up, size parsing."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable

from offload.errors import UserError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """Parse "24GB", "24GiB", "512MB", "1.5TB" or a plain byte count into bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise UserError(f"cannot parse size {text!r}; write it like 24GB, 24GiB or 512MB")
    return int(float(match.group(1)) * _UNITS[unit])


def setup_logging(quiet: bool) -> None:
    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO,
        format="%(message)s",
        stream=sys.stderr,
    )
    for noisy in ("transformers", "huggingface_hub", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def run_cli(prog: str, body: Callable[[], int]) -> int:
    """Run a CLI body; user mistakes print one line and exit 2, never a traceback."""
    try:
        return body()
    except UserError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
