"""Spill space on the NVMe directory for KV cache and activations.

A `SpillFile` is a preallocated scratch file read and written with O_DIRECT at 4 KiB
aligned offsets and lengths, from and into pinned pool memory (same rules as the
weight store), in chunks with several requests in flight (as `io.reader` reads the
store: one request at a time leaves the drive idle between requests). It is deleted
on close; nothing in it outlives the run.
"""

from __future__ import annotations

import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from offload.core.errors import UserError
from offload.io.direct import open_direct
from offload.io.pinned import ALIGN, align_up

# requests in flight, and the most one request moves: a disk KV home of a few MB is
# read in one request. On the H100 machine's disk, beside a busy host thread, a 4.4 MB
# home took 2.3 ms in one request against 3.6 in 1 MiB requests (`scripts/lab/
# disk_pattern.py --busy-host`; docs/io.md); the weight store's reader moves 8 MiB too
THREADS = 8
CHUNK_BYTES = 8 * 2**20
# the GIL's switch interval while an executor runs (it sets it). Worker threads (KV
# stores into their homes, these disk reads and write-backs) need the GIL for a few
# short spans; at Python's default 5 ms each waited that long behind the launching host
# thread, and a few-KB store took 5-14 ms, holding back the next stores and loads (H100
# trace of a 4-layer BLOOM decode step)
SWITCH_INTERVAL_S = 0.00025


class SpillFile:
    def __init__(self, directory: Path, capacity: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"spill-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
        self.capacity = align_up(capacity)
        self.fd, _ = open_direct(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        self._pool = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="offload-spill")
        try:
            os.posix_fallocate(self.fd, 0, self.capacity)
        except OSError as exc:
            self.close()
            raise UserError(
                f"cannot reserve {self.capacity / 1e9:.1f} GB of spill space in {directory}: "
                f"{exc.strerror}; free space or lower the disk share of the policy"
            ) from None

    @staticmethod
    def _check(offset: int, buf: torch.Tensor) -> memoryview:
        assert buf.dtype == torch.uint8 and buf.is_contiguous(), "spill I/O takes uint8 buffers"
        assert offset % ALIGN == 0 and buf.numel() % ALIGN == 0, "spill I/O must be 4 KiB aligned"
        assert buf.data_ptr() % ALIGN == 0, "spill buffers must start 4 KiB aligned"
        return memoryview(buf.numpy())

    def write(self, offset: int, src: torch.Tensor) -> None:
        self.transfer([(offset, src)], write=True)

    def read(self, offset: int, dst: torch.Tensor) -> None:
        self.transfer([(offset, dst)], write=False)

    def transfer(self, pieces: list[tuple[int, torch.Tensor]], write: bool) -> None:
        """Write (or read) each (file offset, buffer) piece, all of them at once."""
        requests = []
        for offset, buf in pieces:
            view = self._check(offset, buf)
            assert offset + len(view) <= self.capacity, "I/O past the spill capacity"
            for start in range(0, len(view), CHUNK_BYTES):
                requests.append((offset + start, view[start : start + CHUNK_BYTES]))
        work = self._write_all if write else self._read_all
        # the calling thread does the last request itself: each request handed to the
        # pool and back needs the GIL twice, and beside a busy host thread each handoff
        # waits up to the switch interval (one 4.4 MB read in 5 pieces took 2.8 ms
        # against 1.6 beside a spinning Python thread, 2-core machine)
        futures = [self._pool.submit(work, *request) for request in requests[:-1]]
        if requests:
            work(*requests[-1])
        for future in futures:
            future.result()

    def _write_all(self, offset: int, view: memoryview) -> None:
        done = 0
        while done < len(view):
            done += os.pwritev(self.fd, [view[done:]], offset + done)

    def _read_all(self, offset: int, view: memoryview) -> None:
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            assert got > 0, f"short read from {self.path}"
            done += got

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> SpillFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
