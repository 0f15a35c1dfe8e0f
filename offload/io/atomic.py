"""Atomic file writes and inter-process locks.

`atomic_write(path, data)`: the whole new file or the whole old one, never a torn mix,
even across a crash (temporary file in the same directory, fsync, `os.replace`, then
an fsync of the directory so the rename itself is durable).

`exclusive(path, what)`: a `filelock` lock on `<path>.lock`; a second process waits
for it (saying so once), or with wait=False is refused with a one-line `UserError`.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from filelock import FileLock, Timeout

from offload.core.errors import UserError

log = logging.getLogger(__name__)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_writer(path: Path, mode: str = "w") -> Iterator[IO[Any]]:
    """A file object whose contents replace `path` atomically when the block ends
    without an exception (else `path` is untouched and the temporary file removed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, _file_mode(path))  # (mkstemp's 0600 would leave outputs private)
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def _file_mode(path: Path) -> int:
    """The mode the file it replaces had, else a new file's under the umask."""
    try:
        return path.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def atomic_write(path: Path, data: str | bytes) -> None:
    """Replace `path` with `data` atomically and durably (parents are created)."""
    with atomic_writer(path, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


def lock_path(path: Path) -> Path:
    return Path(path).with_name(Path(path).name + ".lock")


@contextmanager
def exclusive(path: Path, what: str, wait: bool = True) -> Iterator[None]:
    """Hold `<path>.lock` for the block: one process at a time per `path`.

    wait=True blocks until the holder finishes; wait=False refuses at once."""
    lock_path(path).parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_path(path)))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if not wait:
            raise UserError(
                f"{what} {path} is in use by another offload process (lock {lock_path(path)}); "
                "wait for it to finish or choose another path"
            ) from None
        log.warning("waiting for another offload process that holds %s", lock_path(path))
        lock.acquire()
    try:
        yield
    finally:
        lock.release()
