"""Tiered I/O: pinned pool, weight store, async reader (CPU; the same code runs on CUDA)."""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from offload.core.config import ModelConfig
from offload.core.errors import UserError
from offload.core.presets import PRESETS
from offload.io import store as store_mod
from offload.io.layout import stage_cuts, stage_image_bytes, stage_keys, store_bytes
from offload.io.pinned import PinnedPool, PoolExhausted
from offload.io.reader import CorruptExtent, ExtentReader
from offload.io.store import ensure_store
from offload.io.store_format import WeightStore, store_dir, write_stage_file
from offload.io.store_source import StoreSource
from offload.models.weights import DummySource
from offload.policies.memory import weight_plan
from offload.policies.policy import Placement, Policy

CPU = torch.device("cpu")


def tiny_config(**extra) -> ModelConfig:
    hf = {
        **PRESETS["llama-2-7b"],
        "hidden_size": 96,
        "intermediate_size": 200,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 333,
        **extra,
    }
    return ModelConfig.from_hf(hf, "tiny-io")


def _read_all(store: WeightStore, key: str, reader: ExtentReader, pool: PinnedPool):
    out = {}
    for extent in store.extents(key):
        with pool.alloc(extent.padded) as block:
            load = reader.submit(extent, block).result()
            out[extent.name] = load.host_view().clone()
    return out


def test_bitwise_round_trip_of_every_dtype(tmp_path):
    tensors = {
        "f32": torch.randn(1001, 3),
        "bf16": torch.randn(4097).to(torch.bfloat16),
        "f16": torch.randn(3, 5, 7).to(torch.float16),
        "i8": torch.randint(-128, 127, (12345,), dtype=torch.int8),
        "int4_packed": torch.randint(0, 255, (2049, 33), dtype=torch.uint8),
        "tiny": torch.tensor([1.5]),
    }
    entry = write_stage_file(tmp_path / "stage.bin", tensors)
    assert all(t["offset"] % 4096 == 0 for t in entry["tensors"].values())
    assert os.path.getsize(tmp_path / "stage.bin") % 4096 == 0
    store = WeightStore(tmp_path, {"dtype": "float32", "stages": {"s": entry}})
    with PinnedPool(2**22) as pool, ExtentReader(threads=3) as reader:
        back = _read_all(store, "s", reader, pool)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and back[name].shape == tensor.shape
        assert torch.equal(back[name].view(torch.uint8), tensor.view(torch.uint8)), name


def test_store_round_trip_equals_the_source_and_is_reused(tmp_path):
    cfg = tiny_config()
    source = DummySource(cfg, seed=5)
    store = ensure_store(source, tmp_path, torch.bfloat16)
    mtime = (store.directory / "manifest.json").stat().st_mtime_ns
    assert ensure_store(source, tmp_path, torch.bfloat16).directory == store.directory
    assert (store.directory / "manifest.json").stat().st_mtime_ns == mtime, "store was rebuilt"
    with PinnedPool(2**24) as pool, ExtentReader(threads=4) as reader:
        from_store = StoreSource(cfg, store, pool, reader)
        for stage, index in [("embed", 0), ("layer", 0), ("layer", 2), ("head", 0)]:
            want = source.stage(stage, index, torch.bfloat16, CPU)
            got = from_store.stage(stage, index, torch.bfloat16, CPU)
            assert want.keys() == got.keys()
            for name in want:
                assert torch.equal(want[name], got[name]), (stage, index, name)
        assert pool.stats()["reserved_bytes"] == 0, "staging blocks leaked"


def test_stage_file_from_a_tail_start_holds_the_image_from_there(tmp_path):
    tensors = {"a": torch.randn(3000), "b": torch.randn(50, 70), "c": torch.randn(5)}
    whole = write_stage_file(tmp_path / "whole.bin", tensors)
    tail = write_stage_file(tmp_path / "tail.bin", tensors, tail_start=8192)  # inside "a"
    assert (tmp_path / "tail.bin").read_bytes() == (tmp_path / "whole.bin").read_bytes()[8192:]
    # image offsets and whole-tensor checksums, as in a whole store
    assert tail["tensors"] == whole["tensors"]
    assert (tail["tail_start"], tail["size"]) == (8192, whole["size"])
    store = WeightStore(tmp_path, {"dtype": "float32", "stages": {"s": tail}})
    with PinnedPool(2**20) as pool, ExtentReader() as reader:
        back = _read_all(store, "s", reader, pool)
    assert set(back) == {"b", "c"}, "only the tensors the file holds whole are extents"
    for name, tensor in back.items():
        assert torch.equal(tensor, tensors[name]), name


W30 = Placement(0.3, 0.4, 0.3)


def _file_sizes(store: WeightStore, cfg: ModelConfig) -> dict[str, int]:
    return {key: store.path(key).stat().st_size for key in stage_keys(cfg)}


def test_store_for_a_policy_holds_only_the_tails_on_disk(tmp_path):
    cfg, dtype = tiny_config(), torch.float16
    store = ensure_store(DummySource(cfg, seed=5), tmp_path, dtype, placement=W30)
    files = _file_sizes(store, cfg)
    cuts = stage_cuts(cfg, dtype, None, W30)
    sizes = stage_image_bytes(cfg, dtype)
    for key, (_, cpu_end), size in zip(stage_keys(cfg), cuts, sizes, strict=True):
        assert store.tail_start(key) == cpu_end, key
        assert files[key] == size - cpu_end, key
    on_disk = sum(files.values())
    assert on_disk == store_bytes(cfg, dtype, None, W30) == store.file_bytes()
    assert on_disk == weight_plan(cfg, Policy(1, 1, weights=W30), dtype)["weights_disk"]
    assert on_disk < 0.3 * store_bytes(cfg, dtype, None), "the store holds more than the tails"
    assert not store.whole
    with (
        PinnedPool(4096) as pool,
        ExtentReader() as reader,
        pytest.raises(UserError, match="offload-convert writes a whole one"),
    ):
        StoreSource(cfg, store, pool, reader)


def test_replan_with_less_on_disk_reuses_the_store_and_more_rebuilds_it(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=store_mod.__name__)
    cfg, dtype, source = tiny_config(), torch.float16, DummySource(tiny_config(), seed=5)
    store = ensure_store(source, tmp_path, dtype, placement=W30)
    manifest = store.directory / "manifest.json"
    mtime = manifest.stat().st_mtime_ns
    caplog.clear()
    less = ensure_store(source, tmp_path, dtype, placement=Placement(0.3, 0.6, 0.1))
    assert manifest.stat().st_mtime_ns == mtime and less.manifest == store.manifest
    assert "reusing weight store" in caplog.text and "writing" not in caplog.text
    caplog.clear()
    more_on_disk = Placement(0.1, 0.3, 0.6)
    more = ensure_store(source, tmp_path, dtype, placement=more_on_disk)
    assert manifest.stat().st_mtime_ns != mtime
    assert "holds less of the stages" in caplog.text and "writing weight store" in caplog.text
    assert sum(_file_sizes(more, cfg).values()) == store_bytes(cfg, dtype, None, more_on_disk)
    # a whole store (offload-convert's) serves every plan
    whole = ensure_store(source, tmp_path, dtype)
    assert whole.whole and whole.file_bytes() == store_bytes(cfg, dtype, None)
    mtime = manifest.stat().st_mtime_ns
    ensure_store(source, tmp_path, dtype, placement=Placement(0.0, 0.0, 1.0))
    assert manifest.stat().st_mtime_ns == mtime
    # a version 1 store (no tail_start) is whole
    old = {**json.loads(manifest.read_text()), "format_version": 1}
    for stage in old["stages"].values():
        del stage["tail_start"]
    manifest.write_text(json.dumps(old))
    assert WeightStore.open(whole.directory, cfg, dtype).whole


def test_truncated_tail_file_is_detected_and_rebuilt(tmp_path, caplog):
    cfg, dtype, source = tiny_config(), torch.float16, DummySource(tiny_config(), seed=5)
    store = ensure_store(source, tmp_path, dtype, placement=W30)
    victim = store.path("layer.1")
    os.truncate(victim, victim.stat().st_size - 4096)
    with pytest.raises(UserError, match=r"missing or truncated; delete .* to rebuild"):
        WeightStore.open(store.directory, cfg, dtype)
    rebuilt = ensure_store(source, tmp_path, dtype, placement=W30)
    assert "truncated" in caplog.text
    assert _file_sizes(rebuilt, cfg) == _file_sizes(store, cfg)


def test_many_concurrent_reads(tmp_path):
    tensors = {f"t{i}": torch.randn(random.randint(1, 300_000)) for i in range(64)}
    entry = write_stage_file(tmp_path / "s.bin", tensors)
    store = WeightStore(tmp_path, {"dtype": "float32", "stages": {"s": entry}})
    with PinnedPool(80 * 2**20) as pool, ExtentReader(threads=8) as reader:
        extents = store.extents("s")
        blocks = [pool.alloc(e.padded) for e in extents]
        futures = [reader.submit(e, b) for e, b in zip(extents, blocks, strict=True)]
        for future in futures:
            load = future.result(timeout=60)
            assert torch.equal(load.host_view(), tensors[load.extent.name])
        for block in blocks:
            block.free()


def test_flipped_byte_is_detected_and_named(tmp_path):
    entry = write_stage_file(
        tmp_path / "s.bin", {"w": torch.randn(5000), "victim": torch.randn(3000)}
    )
    offset = entry["tensors"]["victim"]["offset"] + 123
    with open(tmp_path / "s.bin", "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
    store = WeightStore(tmp_path, {"dtype": "float32", "stages": {"s": entry}})
    with PinnedPool(2**20) as pool, ExtentReader() as reader:
        with pytest.raises(CorruptExtent, match=r"s\.bin.*s/victim"):
            _read_all(store, "s", reader, pool)
        # verification off: the read completes (what the flag is for)
        reader.verify = False
        _read_all(store, "s", reader, pool)


def test_truncated_extent_is_an_error(tmp_path):
    entry = write_stage_file(tmp_path / "s.bin", {"w": torch.randn(50_000)})
    os.truncate(tmp_path / "s.bin", 8192)
    store = WeightStore(tmp_path, {"dtype": "float32", "stages": {"s": entry}})
    with (
        PinnedPool(2**20) as pool,
        ExtentReader() as reader,
        pytest.raises(CorruptExtent, match="truncated"),
    ):
        _read_all(store, "s", reader, pool)


def test_killed_conversion_leaves_no_loadable_store_and_the_next_resumes(tmp_path, caplog):
    cfg = ModelConfig.from_hf(PRESETS["smollm2-135m-instruct"], "smollm2-135m-instruct")
    target = store_dir(tmp_path, cfg, torch.float32)
    partial = target.with_name(target.name + ".partial")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "offload.cli.convert",
            "--model",
            "smollm2-135m-instruct",
            "--dummy",
            "--nvme",
            str(tmp_path),
            "--dtype",
            "float32",
            "--quiet",
        ],
    )
    deadline = time.time() + 120
    while time.time() < deadline and len(list(partial.glob("layer_*.bin"))) < 3:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(list(partial.glob("layer_*.bin"))) >= 3, "conversion finished or never started"
    with pytest.raises(UserError, match="not a complete weight store"):
        WeightStore.open(target, cfg, torch.float32)
    assert not target.exists()
    # the next build keeps what the killed one synced, and writes the rest
    kept = {path.name: path.stat().st_mtime_ns for path in partial.glob("layer_*.bin")}
    with caplog.at_level(logging.INFO, logger="offload.io.store"):
        store = ensure_store(DummySource(cfg), tmp_path, torch.float32)
    assert "stages already written" in caplog.text
    assert store.directory == target and store.whole
    same = [name for name, ns in kept.items() if (target / name).stat().st_mtime_ns == ns]
    assert len(same) >= len(kept) - 1  # (the stage being written when killed is redone)


class _Killed(Exception):
    """Stands in for a kill -9 in the middle of a store's build: nothing is cleaned up."""


class _CountingSource(DummySource):
    """DummySource that records each stage it makes, and is killed before the
    `killed_after` + 1-th."""

    def __init__(self, cfg: ModelConfig, seed: int, killed_after: int | None = None) -> None:
        super().__init__(cfg, seed=seed)
        self.made: list[tuple[str, int]] = []
        self.killed_after = killed_after

    def stage(self, stage, index, dtype, device):
        if self.killed_after is not None and len(self.made) == self.killed_after:
            raise _Killed
        self.made.append((stage, index))
        return super().stage(stage, index, dtype, device)


def test_a_killed_store_build_resumes_from_the_stages_it_wrote(tmp_path, caplog):
    """A 176B store takes long to write: a build killed half-way keeps the stages it
    synced, and the next build writes only the rest (making one kept stage again to check
    the weights are the same), into the same store a build in one go writes."""
    cfg = tiny_config(num_hidden_layers=6)
    stages = len(stage_keys(cfg))  # embed, 6 layers, head
    once = store_mod.convert(DummySource(cfg, seed=3), tmp_path / "once", torch.float16)
    with pytest.raises(_Killed):
        store_mod.convert(_CountingSource(cfg, 3, killed_after=4), tmp_path / "two", torch.float16)
    resumed = _CountingSource(cfg, 3)
    with caplog.at_level(logging.INFO, logger="offload.io.store"):
        twice = store_mod.convert(resumed, tmp_path / "two", torch.float16)
    assert f"4 of {stages} stages already written" in caplog.text
    assert len(resumed.made) == stages - 4 + 1
    assert sorted(p.name for p in twice.iterdir()) == sorted(p.name for p in once.iterdir())
    for path in once.iterdir():
        assert (twice / path.name).read_bytes() == path.read_bytes(), path.name
    assert WeightStore.open(twice, cfg, torch.float16).manifest == json.loads(
        (once / "manifest.json").read_text()
    )


def test_a_killed_build_over_other_weights_of_the_same_model_starts_over(tmp_path, caplog):
    """Another checkpoint of the same configuration (here another seed) shares the store's
    directory name: its build keeps none of the killed build's stages."""
    cfg = tiny_config()
    with pytest.raises(_Killed):
        store_mod.convert(_CountingSource(cfg, 3, killed_after=3), tmp_path, torch.float16)
    other = _CountingSource(cfg, 4)
    with caplog.at_level(logging.WARNING, logger="offload.io.store"):
        directory = store_mod.convert(other, tmp_path, torch.float16)
    assert "differ from the killed build's" in caplog.text
    assert len(other.made) == 1 + len(stage_keys(cfg))  # the check, then every stage
    with PinnedPool(2**24) as pool, ExtentReader(threads=2) as reader:
        from_store = StoreSource(cfg, WeightStore.open(directory, cfg, torch.float16), pool, reader)
        want = DummySource(cfg, seed=4).stage("layer", 1, torch.float16, CPU)
        got = from_store.stage("layer", 1, torch.float16, CPU)
        assert all(torch.equal(want[name], got[name]) for name in want)


def test_full_disk_gives_a_clear_error_keeps_the_old_store_and_resumes(
    tmp_path, monkeypatch, caplog
):
    cfg = tiny_config()
    old = ensure_store(DummySource(cfg, seed=1), tmp_path, torch.float16)
    real_fsync = os.fsync

    def fsync_that_fills(fd):  # the disk fills as the second layer's file is synced
        if os.readlink(f"/proc/self/fd/{fd}").endswith("layer_0001.bin"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(store_mod.os, "fsync", fsync_that_fills)
    with pytest.raises(
        UserError, match=r"disk full .*2 of 5 stages written.*run the same command again to resume"
    ):
        store_mod.convert(DummySource(cfg, seed=2), tmp_path, torch.float16)
    monkeypatch.undo()
    reopened = WeightStore.open(old.directory, cfg, torch.float16)
    assert reopened.manifest == old.manifest
    # the stage written is kept (the one cut short is not), and the next build resumes
    (partial,) = tmp_path.glob("*.partial")
    assert sorted(p.name for p in partial.glob("*.bin")) == ["embed.bin", "layer_0000.bin"]
    with caplog.at_level(logging.INFO, logger="offload.io.store"):
        new = store_mod.convert(DummySource(cfg, seed=2), tmp_path, torch.float16)
    assert "2 of 5 stages already written" in caplog.text
    fresh = store_mod.convert(DummySource(cfg, seed=2), tmp_path / "fresh", torch.float16)
    assert json.loads((new / "manifest.json").read_text()) == json.loads(
        (fresh / "manifest.json").read_text()
    )
    assert not list(tmp_path.glob("*.partial"))


def test_free_space_is_checked_before_writing(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**6, 0, 10**6))
    # the message prints the margin the check adds, so its numbers add up
    margin = f"a margin of {store_mod.SPACE_MARGIN / 1e6:.1f} MB"
    with pytest.raises(UserError, match=f"has 1.0 MB free; the weight store needs .* and {margin}"):
        store_mod.convert(DummySource(tiny_config()), tmp_path, torch.float16)
    assert list(tmp_path.iterdir()) == []


def test_mismatching_store_is_refused_by_open(tmp_path):
    cfg = tiny_config()
    store = ensure_store(DummySource(cfg), tmp_path, torch.float16)
    with pytest.raises(UserError, match="dtype"):
        WeightStore.open(store.directory, cfg, torch.bfloat16)


def test_pool_allocator_never_overlaps_and_coalesces():
    rng = random.Random(0)
    with PinnedPool(2**20) as pool:
        live = []
        for _ in range(2000):
            if live and (rng.random() < 0.5 or len(live) > 30):
                live.pop(rng.randrange(len(live))).free()
            else:
                try:
                    live.append(pool.alloc(rng.randint(1, 60_000)))
                except PoolExhausted:
                    continue
            spans = sorted((b.offset, b.offset + b.reserved) for b in live)
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), "blocks overlap"
            assert all(b.offset % 4096 == 0 for b in live)
        for block in live:
            block.free()
        stats = pool.stats()
        assert stats["free_blocks"] == 1 and stats["reserved_bytes"] == 0


def test_pool_exhaustion_is_a_clear_error_not_a_hang():
    with PinnedPool(10 * 4096) as pool:
        held = pool.alloc(8 * 4096)
        start = time.perf_counter()
        with pytest.raises(PoolExhausted, match="raise --cpu-mem"):
            pool.alloc(3 * 4096)
        assert time.perf_counter() - start < 1
        held.free()
        pool.alloc(10 * 4096).free()


def test_pool_waste_is_alignment_only():
    with PinnedPool(2**30) as pool:
        sizes = [7168 * 7168 * 2, 28672 * 7168 * 2, 7168 * 2, 3 * 7168 * 7168 * 2]
        blocks = [pool.alloc(s) for s in sizes]
        stats = pool.stats()
        assert stats["requested_bytes"] == sum(sizes)
        assert stats["alignment_waste_bytes"] < 4096 * len(sizes)
        for b in blocks:
            b.free()


def test_spill_round_trip_at_aligned_offsets(tmp_path):
    from offload.io.spill import SpillFile

    with PinnedPool(2**22) as pool, SpillFile(tmp_path, 2**21) as spill:
        data = torch.randn(3 * 4096 // 2).to(torch.float16)
        with pool.alloc(data.nbytes) as src, pool.alloc(data.nbytes) as dst:
            src.view(torch.float16, tuple(data.shape)).copy_(data)
            spill.write(8192, src.tensor)
            spill.read(8192, dst.tensor)
            assert torch.equal(dst.view(torch.float16, tuple(data.shape)), data)
        # several pieces at once, one of them several chunks long
        sizes = [(0, 4096), (3 * 4096, 2**20 + 2 * 4096), (2**21 - 4096, 4096)]
        with pool.alloc(sum(n for _, n in sizes)) as src, pool.alloc(src.reserved) as dst:
            src.tensor.copy_(torch.randint(0, 256, (src.reserved,), dtype=torch.uint8))
            spans, at = [], 0
            for offset, n in sizes:
                spans.append((offset, slice(at, at + n)))
                at += n
            spill.transfer([(o, src.tensor[part]) for o, part in spans], write=True)
            spill.transfer([(o, dst.tensor[part]) for o, part in reversed(spans)], write=False)
            assert torch.equal(dst.tensor[:at], src.tensor[:at])
        path = spill.path
        assert path.exists()
    assert not path.exists(), "spill file left behind"


def test_a_tied_models_store_holds_its_table_once_and_an_older_one_is_rebuilt(tmp_path, caplog):
    """The table lives in the head's image (`io.layout.shares_table`): the embedding's
    image has none, the store writes it once, and reading the store back still gives the
    source's embedding. A store written before (format 2) holds it twice: rebuilt."""
    cfg = tiny_config(tie_word_embeddings=True)
    untied = tiny_config()
    assert cfg.tie_word_embeddings and not untied.tie_word_embeddings
    dtype, table = torch.bfloat16, cfg.vocab_size * cfg.embed_dim * 2
    tied_sizes, untied_sizes = (stage_image_bytes(c, dtype) for c in (cfg, untied))
    assert tied_sizes[0] == 0 and untied_sizes[0] >= table  # this Llama embeds nothing else
    assert tied_sizes[1:] == untied_sizes[1:]
    source = DummySource(cfg, seed=3)
    store = ensure_store(source, tmp_path, dtype)
    assert store.file_bytes() == sum(tied_sizes)
    assert "lm_head.weight" in store.manifest["stages"]["head"]["tensors"]
    assert store.manifest["stages"]["embed"]["tensors"] == {}
    with PinnedPool(2**24) as pool, ExtentReader(threads=2) as reader:
        got = StoreSource(cfg, store, pool, reader).stage("embed", 0, dtype, CPU)
    assert torch.equal(got["tok.weight"], source.stage("embed", 0, dtype, CPU)["tok.weight"])
    manifest = store.directory / "manifest.json"
    older = {**json.loads(manifest.read_text()), "format_version": 2}
    manifest.write_text(json.dumps(older))
    with pytest.raises(UserError, match="holds the tied embedding twice"):
        WeightStore.open(store.directory, cfg, dtype)
    caplog.set_level(logging.WARNING)
    rebuilt = ensure_store(source, tmp_path, dtype)
    assert "rebuilding weight store" in caplog.text
    assert json.loads((rebuilt.directory / "manifest.json").read_text())["format_version"] == 3
