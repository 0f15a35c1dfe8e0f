"""The NVMe weight store: per-stage files of 4 KiB-aligned tensor extents and a manifest.

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

A store serves a plan when every stage's tail_start is at most the plan's cut (it holds
at least what the plan reads from disk): a re-plan that moves less onto disk reuses it,
one that moves more rebuilds it. No slack is added below the cut: the store exists
because the disk is short, the plan counts exactly these bytes as its disk share and
the free-space check asks for exactly them, so planner and store agree; a store
written whole by offload-convert serves every plan.

A store is built in `<dir>.partial/` (each file fsynced, the manifest written last) and
renamed into place, so an interrupted conversion never leaves a directory that looks
complete and an existing store stays intact until the new one is whole.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from offload.core.config import ModelConfig
from offload.core.errors import UserError
from offload.core.progress import tracked
from offload.io.atomic import atomic_write, fsync_dir
from offload.io.layout import (
    TensorSlot,
    shares_table,
    stage_keys,
    stage_layout,
    store_bytes,
    store_tails,
)
from offload.io.pinned import ALIGN, align_up
from offload.kernels.formats import Compression
from offload.kernels.quant import compress_stage
from offload.models.weights import WeightSource

log = logging.getLogger(__name__)

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
SPACE_MARGIN = 64 * 2**20


def checksum(data: memoryview | bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes as a stage file holds them (and its checksum is taken of)."""
    return memoryview(tensor.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy())


def _file_bytes(entries: Iterable[dict]) -> int:
    """Bytes on disk of stage files (each holds its stage from its tail_start)."""
    return sum(entry["size"] - entry["tail_start"] for entry in entries)


def _stage_file(key: str) -> str:
    if key.startswith("layer."):
        return f"layer_{int(key.split('.')[1]):04d}.bin"
    return f"{key}.bin"


def _split_key(key: str) -> tuple[str, int]:
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
            data = _tensor_bytes(tensor)
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


def free_bytes(directory: Path) -> int:
    """Free bytes of the file system `directory` is (or would be) on."""
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    return shutil.disk_usage(directory).free


def space_problem(nvme_dir: Path, need: int) -> str | None:
    """None when nvme_dir has room for a store of `need` bytes, else the one-line cause."""
    free = free_bytes(nvme_dir)
    if free >= need + SPACE_MARGIN:
        return None
    return (
        f"{nvme_dir} has {free / 1e9:.1f} GB free, the weight store needs {need / 1e9:.1f} GB; "
        "free space or choose another --nvme directory"
    )


def convert(
    source: WeightSource,
    nvme_dir: Path,
    dtype: torch.dtype,
    progress: bool = False,
    compression: Compression | None = None,
    placement=None,  # a policies.Placement (duck-typed: io sits below policies)
) -> Path:
    """Write a store for `source` under nvme_dir (quantized matrices when compression is
    given) holding the stage tails `placement` puts on disk (the whole model without
    one); returns its directory. A build that was killed resumes: the stages it wrote
    are kept (`_resumable`), the rest are written."""
    cfg = source.config
    final = store_dir(nvme_dir, cfg, dtype, compression)
    partial = final.with_name(final.name + ".partial")
    need = store_bytes(cfg, dtype, compression, placement)
    identity = {
        "format_version": FORMAT_VERSION,
        "model": cfg.name,
        "config_hash": cfg.fingerprint(),
        "dtype": DTYPE_NAMES[dtype],
        "compression": compression_name(compression),
        "alignment": ALIGN,
    }
    wanted = dict(
        zip(stage_keys(cfg), store_tails(cfg, dtype, compression, placement), strict=True)
    )
    done = _resumable(partial, identity, wanted, source, dtype, compression)
    written = _file_bytes(done.values())
    nvme_dir.mkdir(parents=True, exist_ok=True)
    problem = space_problem(nvme_dir, need - written)
    if problem:
        raise UserError(problem)
    if done:
        log.info(
            "resuming the weight store's build in %s: %d of %d stages already written",
            partial,
            len(done),
            len(wanted),
        )
    else:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
    stages_in = iter(wanted.items())
    if progress:
        stages_in = tracked(stages_in, len(wanted), "writing weight store", "stage")
    stages: dict[str, dict] = {}  # the stages written, as the progress file names them
    writing = None  # the stage whose file is being written
    try:
        for key, tail_start in stages_in:
            if key in done:
                stages[key] = done[key]
                continue
            tensors = _stored_tensors(source, cfg, key, dtype, compression)
            writing = partial / _stage_file(key)
            entry = write_stage_file(writing, tensors, tail_start)
            # after the stage's file is synced: a build killed from here on keeps it
            named = {**stages, key: entry}
            atomic_write(partial / PROGRESS, json.dumps({"identity": identity, "stages": named}))
            stages, writing = named, None
        manifest = {**identity, "checksum": "xxh3_64", "stages": stages}
        atomic_write(partial / MANIFEST, json.dumps(manifest, indent=1))
        (partial / PROGRESS).unlink(missing_ok=True)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            # the stages synced are kept: the same command resumes once there is room
            kept = _file_bytes(stages.values())
            if writing is not None:
                writing.unlink(missing_ok=True)  # the stage cut short
            raise UserError(
                f"disk full while writing the weight store in {nvme_dir} ({len(stages)} of "
                f"{len(wanted)} stages written, {kept / 1e9:.1f} GB, kept in {partial.name}); "
                f"free {(need - kept) / 1e9:.1f} GB and run again to resume, or choose another "
                "--nvme directory and delete that one (existing stores are intact)"
            ) from None
        shutil.rmtree(partial, ignore_errors=True)
        raise UserError(f"cannot write the weight store in {nvme_dir}: {exc}") from None
    old = final.with_name(final.name + ".old")
    if final.exists():
        os.replace(final, old)
    os.replace(partial, final)
    fsync_dir(nvme_dir)
    shutil.rmtree(old, ignore_errors=True)
    return final


PROGRESS = "progress.json"


def _stored_tensors(
    source: WeightSource,
    cfg: ModelConfig,
    key: str,
    dtype: torch.dtype,
    compression: Compression | None,
) -> dict[str, torch.Tensor]:
    """A stage's tensors as the store holds them (quantized where compressed; a tied
    model's embedding leaves its table to the head)."""
    stage, index = _split_key(key)
    stored = compress_stage(source.stage(stage, index, dtype, torch.device("cpu")), compression)
    return {t.name: stored[t.name] for t in stage_layout(cfg, key, dtype, compression)}


def _resumable(
    partial: Path,
    identity: dict,
    wanted: Mapping[str, int],
    source: WeightSource,
    dtype: torch.dtype,
    compression: Compression | None,
) -> dict[str, dict]:
    """The stages a killed build of the same store left in `partial` that this build can
    keep: named in its progress file (written after each stage's file was synced), of the
    same format, model, dtype and compression, their file whole, and holding at least the
    tail this build needs. The source is checked against them by one stage's checksums
    (made again from it): a different checkpoint of the same configuration starts over."""
    try:
        left = json.loads((partial / PROGRESS).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(left, dict) or left.get("identity") != identity:
        return {}
    done = {}
    for key, entry in left.get("stages", {}).items():
        path = partial / _stage_file(key)
        if (
            key in wanted
            and entry["tail_start"] <= wanted[key]
            and path.is_file()
            and path.stat().st_size == entry["size"] - entry["tail_start"]
        ):
            done[key] = entry
    if done:
        key = min(done, key=lambda k: done[k]["size"])  # the cheapest to make again
        tensors = _stored_tensors(source, source.config, key, dtype, compression)
        sums = {name: entry["xxh3"] for name, entry in done[key]["tensors"].items()}
        made = {name: checksum(_tensor_bytes(t)) for name, t in tensors.items()}
        if made != sums:
            log.warning("the weights differ from the killed build's: writing the store again")
            return {}
    return done


def find_store(
    nvme_dir: Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    compression: Compression | None = None,
    placement=None,  # a policies.Placement (duck-typed: io sits below policies)
) -> tuple[WeightStore | None, str | None]:
    """(the complete matching store under nvme_dir that holds every tail `placement`
    reads from disk (every stage whole without one), None) or (None, why there is none
    to reuse: None when there is no store at all)."""
    directory = store_dir(nvme_dir, cfg, dtype, compression)
    if not (directory / MANIFEST).is_file():
        return None, None
    try:
        store = WeightStore.open(directory, cfg, dtype, compression)
    except UserError as exc:
        return None, str(exc)
    tails = store_tails(cfg, dtype, compression, placement)
    if not store.holds(dict(zip(stage_keys(cfg), tails, strict=True))):
        return None, f"{directory} holds less of the stages than this plan reads from disk"
    return store, None


def ensure_store(
    source: WeightSource,
    nvme_dir: Path,
    dtype: torch.dtype,
    progress: bool = False,
    compression: Compression | None = None,
    placement=None,  # a policies.Placement (duck-typed: io sits below policies)
) -> WeightStore:
    """Reuse a matching complete store that holds what `placement` reads from disk, or
    build one of those tails (the whole model without a placement)."""
    cfg = source.config
    store, why_not = find_store(nvme_dir, cfg, dtype, compression, placement)
    if why_not is not None:
        log.warning("rebuilding weight store: %s", why_not)
    if store is not None:
        log.info(
            "reusing weight store %s (%.1f GB on disk)", store.directory, store.file_bytes() / 1e9
        )
        return store
    size = store_bytes(cfg, dtype, compression, placement)
    directory = store_dir(nvme_dir, cfg, dtype, compression)
    log.info("writing weight store %s (%.1f GB)", directory, size / 1e9)
    built = convert(source, nvme_dir, dtype, progress, compression, placement)
    return WeightStore.open(built, cfg, dtype, compression)
