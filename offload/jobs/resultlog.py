"""`ResultLog`: a job's durable output, `<output>.partial`, then `<output>` in input order.

The partial file's first line records the job's fingerprint; each later line is one
result, appended and fsynced block by block. Killed at any moment and started again,
the job skips what the partial file holds.

The run holds the partial file by its open descriptor from the first check to the last
write, with an OS lock on that open file (`io.atomic.lock_file`): a second run against
the same output is refused at once, and no lock file is left behind. Before each block
it checks that the name still names its file: deleted or moved away, the file is put
back from the descriptor and the run goes on; replaced by another file, or changed in
place, the run stops at once and says so, with its results kept. The final output is
written from the descriptor, so nothing done before is lost.

A damaged line (a bad line ending in a newline, a blank line) is named by its number
when the job resumes: the results before it are kept, it and the lines after it are
dropped and generated again. A damaged first line (the job's settings) cannot be
matched to any job; the run refuses it and names it, unless no result follows.
"""

from __future__ import annotations

import array
import json
import logging
import os
from pathlib import Path
from typing import Any

from offload.core.errors import UserError
from offload.io.atomic import (
    NO_SPACE,
    atomic_writer,
    disk_full,
    fsync_dir,
    lock_file,
    names,
    write_all,
)

log = logging.getLogger(__name__)


def is_error(row: dict[str, Any]) -> bool:
    """A failed request's result line, in either output format."""
    return row.get("finish_reason") == "error" or bool(row.get("error"))


class MemorySink:
    """Results of a job that is not written to a file (printed at the end)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.done_count = 0
        self.error_count = 0

    def done(self, index: int) -> bool:
        return False

    def append(self, rows: list[dict[str, Any]]) -> None:
        self.rows += rows
        self.error_count += sum(is_error(row) for row in rows)

    def sorted_rows(self) -> list[dict[str, Any]]:
        rows = sorted(self.rows, key=lambda r: r["_index"])
        return [{k: v for k, v in row.items() if k != "_index"} for row in rows]


def _changed(header: Any, fingerprint: dict[str, Any]) -> list[str]:
    """The settings of a job's header that differ from this run's, as a message names
    them (with both values where they are short). A setting the header lacks was added
    to the fingerprint after that job began, and is not compared."""
    if not isinstance(header, dict):
        return ["header"]
    changed = []
    for key, now in fingerprint.items():
        if key not in header or header[key] == now:
            continue
        was = header[key]
        short = all(isinstance(v, (str, int, float, bool, type(None))) for v in (was, now))
        if short and len(repr(was)) + len(repr(now)) < 60:
            changed.append(f"{key} ({was!r} then, {now!r} now)")
        else:
            changed.append(key)
    return sorted(changed)


class ResultLog:
    """`<output>.partial`: a header with the job fingerprint, then one result a line.

    total: the job's request count, where known: a line naming another index is damaged."""

    def __init__(
        self, output: Path, fingerprint: dict[str, Any], restart: bool, total: int | None = None
    ) -> None:
        self.output = output
        self.partial = output.with_name(output.name + ".partial")
        self.fingerprint = fingerprint
        self.total = total
        self._done = bytearray()
        self.done_count = 0
        self.error_count = 0
        self._fd = lock_file(self.partial, f"--output {output}", wait=False, flags=_FLAGS)
        self._size = 0  # the bytes of the file this run wrote or kept
        try:
            self._open(restart)
        except BaseException:
            self._discard_if_empty()
            self.close()
            raise

    def _open(self, restart: bool) -> None:
        if restart:
            os.ftruncate(self._fd, 0)
        data = _read_all(self._fd)
        if not data and not restart and self.output.is_file():
            # a run finished this job between our check of the output and our lock
            raise UserError(
                f"--output {self.output} already holds a finished job's results; add --restart "
                "to run the job again and replace them, or give another --output"
            )
        if data:
            self._load(data)
        else:
            self._write_header()

    def _write_header(self) -> None:
        os.ftruncate(self._fd, 0)
        self._size = 0
        self._write((json.dumps({"_job": self.fingerprint}) + "\n").encode())

    def _load(self, data: bytes) -> None:
        lines = data.split(b"\n")
        torn = lines.pop()  # after the last newline: empty, or a line cut by a crash
        try:
            header = json.loads(lines[0])["_job"] if lines else None
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            header = None
        if len(lines) <= 1:  # the job wrote no result: nothing to keep
            log.info("%s held no results of an earlier job; starting over", self.partial)
            self._write_header()
            return
        if not isinstance(header, dict):
            raise UserError(
                f"{self.partial} line 1 (the job's settings) is damaged, so its "
                f"{len(lines) - 1} result line(s) cannot be matched to this job; add --restart "
                "to start over (they are dropped), or give another --output"
            )
        changed = _changed(header, self.fingerprint)
        if changed:
            raise UserError(
                f"{self.partial} belongs to a job with a different {', '.join(changed)}; "
                "run the same command as before to resume it, or add --restart to start over"
            )
        self._size = len(lines[0]) + 1
        for lineno, line in enumerate(lines[1:], 2):
            row, problem = self._row(line)
            if row is None:
                log.warning(
                    "%s line %d is damaged (%s): kept the %d results before it; it and the %d "
                    "line(s) after it are dropped and generated again",
                    self.partial, lineno, problem, self.done_count, len(lines) - lineno,
                )  # fmt: skip
                break
            self._mark(row)
            self._size += len(line) + 1
        if self._size < len(data):
            os.ftruncate(self._fd, self._size)
            if torn and self._size == len(data) - len(torn):
                log.info("dropped a partly written result line from the interrupted run")

    def _row(self, line: bytes) -> tuple[dict[str, Any] | None, str]:
        """A result line's row, or None and why the line is damaged."""
        if not line.strip():
            return None, "blank"
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None, "not JSON"
        index = row.get("_index") if isinstance(row, dict) else None
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            return None, "no result index"
        if self.total is not None and index >= self.total:
            return None, f"index {index} past the job's {self.total} requests"
        return row, ""

    def _mark(self, row: dict[str, Any]) -> None:
        index = row["_index"]
        if index >= len(self._done):
            self._done.extend(bytes(index + 1 - len(self._done) + 1024))
        if not self._done[index]:
            self._done[index] = 1
            self.done_count += 1
            self.error_count += is_error(row)

    def done(self, index: int) -> bool:
        return index < len(self._done) and bool(self._done[index])

    def append(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            return
        self._check_still_ours()
        data = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode()
        try:
            self._write(data)
        except OSError as exc:
            if exc.errno not in NO_SPACE:
                raise
            # the rest of the results and the final copy of them all, at this block's
            # bytes a result (this block and a copy of what is written, job size unknown)
            per_row = len(data) // len(rows)
            if self.total is None:
                need = len(data) + self._size + len(data)
            else:
                need = per_row * (self.total - self.done_count) + per_row * self.total
            raise disk_full(
                self.partial,
                need,
                f"free space there (or give --output on another drive) and run the same "
                f"command again: the {self.done_count} results written are kept",
            ) from None
        for row in rows:
            self._mark(row)

    def _write(self, data: bytes) -> None:
        """Append `data` and sync it; on failure the file is cut back to its last whole
        line, so it never holds a torn block."""
        try:
            write_all(self._fd, data)
            os.fsync(self._fd)
        except OSError:
            os.ftruncate(self._fd, self._size)
            raise
        self._size += len(data)

    def _check_still_ours(self) -> None:
        """The name still names this run's file, holding what this run wrote: deleted or
        moved away, the file is put back; replaced or changed, the run stops."""
        mine = os.fstat(self._fd)
        if mine.st_size != self._size:
            raise UserError(
                f"{self.partial} was changed by another program during the run (it holds "
                f"{mine.st_size} bytes, this run wrote {self._size}); stopped. Run the same "
                "command again to resume from the results it still holds"
            )
        try:
            there = os.stat(self.partial)
        except FileNotFoundError:
            self._put_back()
            return
        if not os.path.samestat(there, mine):
            kept = self.partial.with_name(f"{self.partial.name}.{os.getpid()}")
            self._copy_to(kept)
            raise UserError(
                f"{self.partial} was replaced by another file during the run; stopped, with "
                f"this run's {self.done_count} results kept in {kept}: move it to "
                f"{self.partial} and run the same command again to resume from them"
            )

    def _put_back(self) -> None:
        """The partial file's name was deleted (or moved away) during the run: write what
        this run holds under it again, locked, and go on with that file."""
        tmp = self.partial.with_name(f".{self.partial.name}.{os.getpid()}.tmp")
        fd = self._copy_to(tmp)
        try:
            os.link(tmp, self.partial)  # never over a file that appeared meanwhile
        except FileExistsError:
            os.close(fd)
            tmp.unlink()
            self._check_still_ours()  # replaced meanwhile: stops
            return
        tmp.unlink()
        fsync_dir(self.partial.parent)
        os.close(self._fd)
        self._fd = fd
        log.warning(
            "%s was deleted during the run; written again from the open file with its %d "
            "results (nothing lost)",
            self.partial,
            self.done_count,
        )

    def _copy_to(self, path: Path) -> int:
        """A locked copy of what this run's file holds, at `path`; its descriptor."""
        fd = lock_file(path, str(path), wait=False, flags=_FLAGS)
        try:
            os.ftruncate(fd, 0)
            offset = 0
            while chunk := os.pread(self._fd, 1 << 24, offset):
                offset += len(chunk)
                write_all(fd, chunk)
            os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            if exc.errno in NO_SPACE:
                raise disk_full(path, self._size, "free space there") from None
            raise
        return fd

    def finalize(self, total: int) -> None:
        """Write the results in input order to the output file, atomically, from the open
        partial file; then remove it."""
        self._check_still_ours()
        offsets = array.array("q", [-1]) * total
        with os.fdopen(os.dup(self._fd), "rb") as f:
            f.seek(0)
            f.readline()
            while True:
                pos = f.tell()
                line = f.readline()
                if not line:
                    break
                offsets[json.loads(line)["_index"]] = pos
            missing = offsets.count(-1)
            assert missing == 0, f"{missing} results missing at finalize"
            try:
                with atomic_writer(self.output) as dst:
                    for pos in offsets:
                        f.seek(pos)
                        row = json.loads(f.readline())
                        del row["_index"]
                        dst.write(json.dumps(row, ensure_ascii=False) + "\n")
            except OSError as exc:
                if exc.errno not in NO_SPACE:
                    raise
                raise disk_full(
                    self.output,
                    self._size,
                    f"free space there and run the same command again: the results are kept "
                    f"in {self.partial} and written out then",
                ) from None
        if names(self.partial, self._fd):
            self.partial.unlink()
        self.close()

    def _discard_if_empty(self) -> None:
        """A partial file this run created and refused before writing: not left behind."""
        if self._fd >= 0 and os.fstat(self._fd).st_size == 0 and names(self.partial, self._fd):
            self.partial.unlink()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# the partial file: read and appended to (every write lands at its end)
_FLAGS = os.O_RDWR | os.O_APPEND


def _read_all(fd: int) -> bytes:
    """The whole of an open file, from its start."""
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 24, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)
