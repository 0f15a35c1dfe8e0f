"""`HardwareProfile`: this machine's measured figures, cached per machine.

Every rate the cost model uses comes from here, measured by `offload-profile` (or read
from a profile file of another machine with `--profile`); none is a constant in code.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F

from offload.errors import UserError
from offload.io.atomic import atomic_write
from offload.io.direct import open_direct
from offload.kernels.formats import Compression
from offload.kernels.kv_attention_cpu import decode_attention_cpu
from offload.kernels.kv_cache import QuantKV
from offload.models.demo import cache_dir
from offload.policies.memory_limit import node_memory_limit

GB = 1e9


@dataclass(frozen=True)
class HardwareProfile:
    device_name: str
    has_gpu: bool
    gpu_mem_bytes: int
    cpu_mem_bytes: int
    h2d_gbps: float
    d2h_gbps: float
    bidir_gbps: float
    pageable_h2d_gbps: float
    disk_read_gbps: float
    disk_write_gbps: float
    prefill_tflops: float
    decode_tflops: float
    hbm_gbps: float
    cpu_attention_gbps: float
    # the same over a compressed (int4-g64) cache, counting its K/V at the compute dtype
    cpu_quant_attention_gbps: float
    dram_gbps: float
    gpu_context_bytes: int = 0  # CUDA context and library workspaces, measured
    process_base_bytes: int = 0  # host RSS of a loaded engine before any weights
    measured_at: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not value > 0:
                raise ValueError(f"hardware profile figure {f.name}={value} must be positive")

    @property
    def default_cpu_cap(self) -> int:
        """The CPU budget when the user gives none: the OS, the page cache and other
        processes keep a tenth of the machine's memory."""
        return int(0.9 * self.cpu_mem_bytes)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_file(cls, path: Path) -> HardwareProfile:
        try:
            return cls(**json.loads(path.read_text()))
        except FileNotFoundError:
            raise UserError(
                f"hardware profile {path} does not exist; run offload-profile"
            ) from None
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            raise UserError(
                f"hardware profile {path} is not valid ({exc}); run offload-profile again"
            ) from None


def profile_path() -> Path:
    return cache_dir() / f"hardware-{platform.node() or 'machine'}.json"


def save_profile(hw: HardwareProfile, path: Path | None = None) -> Path:
    """Write the profile atomically (a concurrent reader never sees half a file)."""
    path = path or profile_path()
    atomic_write(path, hw.to_json())
    return path


def load_profile(path: Path | None = None) -> HardwareProfile | None:
    path = path or profile_path()
    return HardwareProfile.from_file(path) if path.is_file() else None


# -- measurements ---------------------------------------------------------------------
def _timed(fn, repeat: int = 5) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeat


def _copy_rate(src: torch.Tensor, dst: torch.Tensor) -> float:
    return src.numel() * src.element_size() / _timed(lambda: dst.copy_(src, non_blocking=True)) / GB


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


def _cpu_attention_rate(
    dtype: torch.dtype,
    host: torch.Tensor | None = None,
    gpu=None,
    h2d_gbps: float = 0.0,
    compressed: bool = False,
) -> float:
    """GB/s of KV that the executor's CPU attention (torch SDPA) reads at a decode shape;
    `compressed`: its attention over an int4-g64 cache (`kv_attention_cpu.decode_attention_cpu`),
    counting the K/V it attends at the dtype's size.

    Given a pinned `host` buffer, a `gpu` one and their measured copy rate, host -> GPU
    copies run all the while,
    as the executor's weight stream does during its CPU attention: both read DRAM, and
    the contended rate is the one the executor gets (OPT-30B on the H100 machine: 67
    GB/s alone, 47-50 inside the executor)."""
    rows, heads, slots, dim = 16, 32, 1024, 128
    k = torch.randn(rows, heads, slots, dim).to(dtype)
    v = torch.randn_like(k)
    q = torch.randn(rows, heads, 1, dim).to(dtype)
    bias = torch.zeros(rows, 1, 1, slots, dtype=dtype)
    attention = functools.partial(F.scaled_dot_product_attention, q, k, v, attn_mask=bias)
    if compressed:
        cache = QuantKV(rows, heads, dim, slots, Compression(4, 64), dtype, torch.device("cpu"))
        cache.write(k, v, 0)
        attention = functools.partial(decode_attention_cpu, q, cache, bias, slots)
    attention()  # warm up
    if host is not None:
        # queue enough copies to outlast the timing; no host thread waits on them (a
        # spinning waiter would take a core from SDPA's threads, which the executor's
        # copies never do)
        side = torch.cuda.Stream()
        expected = 3 * 2 * k.numel() * k.element_size() / (20 * GB)  # >= SDPA's time
        with torch.cuda.stream(side):
            for _ in range(int(expected * h2d_gbps * GB / host.numel()) + 2):
                gpu.copy_(host, non_blocking=True)
    started = time.perf_counter()
    for _ in range(3):  # the CPU attention never touches the device: timed directly
        attention()
    seconds = time.perf_counter() - started
    if host is not None:
        side.synchronize()
    return 3 * 2 * k.numel() * k.element_size() / seconds / GB


def _matmul_tflops(m: int, k: int, n: int, device: torch.device, dtype: torch.dtype) -> float:
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    return 2 * m * k * n / _timed(lambda: a @ b, repeat=3) / 1e12


def measure(nvme: Path | None, quick: bool = False) -> HardwareProfile:
    """Measure this machine. Without CUDA the compute device is the CPU: host copies
    stand in for PCIe and the CPU's matmul rate for the GPU's."""
    size = 2**26 if quick else 2**29
    disk_dir = nvme or Path(tempfile.gettempdir())
    disk_read, disk_write = disk_rates(disk_dir, min(size * 2, 2**30))
    dram = (
        _copy_rate(torch.empty(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)) * 2
    )
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        host2 = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        gpu = torch.empty(size, dtype=torch.uint8, device=dev)
        gpu2 = torch.empty(size, dtype=torch.uint8, device=dev)
        h2d, d2h = _copy_rate(host, gpu), _copy_rate(gpu, host)
        cpu_attn = _cpu_attention_rate(torch.float16, host, gpu, h2d)
        cpu_quant_attn = _cpu_attention_rate(torch.float16, host, gpu, h2d, compressed=True)
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

        def both() -> None:
            with torch.cuda.stream(s1):
                gpu.copy_(host, non_blocking=True)
            with torch.cuda.stream(s2):
                host2.copy_(gpu2, non_blocking=True)

        bidir = 2 * size / _timed(both) / GB
        pageable = _copy_rate(torch.empty(size, dtype=torch.uint8), gpu)
        hbm = 2 * _copy_rate(gpu, gpu2)
        prefill = _matmul_tflops(4096, 8192, 8192, dev, torch.float16)
        decode = _matmul_tflops(64, 8192, 28672, dev, torch.float16)
        gpu_mem, name = (
            torch.cuda.get_device_properties(dev).total_memory,
            torch.cuda.get_device_name(),
        )
        del host, host2, gpu, gpu2
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        context = total - free - torch.cuda.memory_reserved(dev)
    else:
        h2d = d2h = bidir = pageable = hbm = dram / 2
        cpu_attn = _cpu_attention_rate(torch.float32)
        cpu_quant_attn = _cpu_attention_rate(torch.float32, compressed=True)
        prefill = decode = _matmul_tflops(1024, 2048, 2048, torch.device("cpu"), torch.float32)
        gpu_mem, name = psutil.virtual_memory().total, f"CPU only ({platform.processor() or 'cpu'})"
        context = 0
    return HardwareProfile(
        device_name=name,
        has_gpu=torch.cuda.is_available(),
        gpu_mem_bytes=gpu_mem,
        cpu_mem_bytes=node_memory_limit()[0],  # the cgroup's limit where there is one
        h2d_gbps=h2d,
        d2h_gbps=d2h,
        bidir_gbps=bidir,
        pageable_h2d_gbps=pageable,
        disk_read_gbps=disk_read,
        disk_write_gbps=disk_write,
        prefill_tflops=prefill,
        decode_tflops=decode,
        hbm_gbps=hbm,
        cpu_attention_gbps=cpu_attn,
        cpu_quant_attention_gbps=cpu_quant_attn,
        dram_gbps=dram,
        gpu_context_bytes=int(context),
        process_base_bytes=psutil.Process().memory_info().rss,
        measured_at=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
