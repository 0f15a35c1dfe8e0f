"""`offload-convert`: write a model's weights into an NVMe weight store."""

from __future__ import annotations

import argparse
import sys
import time

from offload.api.args import resolve_device
from offload.api.plan_formats import weight_formats
from offload.cli.common import (
    add_engine_flags,
    add_version_flag,
    engine_args,
    run_cli,
    setup_logging,
)
from offload.core.config import resolve_dtype
from offload.core.errors import UserError
from offload.io.atomic import exclusive
from offload.io.store import ensure_store
from offload.models.resolve import resolve_model

FLAGS = ("model", "revision", "dtype", "device", "dummy", "nvme", "compress")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="offload-convert",
        description="Write a model's weights (safetensors, GGUF or dummy) into a weight store "
        "of 4 KiB-aligned extents under --nvme, for O_DIRECT streaming. A matching "
        "complete store is reused. The store's dtype is the one offload-run uses for "
        "the same --dtype and --device.",
    )
    add_version_flag(p)
    add_engine_flags(p, FLAGS, required=("nvme",))
    p.add_argument("--quiet", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.quiet, args.verbose)

    def body() -> int:
        engine = engine_args(args)
        spec = resolve_model(engine.model, dummy=engine.dummy, revision=engine.revision)
        formats = weight_formats(spec.weight_format(), engine.compress, engine.compressions())
        if len(formats) != 1:
            raise UserError("offload-convert --compress takes one format (none, int4 or int8)")
        compression = formats[0]
        on_gpu = resolve_device(engine.device).type == "cuda"
        dtype = resolve_dtype(engine.dtype, on_gpu, spec.config.checkpoint_dtype)
        started = time.perf_counter()
        # the same lock offload-run takes: one process at a time builds a store here
        with (
            exclusive(engine.nvme / "store", "weight store directory"),
            spec.open_weights() as source,
        ):
            store = ensure_store(source, engine.nvme, dtype, not args.quiet, compression)
        seconds = time.perf_counter() - started
        size = store.file_bytes()  # the whole model (no placement: tail_start 0)
        print(
            f"offload-convert: {store.directory} ({size / 1e9:.2f} GB) ready in {seconds:.1f} s",
            file=sys.stderr,
        )
        return 0

    return run_cli("offload-convert", body)


if __name__ == "__main__":
    sys.exit(main())
