"""The profile's disk figures: O_DIRECT sequential rates and the disk KV homes' reads
as the executor does them, beside a busy host thread."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from offload.io.direct import open_direct
from offload.io.pinned import PinnedPool
from offload.io.spill import SWITCH_INTERVAL_S, SpillFile
from offload.policies.hardware import GB
from offload.policies.timers import fit_call


def disk_rates(directory: Path, nbytes: int) -> tuple[float, float]:
    """O_DIRECT write and read of one file in `directory` (GB/s)."""
    import mmap

    directory.mkdir(parents=True, exist_ok=True)
    buf = mmap.mmap(-1, 16 * 2**20)
    buf.write(os.urandom(len(buf)))
    fd, name = tempfile.mkstemp(dir=directory, prefix="offload-profile-")
    os.close(fd)
    try:
        fd, _ = open_direct(name, os.O_WRONLY)
        started = time.perf_counter()
        for off in range(0, nbytes, len(buf)):
            os.pwritev(fd, [buf], off)
        os.fsync(fd)
        write = nbytes / (time.perf_counter() - started) / GB
        os.close(fd)
        fd, _ = open_direct(name, os.O_RDONLY)
        started = time.perf_counter()
        for off in range(0, nbytes, len(buf)):
            os.preadv(fd, [buf], off)
        read = nbytes / (time.perf_counter() - started) / GB
        os.close(fd)
    finally:
        os.unlink(name)
    return read, write


def _spin(spinning: threading.Event) -> None:
    count = 0
    while spinning.is_set():
        count += 1


@contextlib.contextmanager
def beside_busy_host() -> Iterator[None]:
    """While the body runs, a Python thread holds the GIL as the executor's launching
    host thread does, at the executor's switch interval."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    spinning = threading.Event()
    spinning.set()
    thread = threading.Thread(target=_spin, args=(spinning,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        spinning.clear()
        thread.join()
        sys.setswitchinterval(previous)


def kv_disk_read_rate(directory: Path, homes: int = 8) -> float:
    """GB/s of disk KV home reads as the executor does them: `SpillFile.transfer` of one
    whole home after another, beside a busy host thread (`beside_busy_host`). The slope
    between 4 MiB and 32 MiB homes: a read's fixed part belongs to the profile's
    `disk_kv_s`, measured on the executor's own chain."""
    small, large = 4 * 2**20, 32 * 2**20
    with PinnedPool(large) as pool, SpillFile(directory, large * homes) as spill:
        buf = pool.alloc(large).tensor
        spill.transfer([(i * large, buf) for i in range(homes)], write=True)
        points = []
        with beside_busy_host():
            for size in (small, large):
                started = time.perf_counter()
                for i in range(homes):
                    spill.transfer([(i * large, buf[:size])], write=False)
                points.append((size * homes, time.perf_counter() - started))
    return fit_call(*points)[0]
