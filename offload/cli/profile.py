"""`offload-profile`: measure this machine once; every other command reads the result."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from offload.cli.common import add_engine_flags, add_version_flag, run_cli, setup_logging
from offload.executor.probe import measure_profile
from offload.io.atomic import check_writable
from offload.policies.hardware import load_profile, profile_path, save_profile


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="offload-profile",
        description="Measure this machine's rates for the cost model and cache them as a "
        "HardwareProfile JSON: PCIe (each way and both at once), disk, HBM, DRAM, the matmul "
        "and decode attention per storage format (fp16, int8, int4), CPU attention, the "
        "executor's fixed cost per layer and micro-batch (eager and from CUDA graphs) and, "
        "with two or more GPUs, the all-reduce between them, the ranks' wait for each other "
        "there and each GPU's H2D rate while all copy at once. The profile records the code "
        "version it was measured with; other code measures again.",
    )
    add_version_flag(p)
    add_engine_flags(p, ("nvme",))
    p.add_argument("--show", action="store_true", help="print the cached profile")
    p.add_argument("--quick", action="store_true", help="smaller transfers (less accurate; under a minute)")  # fmt: skip
    args = p.parse_args(argv)
    setup_logging(quiet=False, verbose=args.verbose)

    def body() -> int:
        if args.show:
            cached = load_profile()
            if cached is None:
                print(f"no current profile at {profile_path()}; run offload-profile", file=sys.stderr)  # fmt: skip
                return 1
            print(cached.to_json())
            return 0
        if args.nvme is not None:  # refused before anything is measured
            check_writable(Path(args.nvme), "--nvme", directory=True)
        hw = measure_profile(args.nvme, quick=args.quick)
        if not hw.has_gpu:
            print("offload-profile: no CUDA device: profiled the CPU path", file=sys.stderr)
        gpus = torch.cuda.device_count() if hw.has_gpu else 0
        if gpus >= 2:
            from offload.parallel.bandwidth import measure_node

            hw = dataclasses.replace(hw, **measure_node(gpus))
        save_profile(hw)
        print(hw.to_json())
        print(f"offload-profile: saved to {profile_path()}", file=sys.stderr)
        return 0

    return run_cli("offload-profile", body)


if __name__ == "__main__":
    sys.exit(main())
