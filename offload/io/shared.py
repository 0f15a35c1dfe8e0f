"""Host memory shared by the processes of one node: one copy of the weights for all the
data-parallel groups on it.

The first process makes an anonymous memory file (`memfd_create`: shared memory that no
/dev/shm size limit caps) and names it by its process id and descriptor; the others open
it through /proc/<pid>/fd/<fd>, so every process maps the same pages. Each process pins
the mapping in its own CUDA context (`io.pinned.PinnedPool`), so each GPU's copies read
those pages directly.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass

import torch

from offload.core.errors import UserError


@dataclass(frozen=True)
class SharedHandle:
    """How another process of this node opens a shared memory file."""

    pid: int
    fd: int
    nbytes: int


class SharedMemory:
    """`nbytes` of host memory mapped shared (`buffer`: its uint8 view). Close when done;
    the pages live until the last process that maps them closes them."""

    def __init__(self, fd: int, nbytes: int, handle: SharedHandle) -> None:
        self.fd, self.nbytes, self.handle = fd, nbytes, handle
        self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        self.buffer = torch.frombuffer(self._map, dtype=torch.uint8)

    @classmethod
    def create(cls, nbytes: int, name: str = "offload-weights") -> SharedMemory:
        fd = os.memfd_create(name, 0)
        os.ftruncate(fd, nbytes)
        return cls(fd, nbytes, SharedHandle(os.getpid(), fd, nbytes))

    @classmethod
    def attach(cls, handle: SharedHandle) -> SharedMemory:
        """The memory another process of this node made (`create`)."""
        path = f"/proc/{handle.pid}/fd/{handle.fd}"
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise UserError(f"cannot open the shared weights at {path} ({exc})") from exc
        if os.fstat(fd).st_size != handle.nbytes:
            os.close(fd)
            raise UserError(f"the shared weights at {path} are not {handle.nbytes} bytes")
        return cls(fd, handle.nbytes, handle)

    @property
    def mapping(self) -> mmap.mmap:
        return self._map

    def close(self) -> None:
        """Drop this process's view (its pool has released the buffer) and descriptor."""
        if self.fd < 0:
            return
        del self.buffer
        with contextlib.suppress(BufferError):  # a view still alive: freed at exit
            self._map.close()
        os.close(self.fd)
        self.fd = -1
