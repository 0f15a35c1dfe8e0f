"""A tensor-parallel rank makes only its own shard: it reads only its slices of a
safetensors checkpoint, and draws only its tiles of dummy weights (on its own device);
either way the shard is the whole tensor's part."""

from __future__ import annotations

import pytest
import torch

from offload.core.config import ModelConfig
from offload.models.checkpoint import CheckpointSource
from offload.models.resolve import resolve_model
from offload.models.weights import DummySource
from offload.parallel.shard import RankShard, ShardSource

CPU = torch.device("cpu")


def _stages(source, cfg):
    yield "embed", source.stage("embed", 0, torch.float32, CPU)
    for i in range(cfg.num_layers):
        yield f"layer.{i}", source.stage("layer", i, torch.float32, CPU)
    yield "head", source.stage("head", 0, torch.float32, CPU)


@pytest.mark.parametrize("family", ["opt", "llama-gqa", "bloom", "falcon-40b-like"])
def test_a_rank_reads_only_its_slices_of_the_checkpoint(family, tiny_checkpoints):
    directory = tiny_checkpoints[family][0]
    cfg = resolve_model(str(directory)).config
    whole = CheckpointSource(directory, cfg)
    full = dict(_stages(whole, cfg))
    for rank in range(2):
        shard = RankShard.of(cfg, 2, rank)
        inner = CheckpointSource(directory, cfg)
        read = 0
        for key, weights in _stages(ShardSource(inner, shard), cfg):
            want = shard.stage(key.partition(".")[0], full[key])
            assert weights.keys() == want.keys(), key
            for name, tensor in weights.items():
                assert torch.equal(tensor, want[name]), (family, rank, key, name)
            zeros = {n for n, p in shard.parts(key.partition(".")[0]).items() if p.zeros}
            read += sum(t.nbytes for n, t in weights.items() if n not in zeros)
            if key == "head" and cfg.tie_word_embeddings:  # its table came with the embed stage
                read += sum(t.nbytes for n, t in full["embed"].items() if n != "tok.weight")
        # the bytes the checkpoint handed out are exactly the shard's (fp32 files)
        assert inner.reader.bytes_read == read, (family, rank)
        assert read < 0.62 * whole.reader.bytes_read, (family, rank, read)


def test_a_rank_draws_only_its_tiles_of_dummy_weights_on_its_device():
    """Dummy tensors are drawn in tiles with seeds of their own: a rank's part, drawn
    alone, is the whole tensor's part, where the ranges cut across tiles."""
    cfg = ModelConfig("tiles", "llama", 1280, 1280, 1, 10, 10, 128, 2624, 3000, 1e-5)
    whole = DummySource(cfg, seed=3)
    for rank in range(2):
        shard = RankShard.of(cfg, 2, rank)
        source = ShardSource(DummySource(cfg, seed=3), shard)
        assert source.draws_on_device  # (`WeightHomes` draws it on the rank's GPU)
        for stage in ("embed", "layer", "head"):
            want = shard.stage(stage, whole.stage(stage, 0, torch.float32, CPU))
            have = source.stage(stage, 0, torch.float32, CPU)
            for name, tensor in have.items():
                assert torch.equal(tensor, want[name]), (rank, stage, name)
