"""`decoder.attend` at decode shapes over an fp16 cache on the GPU: the masked path
(the bias) against `causal=True` (SDPA's flash kernel without the bias, split over the
slots, grouped-query heads in place). CUDA-graph timing (`timers.kernel_seconds`),
GB/s of K and V read, and the largest difference between the two outputs. JSON in $OUT
(or the working directory).

    python scripts/lab/attn_decode_flash.py
"""

from __future__ import annotations

import functools
import json
import os

import torch

from offload.models.attention import attend
from offload.policies.timers import kernel_seconds

# [rows, heads, KV heads, slots], head_dim 128: Llama-3.1-8B's plan at two contexts,
# the profile's two points, OPT-30B's W1c batch, a 70B-like grouped shape
SHAPES = ((24, 32, 8, 515), (24, 32, 8, 768), (4, 32, 32, 512), (32, 32, 32, 2048))
SHAPES += ((12, 56, 56, 544), (64, 64, 8, 640))


def main() -> None:
    rows = []
    for b, h, hkv, s in SHAPES:
        q = torch.randn(b, h, 1, 128, device="cuda", dtype=torch.float16)
        k = torch.randn(b, hkv, s, 128, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        bias = torch.zeros(b, 1, 1, s, device="cuda", dtype=torch.float16)
        nbytes = 2 * k.numel() * 2
        row = {"shape": [b, h, hkv, s]}
        for name, causal in (("masked", False), ("flash", True)):
            seconds = kernel_seconds(functools.partial(attend, q, k, v, bias, causal))
            row[name + "_us"] = seconds * 1e6
            row[name + "_gbps"] = nbytes / seconds / 1e9
        flash, masked = attend(q, k, v, bias, True), attend(q, k, v, bias, False)
        row["max_diff"] = (flash - masked).abs().max().item()
        rows.append(row)
        print(row, flush=True)
    out = os.path.join(os.environ.get("OUT", "."), "attn_decode_flash.json")
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
