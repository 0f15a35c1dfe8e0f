"""Spill space on the NVMe directory for KV cache and activations.

A `SpillFile` is a preallocated scratch file read and written with O_DIRECT at 4 KiB
aligned offsets and lengths, from and into pinned pool memory (same rules as the
weight store). It is deleted on close; nothing in it outlives the run.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import torch

from offload.errors import UserError
from offload.io.direct import open_direct
from offload.io.pinned import ALIGN, align_up


class SpillFile:
    def __init__(self, directory: Path, capacity: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"spill-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
        self.capacity = align_up(capacity)
        self.fd, _ = open_direct(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL)
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
        view = self._check(offset, src)
        assert offset + len(view) <= self.capacity, "write past the spill capacity"
        done = 0
        while done < len(view):
            done += os.pwritev(self.fd, [view[done:]], offset + done)

    def read(self, offset: int, dst: torch.Tensor) -> None:
        view = self._check(offset, dst)
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            assert got > 0, f"short read from {self.path}"
            done += got

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> SpillFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
