"""offload's log, as vLLM's: the `offload` logger shows its lines (the load, the model's
provenance, the plan) on stderr at INFO without any set-up by the program, at the level
OFFLOAD_LOGGING_LEVEL names (as VLLM_LOGGING_LEVEL); OFFLOAD_CONFIGURE_LOGGING=0 leaves
logging wholly to the program.

A program that configures logging itself (a handler on the root logger: `basicConfig`,
pytest, the CLIs) gets the lines through its own handlers, as any library's: the handler
here writes only while the root logger has none, so no line is shown twice.
"""

from __future__ import annotations

import logging
import os
import sys

from offload.core.errors import UserError

LEVEL_ENV = "OFFLOAD_LOGGING_LEVEL"
CONFIGURE_ENV = "OFFLOAD_CONFIGURE_LOGGING"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def level_from_env(default: int = logging.INFO) -> int:
    """The level OFFLOAD_LOGGING_LEVEL names (a name or a number), else `default`."""
    text = os.environ.get(LEVEL_ENV, "").strip()
    if not text:
        return default
    if text.upper() in LEVELS:
        return getattr(logging, text.upper())
    if text.isdigit():
        return int(text)
    raise UserError(f"{LEVEL_ENV}={text!r} is not a level; use one of {', '.join(LEVELS)}")


class _UnlessConfigured(logging.Handler):
    """stderr (as it is at each line, so a redirected stderr gets it), while the program
    has no handler of its own on the root logger."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s", "%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # (the record propagates to the program's handlers)
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except (OSError, ValueError):  # a closed stderr costs the line, not the run
            self.handleError(record)


def configure_package_logger() -> None:
    """Give the `offload` logger its level and stderr handler (once; at import)."""
    if os.environ.get(CONFIGURE_ENV, "1") == "0":
        return
    logger = logging.getLogger("offload")
    if not any(isinstance(h, _UnlessConfigured) for h in logger.handlers):
        logger.addHandler(_UnlessConfigured())
    try:
        logger.setLevel(level_from_env())
    except UserError as exc:  # (at import: a bad variable is said, not raised)
        logger.setLevel(logging.INFO)
        logger.warning("%s; logging at INFO", exc)
