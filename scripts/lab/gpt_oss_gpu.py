"""gpt-oss on a GPU: the tiny model of tests/test_gpt_oss.py against transformers on
CUDA in float32 (plain and offloaded, bf16 and MXFP4 experts), then gpt-oss-20b with
dummy MXFP4 weights through a searched plan (`--gpu-mem 24GB`): tokens a second beside
the plan's prediction. JSON to $OUT/gpt_oss_gpu.json."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import _path  # noqa: F401
import torch

from offload.api.llm import LLM
from offload.core.sampling import SamplingParams
from tests import test_gpt_oss as t


def tiny(record: dict) -> None:
    root = Path(tempfile.mkdtemp())
    model = t._model()
    model.save_pretrained(root / "bf16")
    t.save_byte_tokenizer(root / "bf16")
    (root / "mx").mkdir()
    packed = t._write_mxfp4(model, root / "mx")
    del packed
    want = t._reference(model.cuda())
    for name in ("bf16", "mx"):
        directory = str(root / name)
        plain = LLM(directory, device="cuda", dtype="float32", batch_size=8)
        ours = t._tokens(plain)
        if name == "bf16":
            # transformers ran on the GPU: the same tokens up to GPU rounding
            record["tiny_bf16_vs_transformers_cuda"] = ours == [
                w[: len(o)] for w, o in zip(want, ours, strict=True)
            ]
        with LLM(directory, device="cuda", dtype="float32", policy=t.SPLIT,
                 nvme=root / f"nvme-{name}") as llm:  # fmt: skip
            record[f"tiny_{name}_offloaded_equals_plain"] = t._tokens(llm) == ours


def big(record: dict, preset: str, gpu_mem: str) -> None:
    from offload.api.args import parse_size
    from offload.policies.caps import Caps

    started = time.perf_counter()
    profile = Path(__file__).parents[2] / "benchmarks/results/profile_h100_20261127-0727.json"
    llm = LLM(preset, dummy=True, caps=Caps(parse_size(gpu_mem)), prompt_len=512, gen_len=16,
              dtype="bfloat16", profile=profile)  # fmt: skip
    load_s = time.perf_counter() - started
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(512)] for i in range(llm.policy.block_size)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    s = llm.stats
    record[preset] = {
        "policy": llm.policy.to_dict(),
        "load_s": load_s,
        "sequences": len(outs),
        "prefill_s": s.prefill_seconds,
        "decode_s": s.decode_seconds,
        "tok_s": s.tokens_per_second,
        "predicted": str(llm.plan.prediction),
        "peak_gpu_gb": torch.cuda.max_memory_allocated() / 1e9,
        "distinct_tokens": len({tok for o in outs for tok in o.token_ids}),
    }


if __name__ == "__main__":
    record: dict = {"device": torch.cuda.get_device_name()}
    out = Path(os.environ.get("OUT", ".")) / "gpt_oss_gpu.json"
    try:
        tiny(record)
        print(json.dumps(record), flush=True)
        preset = sys.argv[1] if len(sys.argv) > 1 else "gpt-oss-20b"
        if preset != "tiny":  # (tiny: the CUDA checks alone)
            big(record, preset, "24GB")
    finally:
        out.write_text(json.dumps(record, indent=1, default=str))
        print(json.dumps(record, default=str), flush=True)
