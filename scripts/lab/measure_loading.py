"""Peak RSS while streaming a sharded safetensors checkpoint layer by layer.

    python scripts/lab/measure_loading.py [--layers 16] [--hidden 1024]

Builds a Llama-shaped checkpoint with transformers (sharded at 50 MB), then, in a fresh
process, loads every stage through our CheckpointSource one at a time and reports the
peak RSS growth against one layer's size and the whole checkpoint's.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile

STREAM = """
import sys, time, torch
from offload.models.resolve import resolve_model
def rss():  # this process's own high-water mark (ru_maxrss would carry the parent's over exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
spec = resolve_model(sys.argv[1]); cpu = torch.device("cpu")
base = rss(); started = time.perf_counter(); layer = 0
with spec.open_weights() as source:
    source.embed(torch.float32, cpu); source.head(torch.float32, cpu)
    for i in range(spec.config.num_layers):
        w = source.layer(i, torch.float32, cpu); layer = max(layer, sum(t.nbytes for t in w.values())); del w
print(base, rss(), layer, time.perf_counter() - started)
"""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    args = p.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=8000,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
    )
    with tempfile.TemporaryDirectory() as tmp:
        model = LlamaForCausalLM(cfg)
        total = sum(p.numel() * 4 for p in model.parameters())
        model.save_pretrained(tmp, max_shard_size="50MB")
        del model
        out = subprocess.run(
            [sys.executable, "-c", STREAM, tmp], capture_output=True, text=True, check=True
        )
        base, peak, layer, seconds = (float(x) for x in out.stdout.split())
    print(f"checkpoint {total / 1e6:.0f} MB in 50 MB shards, one layer {layer / 1e6:.0f} MB")
    print(
        f"RSS before loading {base / 1e6:.0f} MB, peak while streaming every stage {peak / 1e6:.0f} MB"
    )
    print(
        f"growth {(peak - base) / 1e6:.0f} MB = {(peak - base) / layer:.2f} layers "
        f"= {(peak - base) / total:.1%} of the checkpoint; {seconds:.2f} s"
    )


if __name__ == "__main__":
    main()
