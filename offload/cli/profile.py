"""`offload-profile`: measure this machine once; every other command reads the result."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from offload.cli.common import run_cli, setup_logging
from offload.policies.hardware import load_profile, measure, profile_path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="offload-profile",
        description="Measure PCIe, disk, GPU and CPU-attention rates and memory sizes of this "
        "machine and cache them as a HardwareProfile JSON.",
    )
    p.add_argument("--nvme", type=Path, help="measure disk reads/writes (O_DIRECT) here")
    p.add_argument("--show", action="store_true", help="print the cached profile")
    p.add_argument("--quick", action="store_true", help="smaller transfers (less accurate)")
    args = p.parse_args(argv)
    setup_logging(quiet=False)

    def body() -> int:
        if args.show:
            cached = load_profile()
            if cached is None:
                print(f"no profile at {profile_path()}; run offload-profile", file=sys.stderr)
                return 1
            print(cached.to_json())
            return 0
        hw = measure(args.nvme, quick=args.quick)
        if not hw.has_gpu:
            print("offload-profile: no CUDA device: profiled the CPU path", file=sys.stderr)
        profile_path().parent.mkdir(parents=True, exist_ok=True)
        profile_path().write_text(hw.to_json())
        print(hw.to_json())
        print(f"offload-profile: saved to {profile_path()}", file=sys.stderr)
        return 0

    return run_cli("offload-profile", body)


if __name__ == "__main__":
    sys.exit(main())
