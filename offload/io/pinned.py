"""A pinned host memory pool, sized once, with its own first-fit allocator.

One anonymous mapping (page-aligned, so blocks can take O_DIRECT reads) is pinned with
`cudaHostRegister` for exactly its size. PyTorch's pinned caching allocator rounds
every request up to a power of two (a 1.1 GiB tensor reserves 2 GiB; FlexGen lost a
third of host RAM that way); here the only waste is the alignment of each block to
4 KiB, which `stats()` reports. Without CUDA the pool is plain host memory, so CPU
tests run the same code.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import threading
from dataclasses import dataclass, field

import torch

from offload.core.errors import UserError
from offload.io.shared import SharedMemory

log = logging.getLogger(__name__)

ALIGN = 4096


def align_up(nbytes: int, alignment: int = ALIGN) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


class PoolExhausted(UserError):
    """The pool has no free block large enough."""


@dataclass(eq=False)
class PoolBlock:
    """A block of the pool: `tensor` is its uint8 view of `nbytes` (reserved: aligned size)."""

    pool: PinnedPool
    offset: int
    nbytes: int
    reserved: int
    tensor: torch.Tensor = field(repr=False)

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        count = 1
        for dim in shape:
            count *= dim
        nbytes = count * dtype.itemsize
        assert nbytes <= self.nbytes, f"view of {nbytes} B in a block of {self.nbytes} B"
        return self.tensor[:nbytes].view(dtype).view(shape)

    def free(self) -> None:
        self.pool.free(self)

    def __enter__(self) -> PoolBlock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()


class PinnedPool:
    """`capacity` bytes of (pinned, where CUDA exists) host memory. Close it when done.
    memory: the pool lives in this shared memory (`io.shared`: several processes of a node
    hold the same pages; each pins them in its own CUDA context), which it does not own."""

    def __init__(
        self, capacity: int, pin: bool | None = None, memory: SharedMemory | None = None
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"pool capacity must be positive, got {capacity}")
        self.capacity = align_up(capacity)
        self.shared = memory is not None
        if memory is not None:
            assert memory.nbytes >= self.capacity, "the shared memory holds the pool"
            self._map, self.buffer = memory.mapping, memory.buffer[: self.capacity]
        else:
            self._map = mmap.mmap(-1, self.capacity)
            self.buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        self.pinned = torch.cuda.is_available() if pin is None else pin
        if self.pinned:
            err = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.capacity, 0)
            if int(err) != 0:
                raise UserError(
                    f"cannot pin {self.capacity / 2**30:.1f} GiB of host memory (CUDA error "
                    f"{int(err)}); lower --cpu-mem or raise the locked-memory limit (ulimit -l)"
                )
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, self.capacity)]  # sorted (offset, size)
        self._requested = 0
        self._reserved = 0
        self._peak_reserved = 0
        self._closed = False

    # -- allocation -------------------------------------------------------------------
    def alloc(self, nbytes: int) -> PoolBlock:
        """A block of at least nbytes (4 KiB aligned); raises `PoolExhausted` at once if none."""
        assert nbytes > 0, nbytes
        reserved = align_up(nbytes)
        with self._lock:
            assert not self._closed, "pool is closed"
            for i, (offset, size) in enumerate(self._free):
                if size >= reserved:
                    if size == reserved:
                        del self._free[i]
                    else:
                        self._free[i] = (offset + reserved, size - reserved)
                    self._requested += nbytes
                    self._reserved += reserved
                    self._peak_reserved = max(self._peak_reserved, self._reserved)
                    view = self.buffer[offset : offset + nbytes]
                    return PoolBlock(self, offset, nbytes, reserved, view)
            largest = max((s for _, s in self._free), default=0)
        raise PoolExhausted(
            f"pinned pool exhausted: asked for {nbytes / 2**20:.1f} MiB, largest free block "
            f"{largest / 2**20:.1f} MiB of {self.capacity / 2**20:.1f} MiB; raise --cpu-mem "
            "or choose a policy that keeps less on the CPU"
        )

    def free(self, block: PoolBlock) -> None:
        with self._lock:
            start, end = block.offset, block.offset + block.reserved
            i = bisect.bisect_left(self._free, (start, 0))
            assert i == len(self._free) or self._free[i][0] >= end, "double free"
            assert i == 0 or sum(self._free[i - 1]) <= start, "double free"
            self._free.insert(i, (start, block.reserved))
            # coalesce with neighbours
            if i + 1 < len(self._free) and end == self._free[i + 1][0]:
                self._free[i] = (start, block.reserved + self._free[i + 1][1])
                del self._free[i + 1]
            if i > 0 and sum(self._free[i - 1]) == start:
                self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
                del self._free[i]
            self._requested -= block.nbytes
            self._reserved -= block.reserved

    # -- reporting and lifetime ---------------------------------------------------------
    def stats(self) -> dict[str, int | float]:
        with self._lock:
            return {
                "capacity_bytes": self.capacity,
                "requested_bytes": self._requested,
                "reserved_bytes": self._reserved,
                "peak_reserved_bytes": self._peak_reserved,
                "alignment_waste_bytes": self._reserved - self._requested,
                "free_blocks": len(self._free),
            }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
        del self.buffer
        if self.shared:  # its owner (`SharedMemory.close`) unmaps it
            return
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere; the OS frees it at exit
            log.debug("pinned pool mapping still referenced at close")

    def __enter__(self) -> PinnedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
