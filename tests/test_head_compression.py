"""The LM head is compressed like the layers: its logits stay near the fp16 head's on the
real demo model (SmolLM2-135M, tied embeddings), through the executor's own stage
format (`compress_stage` -> `assemble_stage` -> `decoder.head`). The model is tied, so
the embedding reads its rows from the same compressed table (`io.layout.shares_table`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from offload.api.llm import LLM
from offload.kernels.formats import Compression
from offload.kernels.quant import assemble_stage, compress_stage
from offload.models.batch import PaddedBatch
from offload.models.shapes import stage_shapes

TEXT = Path(__file__).parent / "data" / "public_domain.txt"
# measured on this model and text (CPU, fp32, 16 lines cut at 32 tokens): relative L2
# error of the last-position logits 0.160 (int4-g64) and 0.0099 (int8-g64) with the
# embedding's rows read from the compressed table too (0.130 and 0.0078 with an fp16
# embedding); the top-1 token agrees at 11 / 16 and 14 / 16 positions (this 576-wide
# head is small and its distributions over raw text are flat). The bounds leave about
# 1.5x on the error.
BOUNDS = {4: (0.24, 0.55), 8: (0.015, 0.75)}


@pytest.fixture(scope="module")
def llm():
    with LLM("demo", device="cpu", dtype="float32") as model:
        yield model


def _last_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    runner = llm.runner
    batch = PaddedBatch(llm.config, prompts, 1, llm.config.pad_token_id or 0)
    runner.start(batch)
    return runner.forward(batch.prompt_ids, runner.step_inputs(batch, 0, batch.prompt_len))


@pytest.mark.parametrize("bits", [4, 8])
def test_compressed_head_logits_stay_near_fp16(llm, bits):
    lines = [ln for ln in TEXT.read_text().splitlines() if len(ln.split()) > 6][:16]
    prompts = [llm.tokenizer.encode(ln)[:32] for ln in lines]
    exact = _last_logits(llm, prompts)
    head, embed = llm.runner.head_w, llm.runner.embed_w
    shapes = stage_shapes(llm.config, "head")
    config = Compression(bits=bits, group_size=64)
    llm.runner.head_w = assemble_stage(compress_stage(head, config), shapes, llm.dtype, config)
    assert llm.config.tie_word_embeddings
    llm.runner.embed_w = {**embed, "tok.weight": llm.runner.head_w["lm_head.weight"]}
    try:
        assert type(llm.runner.head_w["lm_head.weight"]).__name__ == "QTensor"
        ours = _last_logits(llm, prompts)
    finally:
        llm.runner.head_w, llm.runner.embed_w = head, embed
    rel = ((ours - exact).norm() / exact.norm()).item()
    top1 = (ours.argmax(-1) == exact.argmax(-1)).float().mean().item()
    max_rel, min_top1 = BOUNDS[bits]
    assert rel <= max_rel and top1 >= min_top1, f"int{bits}: rel L2 {rel:.4f}, top-1 {top1:.3f}"
