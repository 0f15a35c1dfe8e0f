"""Small models of every supported family, built with transformers' own classes."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 320
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
_dims = {"vocab_size": VOCAB, "hidden_size": 64, "num_attention_heads": 4}
_llama_dims = {
    **_dims,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "max_position_embeddings": 256,
}

# name -> (model class, config)
CASES = {
    "llama-gqa": (
        LlamaForCausalLM,
        LlamaConfig(
            **_llama_dims, num_key_value_heads=2, rope_scaling=LLAMA3_ROPE, rope_theta=500000.0
        ),
    ),
    "llama-tied": (
        LlamaForCausalLM,
        LlamaConfig(**_llama_dims, num_key_value_heads=4, tie_word_embeddings=True),
    ),
    "qwen2-bias": (
        Qwen2ForCausalLM,
        Qwen2Config(**_llama_dims, num_key_value_heads=2, tie_word_embeddings=False),
    ),
    "mistral-window": (
        MistralForCausalLM,
        MistralConfig(**_llama_dims, num_key_value_heads=1, sliding_window=6),
    ),
    "bloom": (BloomForCausalLM, BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=3, n_head=4)),
    "bloom-5-heads": (
        BloomForCausalLM,
        BloomConfig(
            vocab_size=VOCAB,
            hidden_size=80,
            n_layer=2,
            n_head=5,
            apply_residual_connection_post_layernorm=True,
        ),
    ),
    "opt": (
        OPTForCausalLM,
        OPTConfig(**_dims, num_hidden_layers=3, ffn_dim=128, max_position_embeddings=256),
    ),
    "opt-350m-like": (
        OPTForCausalLM,
        OPTConfig(
            **_dims,
            num_hidden_layers=2,
            ffn_dim=128,
            max_position_embeddings=256,
            word_embed_proj_dim=32,
            do_layer_norm_before=False,
        ),
    ),
}

# mixtures of experts: the expert MLPs are 32 wide, a layer's dense MLP (Qwen's
# mlp_only_layers, GLM-4.5's first layer) 96
_moe_dims = {**_llama_dims, "num_key_value_heads": 2, "intermediate_size": 96}
MOE_CASES = {
    "mixtral": (
        MixtralForCausalLM,
        MixtralConfig(**{**_moe_dims, "intermediate_size": 32}, num_local_experts=4,
                      num_experts_per_tok=2),
    ),
    "qwen3-moe": (
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig(**_moe_dims, head_dim=16, moe_intermediate_size=32, num_experts=16,
                       num_experts_per_tok=4, norm_topk_prob=True, mlp_only_layers=[1]),
    ),
    "qwen2-moe": (
        Qwen2MoeForCausalLM,
        Qwen2MoeConfig(**_moe_dims, moe_intermediate_size=32, num_experts=8,
                       num_experts_per_tok=2, shared_expert_intermediate_size=48),
    ),
    "glm4-moe": (
        Glm4MoeForCausalLM,
        Glm4MoeConfig(**_moe_dims, head_dim=16, moe_intermediate_size=32, n_routed_experts=8,
                      num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                      attention_bias=True, first_k_dense_replace=1),
    ),
}  # fmt: skip
CASES.update(MOE_CASES)


def build(name: str) -> torch.nn.Module:
    cls, config = CASES[name]
    torch.manual_seed(1234)
    model = cls(config).eval()
    # Random-init norms are all ones and biases zeros: make them random too so the
    # test sees every term.
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname or pname.endswith(".bias") or "ln_" in pname:
                param.add_(torch.randn_like(param) * 0.1)
            if pname.endswith("mlp.gate.weight"):  # routers: clear margins between experts
                param.mul_(10)
        for bname, buffer in model.named_buffers():  # GLM-4.5's router score bias
            if bname.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    return model


def save(name: str, directory: Path) -> tuple[Path, torch.nn.Module]:
    model = build(name)
    model.save_pretrained(directory, max_shard_size="100KB")
    return directory, model


def hf_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """transformers' logits for a left-padded batch (positions from the mask)."""
    kwargs = {}
    if model.config.model_type not in ("bloom", "opt"):
        kwargs["position_ids"] = (mask.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask.long(), **kwargs).logits.float()


def prefill_logits(llm, prompts: list[list[int]]):
    """Our logits at every position of a left-padded batch: (logits [B, T, V], batch)."""
    from offload.models.batch import PaddedBatch

    batch = PaddedBatch(llm.config, prompts, max_new_tokens=4, pad_id=0)
    llm.runner.start(batch)
    step = llm.runner.step_inputs(batch, 0, batch.prompt_len)
    return llm.runner.forward(batch.prompt_ids, step, last_only=False).cpu(), batch


def assert_prefill_logits_match(llm, model, prompts: list[list[int]], case: str) -> None:
    """Our prefill logits on a left-padded batch against transformers', row by row."""
    ours, batch = prefill_logits(llm, prompts)
    ref = hf_logits(model, batch.prompt_ids, batch.key_valid[:, : batch.prompt_len])
    for row, prompt in enumerate(prompts):
        real = slice(batch.prompt_len - len(prompt), batch.prompt_len)
        diff = (ours[row, real] - ref[row, real]).norm() / ref[row, real].norm()
        assert diff <= 1e-4, f"{case}: prompt {row} logits differ, relative error {diff:.2e}"


def decode_logits(llm, prompts: list[list[int]], steps: int):
    """Logits [B, steps, V] of decode steps after a prefill, teacher-forced with fixed
    tokens (so two runs see the same inputs whatever they would have sampled)."""
    from offload.models.batch import PaddedBatch

    batch = PaddedBatch(llm.config, prompts, max_new_tokens=steps, pad_id=0)
    llm.runner.start(batch)
    runner = llm.runner
    runner.forward(batch.prompt_ids, runner.step_inputs(batch, 0, batch.prompt_len))
    out = []
    for i in range(steps):
        token = torch.full((len(prompts), 1), 3 + 7 * i % 50, dtype=torch.long)
        step = runner.step_inputs(batch, batch.prompt_len + i, 1)
        out.append(runner.forward(token, step).cpu())
    return torch.stack(out, dim=1)
