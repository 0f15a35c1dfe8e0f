"""Atomic file writes and inter-process locks.

`atomic_write(path, data)`: the whole new file or the whole old one, never a torn mix,
even across a crash (temporary file in the same directory, fsync, `os.replace`, then
an fsync of the directory so the rename itself is durable).

`lock_file(path, what, wait)`: an OS lock (`flock`) on an open file, which a second
process waits for (saying so once) or, with wait=False, is refused with a one-line
`UserError`; `exclusive(path, what)` holds one on `<path>.lock` and removes that file
when it ends.

`check_writable` refuses a path that cannot be written before any long work, and
`disk_full` turns a write that found no space into one line: the path, the space it
needs, what is free, and the fix.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from offload.core.errors import DiskFull, UserError

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


def check_writable(path: Path, what: str, directory: bool = False) -> None:
    """Refuse, before any long work, a path this process could not write. One rule with
    the writers: a file's missing folders are made by its writer (`atomic_writer`, which
    every report and trace goes through), a directory's by the run, so the nearest
    existing folder is judged. directory: a folder the run writes files in; else a file
    written at the end."""
    path = Path(path)
    if directory and path.exists() and not path.is_dir():
        raise UserError(f"{what} {path} is not a directory; give a directory")
    if not directory and path.is_dir():
        raise UserError(f"{what} {path} is a directory; give a file path")
    if not directory and path.exists() and not os.access(path, os.W_OK):
        raise UserError(f"cannot write {what} {path}: the file is read-only; give another path")
    folder = path if directory else path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(f"cannot write {what} {path}: {folder} is a file, not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(
            f"cannot write {what} {path}: directory {folder} is read-only (or on a read-only "
            "file system); give a path on a writable drive"
        )


# the errors of a write that found its drive full (or the user's quota spent)
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def size_text(nbytes: float) -> str:
    """Bytes as a person reads them: 1.5 GB, 340 MB, 12 KB (never "0.0 GB")."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def disk_full(path: Path, needed_bytes: int, fix: str, at_least: bool = False) -> DiskFull:
    """The one-line error for a write to `path` that found no space: what it needs (about,
    or at_least), what the drive has free, and `fix` (what to do, and whether a rerun
    resumes)."""
    folder = Path(path)
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    return DiskFull(
        f"no space left for {path}: it needs {'at least' if at_least else 'about'} "
        f"{size_text(needed_bytes)} and the drive "
        f"has {size_text(free)} free; {fix}"
    )


def lock_path(path: Path) -> Path:
    return Path(path).with_name(Path(path).name + ".lock")


def lock_file(path: Path, what: str, wait: bool, flags: int = os.O_RDWR) -> int:
    """Open `path` (created if missing) and hold an OS lock (`flock`) on the open file;
    returns the descriptor, whose closing releases the lock. The lock is the open file's,
    not its name's: when the name came to name another file while this process waited
    (its holder removed it on release), the file it names now is locked instead.

    what: the thing locked, as the messages name it ("--output out.jsonl"). wait=False
    refuses at once with a one-line `UserError` when another process holds it."""
    while True:
        fd = os.open(path, flags | os.O_CREAT, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not wait:
                    raise UserError(
                        f"{what} is in use by another offload process; wait for it to finish "
                        "or choose another path"
                    ) from None
                log.warning("waiting for another offload process that holds %s", path)
                fcntl.flock(fd, fcntl.LOCK_EX)
            if names(path, fd):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write all of `data` at the descriptor (a write may take only part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def names(path: Path, fd: int) -> bool:
    """Whether `path` names the open file `fd`."""
    try:
        return os.path.samestat(os.stat(path), os.fstat(fd))
    except FileNotFoundError:
        return False


@contextmanager
def exclusive(path: Path, what: str, wait: bool = True) -> Iterator[None]:
    """Hold an OS lock on `<path>.lock` for the block: one process at a time per `path`.
    The lock file is removed when the block ends (while still held, so a process that
    waited on it takes the lock of a fresh file): none is left behind.

    wait=True blocks until the holder finishes; wait=False refuses at once."""
    name = lock_path(path)
    name.parent.mkdir(parents=True, exist_ok=True)
    fd = lock_file(name, f"{what} {path}", wait)
    try:
        yield
    finally:
        if names(name, fd):
            name.unlink()
        os.close(fd)
