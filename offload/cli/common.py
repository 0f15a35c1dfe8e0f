"""What every CLI shares: user-error handling, logging set-up, size parsing."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable

from offload.errors import UserError
from offload.kernels.formats import KV_GROUPS, Compression

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


COMPRESS_HELP = (
    "weight compression: none (default), int4 or int8 (group-wise, group 64, asymmetric; "
    "add -gN for another group size, -sym for symmetric), or auto (the plan search chooses "
    "among none, int4 and int8)"
)
_COMPRESS = re.compile(r"int(4|8)(?:-g(\d+))?(-sym)?")


KV_COMPRESS_HELP = (
    "KV cache compression: none (default), int4 or int8 (keys per channel over groups of "
    "64 tokens, values per token; -gN for 16, 32 or 128 tokens, -sym for symmetric), or "
    "auto (the plan search chooses among none, int4 and int8); a compressed cache is kept "
    "on the GPU"
)


def parse_compression(text: str | None, flag: str = "--compress") -> tuple[Compression | None, ...]:
    """--compress / --kv-compress: the formats the plan may use (None is uncompressed)."""
    if text is None or text == "none":
        return (None,)
    if text == "auto":
        return (None, Compression(4, 64, False), Compression(8, 64, False))
    match = _COMPRESS.fullmatch(text)
    if match is None:
        raise UserError(
            f"{flag} {text!r} is not understood; use none, int4, int8, int4-g128, int8-sym or auto"
        )
    bits, group, sym = match.groups()
    try:
        return (Compression(int(bits), int(group or 64), sym is not None),)
    except ValueError as exc:
        raise UserError(f"{flag} {text}: {exc}") from None


def parse_kv_compression(text: str | None) -> tuple[Compression | None, ...]:
    """--kv-compress: as --compress, with the group counted in tokens (16 to 128)."""
    formats = parse_compression(text, "--kv-compress")
    for c in formats:
        if c is not None and c.group_size not in KV_GROUPS:
            raise UserError(
                f"--kv-compress {text}: the group is tokens a key group, one of "
                f"{', '.join(map(str, KV_GROUPS))}"
            )
    return formats


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
