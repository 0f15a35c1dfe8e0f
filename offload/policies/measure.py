"""Measurements of this machine's rates for `HardwareProfile` (`offload-profile`).

Each figure is measured the way the executor uses it: pinned copies (one way and both
ways at once), O_DIRECT disk reads and writes (`measure_disk`), the CPU attention with
copies running (`measure_cpu_attention`), and, per storage format
(`hardware.format_name`), the matmul at decode and prefill shapes and decode attention
on the GPU through the kernels the executor runs (`measure_kernels`), and a mixture of
experts' expert figures (`measure_experts`). The executor's
own fixed costs are measured above this layer (`executor.probe`).
"""

from __future__ import annotations

import logging
import platform
import tempfile
import time
from pathlib import Path

import psutil
import torch

from offload.policies.hardware import GB, HardwareProfile, code_version
from offload.policies.measure_cpu_attention import (
    CPU_ATTENTION_GROUPS,
    CpuAttentionRates,
    cpu_attention_call,
    cpu_attention_rates,
    h2d_rate_under_cpu_attention,
)
from offload.policies.measure_disk import disk_rates, kv_disk_read_rate
from offload.policies.measure_experts import expert_figures
from offload.policies.measure_kernels import (
    MatmulRates,
    gpu_attention_rates,
    matmul_rates,
    matmul_tflops,
    prefill_attention_tflops,
)
from offload.policies.memory_limit import node_memory_limit
from offload.policies.timers import copy_rate, pin_rate, timed

log = logging.getLogger(__name__)


def measure(nvme: Path | None, quick: bool = False) -> HardwareProfile:
    """Measure this machine. Without CUDA the compute device is the CPU: host copies
    stand in for PCIe and the CPU's matmul rate for the GPU's."""
    size = 2**26 if quick else 2**29
    disk_dir = nvme or Path(tempfile.gettempdir())
    started = time.perf_counter()
    disk_read, disk_write = disk_rates(disk_dir, min(size * 2, 2**30))
    disk_kv_read = kv_disk_read_rate(disk_dir)
    said(f"the disk ({disk_dir})", started, disk_read_gbps=disk_read,
         disk_write_gbps=disk_write, disk_kv_read_gbps=disk_kv_read)  # fmt: skip
    started = time.perf_counter()
    dram = copy_rate(torch.empty(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)) * 2
    said("the memory", started, dram_gbps=dram)
    device = _gpu_figures(size) if torch.cuda.is_available() else _cpu_only_figures(dram)
    cpu_attention: CpuAttentionRates = device.pop("cpu_attention")
    started = time.perf_counter()
    experts = expert_figures(quick)
    said("an expert's rates", started, **experts)
    grouped = [str(g) for g in CPU_ATTENTION_GROUPS]
    return HardwareProfile(
        **device,
        has_gpu=torch.cuda.is_available(),
        cpu_mem_bytes=node_memory_limit()[0],  # the cgroup's limit where there is one
        disk_read_gbps=disk_read,
        disk_write_gbps=disk_write,
        disk_kv_read_gbps=disk_kv_read,
        cpu_attention_gbps=cpu_attention.gbps["1"],
        cpu_quant_attention_gbps=cpu_attention.quant_gbps["1"],
        cpu_attention_grouped_gbps={g: cpu_attention.gbps[str(g)] for g in grouped},
        cpu_quant_attention_grouped_gbps={g: cpu_attention.quant_gbps[str(g)] for g in grouped},
        cpu_attention_pair_s=cpu_attention.pair_s,
        cpu_quant_attention_pair_s=cpu_attention.quant_pair_s,
        dram_gbps=dram,
        process_base_bytes=psutil.Process().memory_info().rss,
        measured_at=time.strftime("%Y-%m-%d %H:%M:%S"),
        **experts,
        code_version=code_version(),
    )


def said(what: str, started: float, **figures: object) -> None:
    """One measurement's figures in the log as it finishes (offload-profile shows each)."""
    flat: dict[str, object] = {}
    for name, value in figures.items():  # (a figure per format or family: one level down)
        inner = value.items() if isinstance(value, dict) else [("", value)]
        flat |= {f"{name}/{k}" if k else name: v for k, v in inner}
    shown = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in flat.items()
             if isinstance(v, (int, float, str))]  # fmt: skip
    log.info("measured %s in %.1f s: %s", what, time.perf_counter() - started, ", ".join(shown))


def _gpu_figures(size: int) -> dict:
    """The GPU's figures (the profile's fields by name) and the CPU attention's
    (`cpu_attention`), timed with the weight stream's copies beside it."""
    dev = torch.device("cuda")
    started = time.perf_counter()
    figures = _copy_figures(size, dev)  # (its buffers freed before the kernels' run)
    said("the copies and the CPU attention", started, **figures,
         cpu_attention_gbps=figures["cpu_attention"].gbps)  # fmt: skip
    started = time.perf_counter()
    prefill = matmul_tflops(4096, 8192, 8192, dev, torch.float16)
    decode = matmul_tflops(64, 8192, 28672, dev, torch.float16)
    matmuls = matmul_rates(8192, 28672, dev, torch.float16)
    said("the matmuls", started, prefill_tflops=prefill, decode_tflops=decode,
         **_matmul_figures(matmuls))  # fmt: skip
    started = time.perf_counter()
    attention, attention_call, attention_pair = gpu_attention_rates(dev, torch.float16)
    said("the GPU's attention", started, gpu_attention_gbps=attention)
    figures.update(
        prefill_tflops=prefill,
        decode_tflops=decode,
        **_matmul_figures(matmuls),
        prefill_attention_tflops=prefill_attention_tflops(dev, torch.float16),
        gpu_attention_gbps=attention,
        attention_call_s=attention_call,
        attention_pair_s=attention_pair,
        device_name=torch.cuda.get_device_name(),
        gpu_mem_bytes=torch.cuda.get_device_properties(dev).total_memory,
        pin_gbps=pin_rate(4 * size),
    )
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    figures["gpu_context_bytes"] = int(total - free - torch.cuda.memory_reserved(dev))
    return figures


def _copy_figures(size: int, dev: torch.device) -> dict:
    """The copies' rates between pinned host memory and the GPU (each way, both at
    once, pageable, and under the CPU attention) and the GPU's own copy rate; and the
    CPU attention's figures (`cpu_attention`), timed with copies beside it."""
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(size, dtype=torch.uint8, device=dev)
    gpu2 = torch.empty(size, dtype=torch.uint8, device=dev)
    h2d, d2h = copy_rate(host, gpu), copy_rate(gpu, host)
    dense_attention = cpu_attention_call(torch.float16, compressed=False)[0]
    cpu_attention = cpu_attention_rates(torch.float16, host, gpu, h2d)
    h2d_under_attention = h2d_rate_under_cpu_attention(dense_attention, host, gpu, h2d)
    del dense_attention
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both() -> None:
        with torch.cuda.stream(s1):
            gpu.copy_(host, non_blocking=True)
        with torch.cuda.stream(s2):
            host2.copy_(gpu2, non_blocking=True)

    return {
        "h2d_gbps": h2d,
        "d2h_gbps": d2h,
        "bidir_gbps": 2 * size / timed(both) / GB,
        "pageable_h2d_gbps": copy_rate(torch.empty(size, dtype=torch.uint8), gpu),
        "hbm_gbps": 2 * copy_rate(gpu, gpu2),
        "cpu_attention": cpu_attention,
        "h2d_under_cpu_attention_gbps": h2d_under_attention,
    }


def _cpu_only_figures(dram: float) -> dict:
    """Without a GPU: host copies stand in for PCIe and the CPU's matmul rate for the
    GPU's; decode attention runs on the CPU (its `cpu_attention` figures)."""
    cpu = torch.device("cpu")
    copies = dram / 2
    started = time.perf_counter()
    cpu_attention = cpu_attention_rates(torch.float32)
    said("the CPU attention", started, gbps=cpu_attention.gbps)
    started = time.perf_counter()
    matmul = matmul_tflops(1024, 2048, 2048, cpu, torch.float32)
    matmuls = matmul_rates(1024, 2048, cpu, torch.float32)
    said("the matmuls", started, tflops=matmul, **_matmul_figures(matmuls))
    return {
        "device_name": f"CPU only ({platform.processor() or 'cpu'})",
        "gpu_mem_bytes": psutil.virtual_memory().total,
        "h2d_gbps": copies,
        "d2h_gbps": copies,
        "bidir_gbps": copies,
        "pageable_h2d_gbps": copies,
        "prefill_tflops": matmul,
        "decode_tflops": matmul,
        "hbm_gbps": copies,
        "cpu_attention": cpu_attention,
        "h2d_under_cpu_attention_gbps": 0.0,  # no copy lane beside the CPU's own attention
        "gpu_context_bytes": 0,
        **_matmul_figures(matmuls),
        "prefill_attention_tflops": prefill_attention_tflops(cpu, torch.float32),
        "gpu_attention_gbps": {},
        "attention_call_s": {},
        "attention_pair_s": {},
    }


def _matmul_figures(matmuls: MatmulRates) -> dict:
    """The profile's matmul fields, by name."""
    return {
        "matmul_gbps": matmuls.decode_gbps,
        "matmul_gbps_wide": matmuls.wide_gbps,
        "matmul_gbps_mid": matmuls.mid_gbps,
        "matmul_call_s": matmuls.call_s,
        "prefill_format_tflops": matmuls.prefill_tflops,
        "dequant_gbps": matmuls.dequant_gbps,
    }
