"""Opening files for O_DIRECT I/O, falling back where the file system refuses it."""

from __future__ import annotations

import os


def open_direct(path: str | os.PathLike, flags: int, mode: int = 0o644) -> tuple[int, bool]:
    """os.open with O_DIRECT added; (fd, True) on success, (fd, False) after falling back
    to buffered I/O on file systems such as tmpfs that refuse it."""
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, mode), True
        except OSError:
            pass
    return os.open(path, flags, mode), False
