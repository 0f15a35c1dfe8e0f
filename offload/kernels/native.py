"""C kernels for the CPU, compiled once per machine and loaded with ctypes.

A kernel's C source is a `.c` file beside this module, shipped as package data
(`pyproject.toml`'s package-data) and read with `source`; `load_library` compiles it with the system's C compiler (`$CC`, else
`cc`, `gcc` or `clang`) at -O3 for this CPU (-march=native) with OpenMP, caches the
shared library under the cache directory (`$OFFLOAD_CACHE`, else
`$XDG_CACHE_HOME/offload`, else `~/.cache/offload`) keyed by the source, the compiler,
its flags and the CPU, and loads it. Without a compiler, or if the build fails (a
warning says why), it returns None and the caller runs its plain-torch path instead;
`OFFLOAD_NATIVE=0` asks for that path everywhere. `OFFLOAD_NATIVE_ARCH` names another
-march than this CPU's (the tests build an AVX2 library on an AVX-512 machine).

The library links the OpenMP runtime by its usual name (libgomp.so.1), the one torch
itself loads, so its threads are torch's: no second pool competes for the cores. A
build takes about 3.5 s (gcc 12, 2-core CI machine); concurrent builds each write their
own file and rename it into place.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.resources
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import xxhash

FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")

log = logging.getLogger(__name__)


def enabled() -> bool:
    """False where `OFFLOAD_NATIVE=0` asks for the plain-torch paths."""
    return os.environ.get("OFFLOAD_NATIVE", "1") != "0"


def _cache_dir() -> Path:
    base = os.environ.get("OFFLOAD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "offload"
    )
    return Path(base) / "native"


def _compiler() -> str | None:
    return os.environ.get("CC") or next(
        (found for name in ("cc", "gcc", "clang") if (found := shutil.which(name))), None
    )


def _cpu() -> str:
    """What -march=native compiles for: the machine and its CPU's feature flags."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {flags}"


def source(name: str) -> str:
    """The C source `name` shipped in this package (`offload/kernels/<name>`)."""
    return importlib.resources.files(__package__).joinpath(name).read_text()


@functools.cache
def load_library(name: str, source: str) -> ctypes.CDLL | None:
    """The compiled `source` (cached per machine), or None where it cannot be built."""
    compiler = _compiler()
    if compiler is None:
        return None
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    flags = (*FLAGS, f"-march={os.environ.get('OFFLOAD_NATIVE_ARCH', 'native')}")
    key = xxhash.xxh3_64(f"{source}\0{version}\0{flags}\0{_cpu()}".encode()).hexdigest()
    path = _cache_dir() / f"{name}-{key}.so"
    if not path.exists() and not _build(compiler, flags, source, path):
        return None
    return ctypes.CDLL(str(path))


def _build(compiler: str, flags: tuple[str, ...], source: str, path: Path) -> bool:
    path.parent.mkdir(parents=True, exist_ok=True)
    log.info("building %s for this CPU (once; cached in %s)", path.stem, path.parent)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        c_file, built = Path(scratch) / "kernel.c", Path(scratch) / path.name
        c_file.write_text(source)
        try:
            done = subprocess.run(
                [compiler, *flags, "-o", str(built), str(c_file)],
                capture_output=True,
                text=True,
                timeout=300,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            warnings.warn(
                f"{compiler} could not build {path.name} ({exc}); using torch", stacklevel=3
            )
            return False
        if done.returncode != 0:
            warnings.warn(
                f"{compiler} could not build {path.name}; using torch:\n{done.stderr[-2000:]}",
                stacklevel=3,
            )
            return False
        os.replace(built, path)
    return True
