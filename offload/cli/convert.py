"""`offload-convert`: write a model's weights into an NVMe weight store."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from offload.cli.common import parse_compression, run_cli, setup_logging
from offload.engine import DTYPES
from offload.errors import UserError
from offload.io.store import ensure_store, store_bytes
from offload.models.resolve import resolve_model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="offload-convert",
        description="Write a model's weights (safetensors, GGUF or dummy) into a weight store "
        "of 4 KiB-aligned extents under --nvme, for O_DIRECT streaming. A matching "
        "complete store is reused.",
    )
    p.add_argument("--model", required=True, help="demo, a preset, a hub repo id or a path")
    p.add_argument("--nvme", required=True, type=Path, help="directory on a fast drive")
    p.add_argument("--dtype", default="float16", choices=tuple(DTYPES))
    p.add_argument("--dummy", action="store_true", help="random weights of the model's shape")
    p.add_argument(
        "--compress",
        default="none",
        help="store the layer matrices quantized: none, int4 or int8 (-gN, -sym as in offload-plan)",
    )
    p.add_argument("-q", "--quiet", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.quiet)

    def body() -> int:
        formats = parse_compression(args.compress)
        if len(formats) != 1:
            raise UserError("offload-convert --compress takes one format (none, int4 or int8)")
        compression = formats[0]
        spec = resolve_model(args.model, dummy=args.dummy)
        dtype = DTYPES[args.dtype]
        started = time.perf_counter()
        with spec.open_weights() as source:
            store = ensure_store(source, args.nvme, dtype, not args.quiet, compression)
        seconds = time.perf_counter() - started
        size = store_bytes(spec.config, dtype, compression)
        print(
            f"offload-convert: {store.directory} ({size / 1e9:.2f} GB) ready in {seconds:.1f} s",
            file=sys.stderr,
        )
        return 0

    return run_cli("offload-convert", body)


if __name__ == "__main__":
    sys.exit(main())
