"""Weight sources: presets, dummy weights, layer-by-layer loading memory."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from offload.cli.common import parse_size
from offload.core.config import ModelConfig
from offload.core.errors import UserError
from offload.core.presets import PRESETS, preset_for
from offload.models.resolve import resolve_model
from offload.models.shapes import stage_shapes
from offload.models.weights import DummySource

# parameters in billions, from the models' published sizes
EXPECTED_BILLIONS = {
    "bloom": 176.2,
    "opt-6.7b": 6.66,
    "opt-30b": 29.97,
    "opt-66b": 65.7,
    "opt-175b": 174.6,
    "llama-2-7b": 6.74,
    "llama-2-13b": 13.0,
    "llama-2-70b": 68.98,
    "llama-3.1-8b": 8.03,
    "llama-3.1-70b": 70.55,
    "mistral-7b": 7.25,
    "qwen2-7b": 7.62,
    "smollm2-135m-instruct": 0.1346,
    "qwen3-8b": 8.19,
    "qwen3-14b": 14.77,
    "qwen3-32b": 32.76,
    # Gemma 3's language model: the published 12.2B and 27.4B hold a 0.42B vision tower
    "gemma-3-12b": 12.19 - 0.42,
    "gemma-3-27b": 27.43 - 0.42,
    "phi-4": 14.66,
    "falcon-7b": 7.22,
    "falcon-40b": 41.84,
    "falcon-180b": 179.52,
}
EXPECTED_BILLIONS.update(  # mixtures of experts: every expert counted
    {
        "mixtral-8x7b": 46.7,
        "mixtral-8x22b": 140.6,
        "qwen3-30b-a3b": 30.5,
        "qwen3-235b-a22b": 235.1,
        "glm-4.5-air": 106.9,
        # latent attention: DeepSeek-V3 without its multi-token-prediction layer
        "deepseek-v3": 671.0,
        "kimi-k2": 1026.4,
        "deepseek-v2-lite": 15.7,
        "moonlight-16b-a3b": 16.0,
        # gpt-oss: its model card's 116.8B and 20.9B
        "gpt-oss-120b": 116.8,
        "gpt-oss-20b": 20.9,
    }
)


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_have_their_published_size(name):
    cfg = ModelConfig.from_hf(PRESETS[name], name)
    billions = cfg.param_count() / 1e9
    assert billions == pytest.approx(EXPECTED_BILLIONS[name], rel=0.01)


def test_hub_ids_map_to_presets():
    assert preset_for("bigscience/bloom") == "bloom"
    assert preset_for("facebook/OPT-30b") == "opt-30b"
    spec = resolve_model("bigscience/bloom", dummy=True)
    assert spec.kind == "dummy" and spec.config.num_layers == 70 and spec.config.family == "bloom"


def test_dummy_weights_are_deterministic_and_realistic():
    cfg = ModelConfig.from_hf(PRESETS["opt-6.7b"], "opt-6.7b")
    cpu = torch.device("cpu")
    first = DummySource(cfg, seed=3).layer(5, torch.float32, cpu)
    again = DummySource(cfg, seed=3).layer(5, torch.float32, cpu)
    other = DummySource(cfg, seed=3).layer(6, torch.float32, cpu)
    assert set(first) == set(stage_shapes(cfg, "layer"))
    for name, tensor in first.items():
        assert torch.equal(tensor, again[name])
        assert not torch.equal(tensor, other[name])
        assert tensor.std() > 0
    fan_in = cfg.hidden_size
    assert first["qkv.weight"].std().item() == pytest.approx(fan_in**-0.5, rel=0.01)
    assert first["attn_norm.weight"].mean().item() == pytest.approx(1.0, abs=0.01)


def test_sizes_parse():
    assert parse_size("24GB") == 24 * 10**9
    assert parse_size("24GiB") == 24 * 2**30
    assert parse_size("512MB") == 512 * 10**6
    assert parse_size("1.5 TB") == 1.5e12
    assert parse_size("1000B") == parse_size(1000) == 1000
    for bad in ("abc", "-5GB", "12 parsecs", ""):
        with pytest.raises(UserError, match="cannot parse size"):
            parse_size(bad)
    # `--gpu-mem 24` meant 24 GB: a number without a unit is refused, naming the fix
    with pytest.raises(UserError, match=r"'24' .*has no unit; write 24GB"):
        parse_size("24", "--gpu-mem")
    assert parse_size("0") == 0  # (refused by the caps' own check, "must be more than 0")


LOAD_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from offload.models.resolve import resolve_model
    def hwm():  # this process's high-water mark (ru_maxrss carries the parent's over exec)
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    spec = resolve_model(sys.argv[1])
    cpu = torch.device("cpu")
    with spec.open_weights() as source:
        source.embed(torch.float32, cpu)
        base = hwm()
        layer_bytes = 0
        for i in range(spec.config.num_layers):
            weights = source.layer(i, torch.float32, cpu)
            layer_bytes = max(layer_bytes, sum(t.nbytes for t in weights.values()))
            del weights
    peak = hwm()
    print(peak - base, layer_bytes)
    """
)


def test_sharded_checkpoint_loads_layer_by_layer(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=16,
        num_attention_heads=12,
        num_key_value_heads=12,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path, max_shard_size="20MB")
    total = sum(p.numel() * 4 for p in model.parameters())
    del model
    result = subprocess.run(
        [sys.executable, "-c", LOAD_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    growth, layer_bytes = map(int, result.stdout.split())
    assert total > 12 * layer_bytes
    # Streaming all 16 layers grows peak RSS by one layer's tensors, their concatenation
    # temporaries and the mapped pages of the shards it spans (20 MB each), not the model.
    assert growth < 4 * layer_bytes + 2 * 20e6, (growth, layer_bytes, total)
    assert growth < total / 3
