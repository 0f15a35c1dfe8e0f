"""I/O benchmark: raw ceilings and our store, side by side, on one machine.

    python scripts/bench_io.py --nvme /path/on/nvme [--model opt-6.7b] [--read-gb 6]

Measures, in one run: the raw O_DIRECT disk read ceiling (dd), the pinned host -> GPU
peak (torch), then our path: disk -> pinned (ExtentReader, several thread counts,
checksums on and off), pinned pool -> GPU, and disk -> GPU pipelined. For the mechanism
choice it also times buffered reads through the same thread pool (page cache dropped),
aiofiles, and kvikio (POSIX mode) when importable. Writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from offload.io.pinned import PinnedPool, align_up
from offload.io.reader import ExtentReader
from offload.io.store import ensure_store
from offload.io.store_format import WeightStore
from offload.models.resolve import resolve_model
from offload.models.weights import WeightSource

GB = 1e9


class DeviceDummy(WeightSource):
    """Dummy weights made on the GPU (fast), handed to the store writer."""

    def __init__(self, inner: WeightSource, device: torch.device) -> None:
        self.inner, self.config, self.device = inner, inner.config, device

    def stage(self, stage, index, dtype, device):
        return {k: v.cpu() for k, v in self.inner.stage(stage, index, dtype, self.device).items()}


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def dd_ceiling(path: Path, nbytes: int) -> float:
    count = nbytes // (16 * 2**20)
    started = time.perf_counter()
    subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", "bs=16M", f"count={count}", "iflag=direct"],
        check=True,
        capture_output=True,
    )
    return count * 16 * 2**20 / (time.perf_counter() - started) / GB


def parallel_dd(paths: list[Path], jobs: int) -> float:
    started = time.perf_counter()
    procs = [
        subprocess.Popen(
            ["dd", f"if={p}", "of=/dev/null", "bs=16M", "iflag=direct"], stderr=subprocess.DEVNULL
        )
        for p in paths[:jobs]
    ]
    for proc in procs:
        proc.wait()
    total = sum(p.stat().st_size for p in paths[:jobs])
    return total / (time.perf_counter() - started) / GB


def pinned_h2d_peak(nbytes: int = 2**30) -> dict[str, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    out = {}
    for name, src, dst in (("h2d", host, dev), ("d2h", dev, host), ("pageable_h2d", pageable, dev)):
        for _ in range(2):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[name] = 5 * nbytes / (time.perf_counter() - started) / GB
    return out


def extents_of(store: WeightStore, keys: list[str]):
    return [e for key in keys for e in store.extents(key)]


def ours_disk_to_pinned(store, keys, threads, verify, pool) -> float:
    extents = extents_of(store, keys)
    with ExtentReader(threads=threads, verify=verify) as reader:
        started = time.perf_counter()
        inflight = collections.deque()
        for extent in extents:
            while True:
                try:
                    block = pool.alloc(extent.padded)
                    break
                except Exception:
                    fut, blk = inflight.popleft()
                    fut.result()
                    blk.free()
            inflight.append((reader.submit(extent, block), block))
        for fut, blk in inflight:
            fut.result()
            blk.free()
    return sum(e.padded for e in extents) / (time.perf_counter() - started) / GB


def buffered_pool(paths: list[Path], threads: int, chunk: int = 8 * 2**20) -> float:
    jobs = [(p, off) for p in paths for off in range(0, p.stat().st_size, chunk)]
    bufs = [bytearray(chunk) for _ in range(threads)]

    def read(i_job):
        i, (path, off) = i_job
        with open(path, "rb", buffering=0) as f:
            return os.preadv(f.fileno(), [bufs[i % threads]], off)

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        total = sum(ex.map(read, enumerate(jobs)))
    return total / (time.perf_counter() - started) / GB


def aiofiles_read(paths: list[Path], concurrency: int, chunk: int = 8 * 2**20) -> float | None:
    try:
        import aiofiles
    except ImportError:
        return None

    async def run() -> int:
        sem = asyncio.Semaphore(concurrency)

        async def one(path, off):
            async with sem, aiofiles.open(path, "rb") as f:
                await f.seek(off)
                return len(await f.read(chunk))

        tasks = [one(p, off) for p in paths for off in range(0, p.stat().st_size, chunk)]
        return sum(await asyncio.gather(*tasks))

    started = time.perf_counter()
    total = asyncio.run(run())
    return total / (time.perf_counter() - started) / GB


def kvikio_read(paths: list[Path]) -> dict[str, float] | None:
    try:
        import cupy
        import kvikio
        import kvikio.defaults
    except ImportError as exc:
        return {"error": f"import failed: {exc}"}
    get = getattr(kvikio.defaults, "get", None)
    mode = get("compat_mode") if get else kvikio.defaults.compat_mode()
    out = {"compat_mode": str(mode)}
    total = sum(p.stat().st_size for p in paths)
    biggest = max(p.stat().st_size for p in paths)
    dev = cupy.empty(biggest, dtype=cupy.uint8)
    started = time.perf_counter()
    for p in paths:
        with kvikio.CuFile(str(p), "r") as f:
            f.pread(dev[: p.stat().st_size]).get()
    cupy.cuda.runtime.deviceSynchronize()
    out["disk_to_gpu"] = total / (time.perf_counter() - started) / GB
    return out


def pool_to_gpu(pool: PinnedPool, nbytes: int = 2**30) -> float:
    with pool.alloc(nbytes) as block:
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            dev.copy_(block.tensor, non_blocking=True)
        stream.synchronize()
        started = time.perf_counter()
        with torch.cuda.stream(stream):
            for _ in range(5):
                dev.copy_(block.tensor, non_blocking=True)
        stream.synchronize()
        return 5 * nbytes / (time.perf_counter() - started) / GB


def disk_to_gpu_pipelined(store, keys, pool, threads: int, depth: int = 3) -> float:
    """Stage after stage: disk -> pinned -> GPU, `depth` stages in flight."""
    stage_sizes = {k: sum(e.padded for e in store.extents(k)) for k in keys}
    slot = max(stage_sizes.values())
    gpu_slots = [torch.empty(slot, dtype=torch.uint8, device="cuda") for _ in range(depth)]
    inflight = collections.deque()
    with ExtentReader(threads=threads) as reader:
        started = time.perf_counter()
        for n, key in enumerate(keys):
            if len(inflight) == depth:
                for fut, blk in inflight.popleft():
                    load = fut.result()
                    load.event.synchronize()
                    blk.free()
            dest, offset, jobs = gpu_slots[n % depth], 0, []
            for extent in store.extents(key):
                block = pool.alloc(extent.padded)
                view = dest[offset : offset + extent.nbytes].view(extent.dtype).view(extent.shape)
                jobs.append((reader.submit(extent, block, view), block))
                offset += extent.padded
            inflight.append(jobs)
        for jobs in inflight:
            for fut, blk in jobs:
                fut.result().event.synchronize()
                blk.free()
        torch.cuda.synchronize()
    return sum(stage_sizes.values()) / (time.perf_counter() - started) / GB


def torch_pinned_waste(sizes: list[int]) -> dict[str, float]:
    """What PyTorch's pinned caching allocator reserves for the same requests."""
    before = torch.cuda.host_memory_stats().get("reserved_bytes.current", 0)
    held = [torch.empty(s, dtype=torch.uint8, pin_memory=True) for s in sizes]
    after = torch.cuda.host_memory_stats().get("reserved_bytes.current", 0)
    requested = sum(sizes)
    ours = sum(align_up(s) for s in sizes)
    del held
    return {
        "requested_gb": requested / GB,
        "torch_reserved_gb": (after - before) / GB,
        "ours_reserved_gb": ours / GB,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nvme", type=Path, required=True)
    p.add_argument("--model", default="opt-6.7b")
    p.add_argument("--read-gb", type=float, default=6.0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args()
    cuda = torch.device("cuda")
    spec = resolve_model(args.model, dummy=True)
    t0 = time.perf_counter()
    store = ensure_store(DeviceDummy(spec.open_weights(), cuda), args.nvme, torch.float16)
    write_s = time.perf_counter() - t0
    layer_bytes = store.stage_bytes("layer.0")
    nlayers = max(2, min(spec.config.num_layers, int(args.read_gb * GB // layer_bytes)))
    keys = [f"layer.{i}" for i in range(nlayers)]
    paths = [store.directory / store.manifest["stages"][k]["file"] for k in keys]
    read_bytes = sum(p.stat().st_size for p in paths)
    res: dict = {
        "machine": platform.node(),
        "gpu": torch.cuda.get_device_name(),
        "model": args.model,
        "store_write_seconds": write_s,
        "read_bytes": read_bytes,
        "layer_bytes": layer_bytes,
    }
    res["ceiling_dd_odirect_1"] = dd_ceiling(paths[0], min(paths[0].stat().st_size, 2**30))
    res["ceiling_dd_odirect_4"] = parallel_dd(paths, 4)
    res["ceiling_pcie"] = pinned_h2d_peak()
    with PinnedPool(int(6 * layer_bytes) + 2**30) as pool:
        res["pool_pinned"] = pool.pinned
        for threads in (1, 4, 8, 16):
            res[f"ours_disk_to_pinned_t{threads}"] = ours_disk_to_pinned(
                store, keys, threads, True, pool
            )
        res["ours_disk_to_pinned_t8_noverify"] = ours_disk_to_pinned(store, keys, 8, False, pool)
        res["ours_pool_to_gpu"] = pool_to_gpu(pool)
        res["ours_disk_to_gpu_pipelined_t8"] = disk_to_gpu_pipelined(store, keys, pool, 8)
        res["ours_disk_to_gpu_pipelined_t16"] = disk_to_gpu_pipelined(store, keys, pool, 16)
    res["dropped_caches"] = drop_caches()
    res["alt_buffered_threadpool_t8"] = buffered_pool(paths, 8)
    drop_caches()
    res["alt_aiofiles_c8"] = aiofiles_read(paths, 8)
    drop_caches()
    try:
        res["alt_kvikio"] = kvikio_read(paths)
    except Exception as exc:  # a peer library failing must not lose the other numbers
        res["alt_kvikio"] = {"error": repr(exc)}
    shapes = [7168 * 7168 * 2 * 3, 7168 * 7168 * 2, 28672 * 7168 * 2, 28672 * 7168 * 2]
    res["pinned_waste_opt30b_layer"] = torch_pinned_waste(shapes)
    disk = max(res["ceiling_dd_odirect_1"], res["ceiling_dd_odirect_4"])
    pcie = res["ceiling_pcie"]["h2d"]
    best_read = max(v for k, v in res.items() if k.startswith("ours_disk_to_pinned_t"))
    res["ratios"] = {
        "disk_to_pinned_vs_raw_disk": best_read / disk,
        "pool_to_gpu_vs_pinned_peak": res["ours_pool_to_gpu"] / pcie,
        "disk_to_gpu_vs_min": max(
            res["ours_disk_to_gpu_pipelined_t8"], res["ours_disk_to_gpu_pipelined_t16"]
        )
        / min(disk, pcie),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"bench_io_{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(res, indent=1))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], out.name).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    print(f"\n{'measure':40s} GB/s")
    for key, value in res.items():
        if isinstance(value, float):
            print(f"{key:40s} {value:8.2f}")
    for key, value in res["ratios"].items():
        print(f"{key:40s} {value:8.2f}x")


if __name__ == "__main__":
    main()
