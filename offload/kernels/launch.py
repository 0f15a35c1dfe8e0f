"""Launching a Triton kernel without Triton's per-call argument binding.

Triton's own launch path binds every argument, works out its specialization and
looks the compiled kernel up on every call: 39.1 us of host time a launch on an H100
machine's host, against 10.6 us for calling the compiled kernel's launcher directly
(`scripts/bench_kernels.py --kernels launch`, both in one run; this key costs about
6 us more). Eager decode steps launch a few hundred kernels, and there the host
thread, not the GPU, sets the step's time.

`Launcher` keeps the compiled kernel per kind of call and calls its launcher. The key
is at least as fine as Triton's own specialization: every tensor's dtype and 16-byte
alignment, every integer's being 1, a multiple of 16 and wider than 32 bits, and
every constexpr's value. A call of a new kind goes through Triton's path once (which
compiles or finds the kernel) and is remembered. Under the interpreter, or while a
Triton launch hook is installed (profilers), every call takes Triton's own path.

`use_kernel` says where the kernels run at all: on CUDA tensors, or anywhere under
TRITON_INTERPRET=1; elsewhere each op runs its plain-torch path.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    from triton import knobs
    from triton.runtime import driver
except ImportError:  # CPU-only installs never launch
    triton = None

# Triton reads TRITON_INTERPRET when it is imported; so do we (not on every launch)
INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"


def use_kernel(x: torch.Tensor) -> bool:
    """The Triton kernels run on CUDA tensors, or anywhere under TRITON_INTERPRET=1."""
    return triton is not None and (x.is_cuda or INTERPRETED)


def _kind(arg, specialized: bool = True) -> object:
    """What Triton specializes an argument on; specialized=False: an integer marked
    do_not_specialize (only its width)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if hasattr(arg, "block_shape"):  # a TMA descriptor: its tile's shape and dtype
        return tuple(arg.block_shape), arg.base.dtype, arg.layout
    if isinstance(arg, bool) or not isinstance(arg, int):
        return arg  # constexprs (bool, str) and floats (never specialized)
    wide = not -(2**31) <= arg < 2**31
    return (arg == 1, arg % 16 == 0, wide) if specialized else wide


class Launcher:
    """launcher(grid, warps, *args, registers=None): args in the kernel's signature order,
    constexprs included (positionally); registers caps a thread's registers (ptxas's
    maxrregcount: more programs an SM, at the risk of spills). pdl: launched as the
    programmatic dependent of the kernel before it in the stream (CUDA's programmatic
    dependent launch, sm_90 on): it may start before that kernel ends, and must wait for
    it (griddepcontrol.wait) before reading what it writes."""

    def __init__(self, kernel, pdl: bool = False) -> None:
        self.kernel = kernel
        self.pdl = pdl
        # (the interpreter's kernels have no params: every call takes Triton's path)
        params = getattr(kernel, "params", [])
        self.constexpr = [p.is_constexpr for p in params]
        self.specialized = [not p.do_not_specialize for p in params]
        self.compiled: dict[tuple, object] = {}

    def __call__(
        self, grid: tuple[int, ...], warps: int, *args, registers: int | None = None
    ) -> None:
        if INTERPRETED or hooks_installed():
            self.kernel[grid](*args, **_options(warps, registers, self.pdl))
            return
        device = driver.active.get_current_device()
        kinds = (
            a if const else _kind(a, spec)
            for a, const, spec in zip(args, self.constexpr, self.specialized, strict=True)
        )
        key = (device, warps, registers, *kinds)
        compiled = self.compiled.get(key)
        if compiled is None:
            self.compiled[key] = self.kernel[grid](*args, **_options(warps, registers, self.pdl))
            return
        grid = (*grid, 1, 1)
        stream = driver.active.get_current_stream(device)
        compiled.run(
            grid[0],
            grid[1],
            grid[2],
            stream,
            compiled.function,
            compiled.packed_metadata,
            None,  # launch metadata: only for launch hooks, which take Triton's path
            None,
            None,
            *args,
        )


class CompileCount:
    """Counts Triton's compiles in this process while it is entered (each new
    specialization of a kernel: a compile, or a load from Triton's disk cache; about a
    second each where nothing is cached). `names` lists the kernels in order."""

    def __enter__(self) -> CompileCount:
        self.names: list[str] = []
        self._before = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = self._compiled
        return self

    def _compiled(self, *, fn, **_) -> None:
        self.names.append(fn.name)

    def __exit__(self, *exc: object) -> None:
        knobs.runtime.jit_post_compile_hook = self._before


def hooks_installed() -> bool:
    """Whether a Triton launch hook is installed (a profiler's), which only Triton's own
    launch path calls. The Tritons the project allows (3.6+) keep the hooks in a chain
    that is never None (so a test of `is not None` would send every launch down
    Triton's path: the W1c decode step's host time 13.7 ms, H100)."""
    return bool(knobs.runtime.launch_enter_hook.calls)


def _options(warps: int, registers: int | None, pdl: bool = False) -> dict:
    """Triton's launch options: the warps, ptxas's register cap where one is set,
    programmatic dependent launch where asked, and floating-point contraction (a x b + c
    as one fused multiply-add) on, as every kernel here was measured and tested with.
    Triton 3.6 and 3.9 default to it, and 3.9 warns on each process's first compile that
    3.10 will not."""
    options = {"num_warps": warps, "enable_fp_fusion": True}
    if registers is not None:
        options["maxnreg"] = registers
    if pdl:
        options["launch_pdl"] = True
    return options


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's multiprocessors (1 off CUDA: the interpreter)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def shared_memory_limit(device: torch.device) -> int | None:
    """The most shared memory a program may use on the device (None off CUDA)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _shared_memory_limit(index)


@functools.cache
def _shared_memory_limit(index: int) -> int | None:
    props = torch.cuda.get_device_properties(index)
    return getattr(props, "shared_memory_per_block_optin", None)


# Arrival counters of kernels whose last program of a group (a split-K tile, a decode
# attention row's splits) finishes the group's work: one int32 a group, which that
# program sets back to 0. One buffer per kernel kind and stream: kernels on one stream
# never overlap.
_COUNTERS: dict[tuple, torch.Tensor] = {}


def split_of(wanted: int, steps: int) -> int:
    """The programs split-K divides K among: the most up to wanted that divides the K
    steps evenly (at least 1)."""
    return max(d for d in range(1, min(wanted, steps) + 1) if steps % d == 0)


def arrival_counters(kind: str, device: torch.device, count: int) -> torch.Tensor:
    """At least `count` zeroed counters for kernels of `kind` on the current stream."""
    # (the raw stream handle: torch.cuda.current_stream builds a Stream object, 5-25 us)
    stream = 0
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        stream = driver.active.get_current_stream(index)
    counts = _COUNTERS.get((kind, device, stream))
    if counts is None or counts.numel() < count:
        counts = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _COUNTERS[(kind, device, stream)] = counts
    return counts
