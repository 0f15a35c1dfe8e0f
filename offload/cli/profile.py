"""`offload-profile`: measure this machine once; every other command reads the result."""

from __future__ import annotations

import argparse
import sys

from offload.cli.common import add_engine_flags, run_cli, setup_logging
from offload.policies.hardware import load_profile, measure, profile_path, save_profile


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="offload-profile",
        description="Measure PCIe, disk, GPU and CPU-attention rates and memory sizes of this "
        "machine and cache them as a HardwareProfile JSON.",
    )
    add_engine_flags(p, ("nvme",))
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
        save_profile(hw)
        print(hw.to_json())
        print(f"offload-profile: saved to {profile_path()}", file=sys.stderr)
        return 0

    return run_cli("offload-profile", body)


if __name__ == "__main__":
    sys.exit(main())
