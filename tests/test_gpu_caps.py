"""A GPU cap a real card of that size can hold (marked `gpu`): by default the engine
holds the caching allocator to the cap, so its reserved bytes (what nvidia-smi shows,
with the CUDA context) stay within it, compressed or not."""

from __future__ import annotations

import pytest
import torch

from offload.api.llm import LLM
from offload.core.config import ModelConfig
from offload.core.presets import PRESETS
from offload.core.sampling import SamplingParams
from offload.kernels.formats import Compression
from offload.policies.caps import Baseline, Caps, cuda_context_bytes, peak_bytes
from offload.policies.memory import plan_memory
from offload.policies.policy import Placement, Policy

pytestmark = pytest.mark.gpu

INT4 = Compression(4, 64, False)
PLANS = {
    # every weight and the KV on the GPU in int4, decode replayed from graphs (W1c's kind)
    "int4": Policy(16, 1, weight_compression=INT4, kv_compression=INT4),
    # half the float16 weights streamed from pinned memory, the KV on the GPU
    "float16": Policy(8, 2, weights=Placement(0.5, 0.5, 0.0)),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_reserved_bytes_stay_within_the_gpu_cap_under_the_default_hold(name):
    """Llama-3.1-8B's dummy weights under a cap 256 MiB above the plan's GPU peak (with
    what this process holds already): the allocator is held without asking, a block
    runs, and the peak of reserved bytes with the context is within the cap."""
    cuda, policy, prompt, new = torch.device("cuda"), PLANS[name], 128, 16
    torch.cuda.empty_cache()
    cfg = ModelConfig.from_hf(PRESETS["llama-3.1-8b"], "llama-3.1-8b")
    plan = plan_memory(cfg, policy, torch.float16, prompt, new)
    others = torch.cuda.memory_reserved(cuda)  # what other tests of this process hold
    cap = peak_bytes(plan, Baseline.measure(cuda))[0] + others + (256 << 20)
    torch.cuda.reset_peak_memory_stats(cuda)
    prompts = [[5 + row] * prompt for row in range(policy.block_size)]
    with LLM(
        "llama-3.1-8b",
        device="cuda",
        dtype="float16",
        policy=policy,
        caps=Caps(gpu_bytes=cap),
        prompt_len=prompt,
        gen_len=new,
    ) as llm:
        assert llm.holds_gpu_allocator
        llm.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True))
        reserved = torch.cuda.max_memory_reserved(cuda) + cuda_context_bytes(cuda)
        assert reserved <= cap, f"{reserved / 1e9:.2f} GB reserved, cap {cap / 1e9:.2f} GB"
