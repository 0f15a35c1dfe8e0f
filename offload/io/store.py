"""The NVMe weight store: per-stage files of 4 KiB-aligned tensor extents and a manifest.

Layout of a store directory (one per model, dtype and compression):

    manifest.json      format version, model, config hash, dtype, compression and, per
                       stage, each tensor's file, offset, nbytes, shape, dtype, xxh3-64
    embed.bin, layer_0000.bin, ..., head.bin

Every extent starts on a 4 KiB boundary and is zero-padded to a multiple of 4 KiB, so
it can be read with O_DIRECT straight into an aligned pinned buffer. A store is built
in `<dir>.partial/` (each file fsynced, the manifest written last) and renamed into
place, so an interrupted conversion never leaves a directory that looks complete and
an existing store stays intact until the new one is whole.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from offload.config import ModelConfig
from offload.errors import UserError
from offload.io.atomic import atomic_write, fsync_dir
from offload.io.layout import stage_keys, store_bytes
from offload.io.pinned import ALIGN, align_up
from offload.kernels.formats import Compression
from offload.kernels.quant import compress_stage
from offload.models.weights import WeightSource

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int8: "int8",
    torch.uint8: "uint8",
}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}
SPACE_MARGIN = 64 * 2**20


def checksum(data: memoryview | bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def _stage_file(key: str) -> str:
    if key.startswith("layer."):
        return f"layer_{int(key.split('.')[1]):04d}.bin"
    return f"{key}.bin"


def _split_key(key: str) -> tuple[str, int]:
    stage, _, index = key.partition(".")
    return stage, int(index or 0)


@dataclass(frozen=True)
class Extent:
    """Where one tensor lives in the store."""

    stage: str
    name: str
    path: Path
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    xxh3: str

    @property
    def padded(self) -> int:
        return align_up(self.nbytes)


def compression_name(compression: Compression | None) -> str | None:
    if compression is None:
        return None
    kind = "sym" if compression.symmetric else "asym"
    return f"int{compression.bits}-g{compression.group_size}-{kind}"


def store_dir(
    nvme_dir: Path, cfg: ModelConfig, dtype: torch.dtype, compression: Compression | None = None
) -> Path:
    safe_name = "".join(c if c.isalnum() or c in "-._" else "_" for c in cfg.name)
    suffix = f"-{compression_name(compression)}" if compression is not None else ""
    return nvme_dir / f"{safe_name}-{cfg.fingerprint()}-{DTYPE_NAMES[dtype]}{suffix}"


class WeightStore:
    """An opened, complete store. `extents(key)` lists a stage's tensors."""

    def __init__(self, directory: Path, manifest: dict) -> None:
        self.directory = directory
        self.manifest = manifest
        self.dtype = DTYPES_BY_NAME[manifest["dtype"]]

    @classmethod
    def open(
        cls,
        directory: Path,
        cfg: ModelConfig,
        dtype: torch.dtype,
        compression: Compression | None = None,
    ) -> WeightStore:
        """Open a store, checking that it is complete and matches the model and dtype."""
        path = directory / MANIFEST
        if not path.is_file():
            raise UserError(f"{directory} is not a complete weight store (no {MANIFEST})")
        try:
            manifest = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise UserError(
                f"{path} is damaged ({exc}); delete {directory} to rebuild it"
            ) from None
        wanted = {
            "format_version": FORMAT_VERSION,
            "config_hash": cfg.fingerprint(),
            "dtype": DTYPE_NAMES[dtype],
            "compression": compression_name(compression),
        }
        for key, value in wanted.items():
            if manifest.get(key) != value:
                raise UserError(
                    f"weight store {directory} has {key}={manifest.get(key)!r}, this run needs "
                    f"{value!r}; delete it or use another --nvme directory"
                )
        for stage in manifest["stages"].values():
            file = directory / stage["file"]
            if not file.is_file() or file.stat().st_size < stage["size"]:
                raise UserError(
                    f"weight store file {file} is missing or truncated; delete {directory} to rebuild"
                )
        return cls(directory, manifest)

    def extents(self, key: str) -> list[Extent]:
        stage = self.manifest["stages"][key]
        path = self.directory / stage["file"]
        return [
            Extent(
                key,
                name,
                path,
                t["offset"],
                t["nbytes"],
                tuple(t["shape"]),
                DTYPES_BY_NAME[t["dtype"]],
                t["xxh3"],
            )
            for name, t in stage["tensors"].items()
        ]

    def stage_bytes(self, key: str) -> int:
        return sum(e.padded for e in self.extents(key))


def write_stage_file(path: Path, weights: dict[str, torch.Tensor]) -> dict:
    tensors = {}
    offset = 0
    with path.open("wb") as f:
        for name, tensor in weights.items():
            data = tensor.detach().contiguous().cpu().view(torch.uint8).numpy()
            padded = align_up(data.nbytes)
            f.write(memoryview(data).cast("B"))
            f.write(b"\0" * (padded - data.nbytes))
            tensors[name] = {
                "offset": offset,
                "nbytes": data.nbytes,
                "shape": list(tensor.shape),
                "dtype": DTYPE_NAMES[tensor.dtype],
                "xxh3": checksum(memoryview(data).cast("B")),
            }
            offset += padded
        f.flush()
        os.fsync(f.fileno())
    return {"file": path.name, "size": offset, "tensors": tensors}


def convert(
    source: WeightSource,
    nvme_dir: Path,
    dtype: torch.dtype,
    progress: bool = False,
    compression: Compression | None = None,
) -> Path:
    """Write a store for `source` under nvme_dir (quantized matrices when compression is
    given); returns its directory."""
    cfg = source.config
    final = store_dir(nvme_dir, cfg, dtype, compression)
    partial = final.with_name(final.name + ".partial")
    need = store_bytes(cfg, dtype, compression)
    nvme_dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(nvme_dir).free
    if free < need + SPACE_MARGIN:
        raise UserError(
            f"{nvme_dir} has {free / 1e9:.1f} GB free, the weight store needs {need / 1e9:.1f} GB; "
            "free space or choose another --nvme directory"
        )
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    keys = stage_keys(cfg)
    if progress:
        from tqdm import tqdm

        keys = tqdm(keys, desc="writing weight store", unit="stage")
    stages = {}
    try:
        for key in keys:
            stage, index = _split_key(key)
            weights = source.stage(stage, index, dtype, torch.device("cpu"))
            stages[key] = write_stage_file(
                partial / _stage_file(key), compress_stage(weights, compression)
            )
        manifest = {
            "format_version": FORMAT_VERSION,
            "model": cfg.name,
            "config_hash": cfg.fingerprint(),
            "dtype": DTYPE_NAMES[dtype],
            "compression": compression_name(compression),
            "alignment": ALIGN,
            "checksum": "xxh3_64",
            "stages": stages,
        }
        atomic_write(partial / MANIFEST, json.dumps(manifest, indent=1))
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        if exc.errno == errno.ENOSPC:
            raise UserError(
                f"disk full while writing the weight store in {nvme_dir}; free "
                f"{need / 1e9:.1f} GB or choose another --nvme directory (existing stores are intact)"
            ) from None
        raise UserError(f"cannot write the weight store in {nvme_dir}: {exc}") from None
    old = final.with_name(final.name + ".old")
    if final.exists():
        os.replace(final, old)
    os.replace(partial, final)
    fsync_dir(nvme_dir)
    shutil.rmtree(old, ignore_errors=True)
    return final


def ensure_store(
    source: WeightSource,
    nvme_dir: Path,
    dtype: torch.dtype,
    progress: bool = False,
    compression: Compression | None = None,
) -> WeightStore:
    """Reuse a matching complete store, or build one (a mismatching one is rebuilt)."""
    cfg = source.config
    directory = store_dir(nvme_dir, cfg, dtype, compression)
    if (directory / MANIFEST).is_file():
        try:
            return WeightStore.open(directory, cfg, dtype, compression)
        except UserError as exc:
            log.warning("rebuilding weight store: %s", exc)
    size = store_bytes(cfg, dtype, compression)
    log.info("writing weight store %s (%.1f GB)", directory, size / 1e9)
    built = convert(source, nvme_dir, dtype, progress, compression)
    return WeightStore.open(built, cfg, dtype, compression)
