"""Building and finding NVMe weight stores (`io.store_format` gives their format).

A store serves a plan when every stage's tail_start is at most the plan's cut (it holds
at least what the plan reads from disk): a re-plan that moves less onto disk reuses it,
one that moves more rebuilds it. No slack is added below the cut: the store exists
because the disk is short, the plan counts exactly these bytes as its disk share and
the free-space check asks for exactly them, so planner and store agree; a store
written whole by offload-convert serves every plan.

A store is built in `<dir>.partial/` (each file fsynced, the manifest written last) and
renamed into place, so an interrupted conversion never leaves a directory that looks
complete and an existing store stays intact until the new one is whole. A build that
is killed keeps the stages it synced (named in `progress.json`), and the same command
resumes it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from offload.core.config import ModelConfig
from offload.core.errors import DiskFull, UserError
from offload.core.progress import tracked
from offload.io.atomic import atomic_write, fsync_dir, size_text
from offload.io.layout import (
    stage_keys,
    stage_layout,
    stage_pieces,
    store_bytes,
    store_tails,
)
from offload.io.pinned import ALIGN
from offload.io.store_format import (
    DTYPE_NAMES,
    FORMAT_VERSION,
    MANIFEST,
    WeightStore,
    checksum,
    compression_name,
    split_key,
    stage_file,
    store_dir,
    tensor_bytes,
    write_stage_file,
)
from offload.kernels.formats import Compression
from offload.kernels.quant import compress_stage
from offload.models.weights import WeightSource

log = logging.getLogger(__name__)

SPACE_MARGIN = 64 * 2**20
PROGRESS = "progress.json"


def _file_bytes(entries: Iterable[dict]) -> int:
    """Bytes on disk of stage files (each holds its stage from its tail_start)."""
    return sum(entry["size"] - entry["tail_start"] for entry in entries)


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
        f"{nvme_dir} has {size_text(free)} free; the weight store needs {size_text(need)} and "
        f"a margin of {size_text(SPACE_MARGIN)} ({size_text(need + SPACE_MARGIN)} in all); free "
        "space or choose another --nvme directory"
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
    tails = store_tails(cfg, dtype, compression, placement)
    build = _Build(
        source,
        dtype,
        compression,
        nvme_dir,
        final.with_name(final.name + ".partial"),
        _identity(cfg, dtype, compression),
        dict(zip(stage_keys(cfg), tails, strict=True)),
        store_bytes(cfg, dtype, compression, placement),
    )
    done = _resumable(build.partial, build.identity, build.wanted, source, dtype, compression)
    _start(build, done)
    _write_stages(build, done, progress)
    old = final.with_name(final.name + ".old")
    if final.exists():
        os.replace(final, old)
    os.replace(build.partial, final)
    fsync_dir(nvme_dir)
    shutil.rmtree(old, ignore_errors=True)
    return final


@dataclass(frozen=True)
class _Build:
    """One build of a store: what it writes, where, and the bytes it needs in all."""

    source: WeightSource
    dtype: torch.dtype
    compression: Compression | None
    nvme_dir: Path
    partial: Path  # the directory it is built in
    identity: dict  # what the manifest and the progress file say the store is
    wanted: dict[str, int]  # stage key -> the tail_start its file begins at
    need: int  # the stage files' bytes


def _identity(cfg: ModelConfig, dtype: torch.dtype, compression: Compression | None) -> dict:
    return {
        "format_version": FORMAT_VERSION,
        "model": cfg.name,
        "config_hash": cfg.fingerprint(),
        "dtype": DTYPE_NAMES[dtype],
        "compression": compression_name(compression),
        "alignment": ALIGN,
    }


def _start(build: _Build, done: dict[str, dict]) -> None:
    """Check the free space for what is left to write, then keep the partial directory
    of a build to resume (`done`: its stages) or make it empty."""
    build.nvme_dir.mkdir(parents=True, exist_ok=True)
    problem = space_problem(build.nvme_dir, build.need - _file_bytes(done.values()))
    if problem:
        raise UserError(problem)
    if done:
        log.info(
            "resuming the weight store's build in %s: %d of %d stages already written",
            build.partial,
            len(done),
            len(build.wanted),
        )
    else:
        shutil.rmtree(build.partial, ignore_errors=True)
        build.partial.mkdir()


def _write_stages(build: _Build, done: dict[str, dict], progress: bool) -> None:
    """Write the stages not `done` into the partial directory, naming each in the
    progress file once its file is synced, then the manifest. A full disk keeps the
    stages synced (the same command resumes); another error removes the directory."""
    partial = build.partial
    stages_in = iter(build.wanted.items())
    if progress:
        stages_in = tracked(stages_in, len(build.wanted), "writing weight store", "stage")
    stages: dict[str, dict] = {}  # the stages written, as the progress file names them
    writing = None  # the stage whose file is being written
    try:
        for key, tail_start in stages_in:
            if key in done:
                stages[key] = done[key]
                continue
            tensors = _stored_tensors(
                build.source, build.source.config, key, build.dtype, build.compression
            )
            writing = partial / stage_file(key)
            entry = write_stage_file(writing, tensors, tail_start)
            # after the stage's file is synced: a build killed from here on keeps it
            named = {**stages, key: entry}
            progress_line = json.dumps({"identity": build.identity, "stages": named})
            atomic_write(partial / PROGRESS, progress_line)
            stages, writing = named, None
        manifest = {**build.identity, "checksum": "xxh3_64", "stages": stages}
        atomic_write(partial / MANIFEST, json.dumps(manifest, indent=1))
        (partial / PROGRESS).unlink(missing_ok=True)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            # the stages synced are kept: the same command resumes once there is room
            if writing is not None:
                writing.unlink(missing_ok=True)  # the stage cut short
            raise DiskFull(_disk_full(build, stages)) from None
        shutil.rmtree(partial, ignore_errors=True)
        raise UserError(f"cannot write the weight store in {build.nvme_dir}: {exc}") from None


def _disk_full(build: _Build, stages: dict[str, dict]) -> str:
    kept = _file_bytes(stages.values())
    return (
        f"disk full while writing the weight store in {build.nvme_dir} ({len(stages)} of "
        f"{len(build.wanted)} stages written, {size_text(kept)}, kept in "
        f"{build.partial.name}); free {size_text(build.need - kept + SPACE_MARGIN)} and run the "
        "same command again to resume, or choose another --nvme directory and delete that "
        "one (existing stores are intact)"
    )


class _StoredTensors:
    """A stage's tensors as the store holds them, in image order (`items`), made piece
    by piece where the source makes tensors alone (`layout.stage_pieces`: a mixture of
    experts' layer, tens of GB whole), else the whole stage at once."""

    def __init__(self, source: WeightSource, key: str, dtype, compression) -> None:
        self.source, self.key, self.dtype, self.compression = source, key, dtype, compression

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        cfg, cpu = self.source.config, torch.device("cpu")
        stage, index = split_key(self.key)
        layout = stage_layout(cfg, self.key, self.dtype, self.compression)
        pieces = stage_pieces(cfg, self.key) if self.source.makes_tensors_alone else None
        for names in pieces or [None]:
            if names is None:
                made = self.source.stage(stage, index, self.dtype, cpu)
            else:
                made = self.source.stored_named(stage, index, names, self.dtype, cpu)
            stored = compress_stage(made, self.compression)
            del made
            for slot in layout:  # (a piece's tensors are together, in image order)
                if slot.name in stored:
                    yield slot.name, stored[slot.name]


def _stored_tensors(
    source: WeightSource,
    cfg: ModelConfig,
    key: str,
    dtype: torch.dtype,
    compression: Compression | None,
) -> _StoredTensors:
    """A stage's tensors as the store holds them (quantized where compressed; a tied
    model's embedding leaves its table to the head)."""
    assert source.config == cfg
    return _StoredTensors(source, key, dtype, compression)


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
        path = partial / stage_file(key)
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
        made = {name: checksum(tensor_bytes(t)) for name, t in tensors.items()}
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
