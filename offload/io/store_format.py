"""The NVMe weight store's format: per-stage files of 4 KiB-aligned tensor extents and a
manifest, and `WeightStore`, an opened store (`io.store` builds and finds stores).

Layout of a store directory (one per model, dtype and compression):

    manifest.json      format version, model, config hash, dtype, compression and, per
                       stage, its file, image size and tail_start, and each tensor's
                       image offset, nbytes, shape, dtype and xxh3-64 (of the whole tensor)
    embed.bin, layer_0000.bin, ..., head.bin

A stage file holds the bytes [tail_start, size) of the stage's image (`io.layout`): the
part a policy puts on disk, which is all the executor ever reads from it (the rest it
reads from the source once, at set-up). A tensor's file offset is its image offset -
tail_start. Without a placement (`offload-convert`) tail_start is 0 and the store holds
the whole model. Every extent starts on a 4 KiB boundary and is zero-padded to a
multiple of 4 KiB, so it can be read with O_DIRECT straight into an aligned pinned
buffer; tail_start is a cut, so 4 KiB aligned too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from offload.core.config import ModelConfig
from offload.core.errors import UserError
from offload.io.layout import TensorSlot, shares_table
from offload.io.pinned import ALIGN, align_up
from offload.kernels.formats import Compression

# 2 adds each stage's tail_start (a version 1 store is read as whole); 3 holds a tied
# model's table once, in the head (`io.layout.shares_table`): a tied model's older store
# has it in the embedding too, and is rebuilt
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
MANIFEST = "manifest.json"
DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int8: "int8",
    torch.uint8: "uint8",
}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}


def checksum(data: memoryview | bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes as a stage file holds them (and its checksum is taken of)."""
    return memoryview(tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy())


def stage_file(key: str) -> str:
    if key.startswith("layer."):
        return f"layer_{int(key.split('.')[1]):04d}.bin"
    return f"{key}.bin"


def split_key(key: str) -> tuple[str, int]:
    stage, _, index = key.partition(".")
    return stage, int(index or 0)


@dataclass(frozen=True)
class Extent:
    """A piece of a stage file to read: `offset` is in the file."""

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
    if compression.fp8:
        return f"fp8-b{compression.group_size}"
    kind = "sym" if compression.symmetric else "asym"
    kind = "zp" if compression.zero_point else kind
    head = "" if compression.head else "-dense-head"
    return f"int{compression.bits}-g{compression.group_size}-{kind}{head}"


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
        if manifest.get("format_version") not in READABLE_VERSIONS:
            raise UserError(
                f"weight store {directory} has format_version="
                f"{manifest.get('format_version')!r}, this run reads {READABLE_VERSIONS}; "
                "delete it or use another --nvme directory"
            )
        if manifest["format_version"] < 3 and shares_table(cfg):
            raise UserError(
                f"weight store {directory} holds the tied embedding twice (format_version="
                f"{manifest['format_version']}); delete it or use another --nvme directory"
            )
        wanted = {
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
            held = stage["size"] - stage.get("tail_start", 0)
            if not file.is_file() or file.stat().st_size < held:
                raise UserError(
                    f"weight store file {file} is missing or truncated; delete {directory} to rebuild"
                )
        return cls(directory, manifest)

    def tail_start(self, key: str) -> int:
        """Where the stage file begins in the stage's image."""
        return self.manifest["stages"][key].get("tail_start", 0)

    def holds(self, tails: Mapping[str, int]) -> bool:
        """Whether the store holds, of every stage `key`, its image from `tails[key]` on:
        all that a plan with these cuts reads from disk."""
        stages = self.manifest["stages"]
        return stages.keys() == tails.keys() and all(
            self.tail_start(key) <= need for key, need in tails.items()
        )

    @property
    def whole(self) -> bool:
        """Holds every stage whole (written without a placement)."""
        return all(stage.get("tail_start", 0) == 0 for stage in self.manifest["stages"].values())

    def path(self, key: str) -> Path:
        return self.directory / self.manifest["stages"][key]["file"]

    def layout(self, key: str) -> tuple[TensorSlot, ...]:
        """The stage's image layout: every tensor, at its offset in the image."""
        return tuple(
            TensorSlot(
                name, t["offset"], t["nbytes"], tuple(t["shape"]), DTYPES_BY_NAME[t["dtype"]]
            )
            for name, t in self.manifest["stages"][key]["tensors"].items()
        )

    def checksum(self, key: str, name: str) -> str:
        """xxh3-64 of the whole tensor `name` of stage `key`."""
        return self.manifest["stages"][key]["tensors"][name]["xxh3"]

    def extents(self, key: str) -> list[Extent]:
        """The tensors that the stage file holds whole, at their offsets in the file."""
        tail, path = self.tail_start(key), self.path(key)
        return [
            Extent(
                key,
                t.name,
                path,
                t.offset - tail,
                t.nbytes,
                t.shape,
                t.dtype,
                self.checksum(key, t.name),
            )
            for t in self.layout(key)
            if t.offset >= tail
        ]

    def stage_bytes(self, key: str) -> int:
        return sum(e.padded for e in self.extents(key))

    def file_bytes(self) -> int:
        """What the stage files take on disk."""
        return sum(s["size"] - s.get("tail_start", 0) for s in self.manifest["stages"].values())


def write_stage_file(path: Path, weights: dict[str, torch.Tensor], tail_start: int = 0) -> dict:
    """Write the bytes [tail_start, size) of the stage image of `weights` (in order, each
    tensor 4 KiB aligned) to `path`; returns the stage's manifest entry, whose checksums
    are of the whole tensors."""
    assert tail_start % ALIGN == 0, "a stage file starts on a 4 KiB boundary"
    tensors = {}
    offset = 0
    with path.open("wb") as f:
        for name, tensor in weights.items():
            data = tensor_bytes(tensor)
            padded = align_up(data.nbytes)
            skip = min(padded, max(0, tail_start - offset))  # bytes before the file begins
            f.write(data[skip:])
            f.write(b"\0" * (padded - max(skip, data.nbytes)))
            tensors[name] = {
                "offset": offset,
                "nbytes": data.nbytes,
                "shape": list(tensor.shape),
                "dtype": DTYPE_NAMES[tensor.dtype],
                "xxh3": checksum(data),
            }
            offset += padded
        f.flush()
        os.fsync(f.fileno())
    assert tail_start <= offset, "the stage file begins past the stage's end"
    return {"file": path.name, "size": offset, "tail_start": tail_start, "tensors": tensors}
