"""Small models of every supported family, built with transformers' own classes."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    FalconConfig,
    FalconForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
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
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
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

# the families beyond Llama, BLOOM and OPT: each variant field of `ModelConfig` is on
# in at least one case
FAMILY_CASES = {
    # q/k norms, head_dim * heads != hidden
    "qwen3": (
        Qwen3ForCausalLM,
        Qwen3Config(**_llama_dims, num_key_value_heads=2, head_dim=32),
    ),
    # local layers with a window of 4 and their own RoPE base, global ones with linear
    # scaling, a query scale of 24 ** -0.5 over 16 channels, scaled embeddings, sandwich
    # norms, (1 + w) norms, q/k norms, final soft-capping
    "gemma3": (
        Gemma3ForCausalLM,
        Gemma3TextConfig(
            **_llama_dims,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=4,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
            final_logit_softcapping=2.0,
            pad_token_id=0,
        ),
    ),
    # Gemma 2: soft-capped attention scores and logits (weights scaled past the caps:
    # `WEIGHT_SCALES`), alternating local and global layers, no q/k norms
    "gemma2": (
        Gemma2ForCausalLM,
        Gemma2Config(
            **_llama_dims,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=5,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=8.0,
            final_logit_softcapping=25.0,
            pad_token_id=0,
        ),
    ),
    # Gemma 2's layout with its attention soft-capping turned off
    "gemma2-no-attn-softcap": (
        Gemma2ForCausalLM,
        Gemma2Config(
            **_llama_dims,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=5,
            attn_logit_softcapping=None,
            final_logit_softcapping=1.5,
            pad_token_id=0,
        ),
    ),
    # fused qkv and gate-up, LongRoPE (the short factors at these lengths: a step past
    # 32 positions takes the long ones, `test_families`), rotary over 3/4 of a head
    "phi3-longrope": (
        Phi3ForCausalLM,
        Phi3Config(
            **_llama_dims,
            num_key_value_heads=2,
            original_max_position_embeddings=32,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.1 * i for i in range(6)],
                "long_factor": [2.0 + 0.3 * i for i in range(6)],
            },
            partial_rotary_factor=0.75,
            pad_token_id=0,
            eos_token_id=2,
        ),
    ),
    # Falcon-7B's layout: multi-query attention beside the MLP, one shared norm (with
    # biases, which 7B lacks, so they are checked too)
    "falcon-7b-like": (
        FalconForCausalLM,
        FalconConfig(**_dims, num_hidden_layers=3, bias=True, ffn_hidden_size=96),
    ),
    # Falcon-40B's: new_decoder_architecture, 8 query heads in 2 KV groups, two norms
    "falcon-40b-like": (
        FalconForCausalLM,
        FalconConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            num_attention_heads=8,
            num_kv_heads=2,
            num_hidden_layers=3,
            new_decoder_architecture=True,
            tie_word_embeddings=False,
        ),
    ),
}

# (name, parameter name suffix) -> the factor random weights are multiplied by: scores
# and logits well past a soft-capping model's caps (a random model's are far below)
WEIGHT_SCALES = {
    "gemma2": {"embed_tokens.weight": 40.0, "q_proj.weight": 40.0, "k_proj.weight": 40.0},
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
    **FAMILY_CASES,
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
            for suffix, factor in WEIGHT_SCALES.get(name, {}).items():
                if pname.endswith(suffix):
                    param.mul_(factor)
        for bname, buffer in model.named_buffers():  # GLM-4.5's router score bias
            if bname.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    return model


def save(name: str, directory: Path) -> tuple[Path, torch.nn.Module]:
    model = build(name)
    model.save_pretrained(directory, max_shard_size="100KB")
    save_byte_tokenizer(directory)
    return directory, model


def save_byte_tokenizer(directory: Path) -> None:
    """A Hugging Face tokenizer whose token ids are the text's UTF-8 bytes (0..255), as a
    real checkpoint ships one: byte-level BPE with no merges, ids in byte order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's printable stand-in for each byte (the byte-level pre-tokenizer's alphabet)
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    stand_in = {b: b for b in printable} | {b: 256 + i for i, b in enumerate(others)}
    vocab = {chr(stand_in[b]): b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, clean_up_tokenization_spaces=False)
    hf.save_pretrained(directory)


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
