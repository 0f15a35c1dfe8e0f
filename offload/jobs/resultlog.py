"""`ResultLog`: a job's durable output, `<output>.partial`, then `<output>` in input order.

The partial file's first line records the job's fingerprint; each later line is one
result, appended and fsynced block by block. Killed at any moment and started again,
the job skips what the partial file holds. The output path is locked (`<output>.lock`)
from the first check to the last write: a second run against the same output is
refused at once and never touches the first one's files.
"""

from __future__ import annotations

import array
import json
import logging
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from offload.core.errors import UserError
from offload.io.atomic import atomic_writer, exclusive

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
    """`<output>.partial`: a header with the job fingerprint, then one result a line."""

    def __init__(self, output: Path, fingerprint: dict[str, Any], restart: bool) -> None:
        self.output = output
        self.partial = output.with_name(output.name + ".partial")
        self.fingerprint = fingerprint
        self._done = bytearray()
        self.done_count = 0
        self.error_count = 0
        self._locks = ExitStack()
        self._locks.enter_context(exclusive(output, "--output", wait=False))
        try:
            self._open(restart)
        except BaseException:
            self._locks.close()
            raise

    def _open(self, restart: bool) -> None:
        if restart and self.partial.exists():
            self.partial.unlink()
        if self.partial.exists():
            self._load()
        else:
            self._write_header()
        self._file = self.partial.open("a", encoding="utf-8")

    def _write_header(self) -> None:
        with self.partial.open("w", encoding="utf-8") as f:
            f.write(json.dumps({"_job": self.fingerprint}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _load(self) -> None:
        with self.partial.open("rb") as f:
            data = f.read()
        lines = data.split(b"\n")
        torn = lines.pop()  # after the last newline: empty, or a line cut by a crash
        try:
            header = json.loads(lines[0])["_job"] if lines else None
        except (json.JSONDecodeError, KeyError, TypeError):
            header = None
        changed = _changed(header, self.fingerprint)
        if changed and len(lines) <= 1:  # the job wrote no result: nothing to keep
            log.info("%s held no results of an earlier job; starting over", self.partial)
            self._write_header()
            return
        if changed:
            raise UserError(
                f"{self.partial} belongs to a job with a different {', '.join(changed)}; "
                "run the same command as before to resume it, or add --restart to start over"
            )
        for line in lines[1:]:
            self._mark(json.loads(line))
        if torn:
            with self.partial.open("r+b") as f:
                f.truncate(len(data) - len(torn))
            log.info("dropped a partly written result line from the interrupted run")

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
        self._file.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
        self._file.flush()
        os.fsync(self._file.fileno())
        for row in rows:
            self._mark(row)

    def finalize(self, total: int) -> None:
        """Write the results in input order to the output file, atomically."""
        self._file.close()
        offsets = array.array("q", [-1]) * total
        with self.partial.open("rb") as f:
            f.readline()
            while True:
                pos = f.tell()
                line = f.readline()
                if not line:
                    break
                offsets[json.loads(line)["_index"]] = pos
        missing = offsets.count(-1)
        assert missing == 0, f"{missing} results missing at finalize"
        with self.partial.open("rb") as src, atomic_writer(self.output) as dst:
            for pos in offsets:
                src.seek(pos)
                row = json.loads(src.readline())
                del row["_index"]
                dst.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.partial.unlink()
        self.close()

    def close(self) -> None:
        if hasattr(self, "_file") and not self._file.closed:
            self._file.close()
        self._locks.close()
