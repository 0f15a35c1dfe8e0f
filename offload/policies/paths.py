"""The execution paths a model's math rules out, so that no plan takes one that would
compute it wrongly (the search skips them; `api.planning` refuses a --policy asking for
one, before the load):

- attention sinks (gpt-oss: `ModelConfig.attention_sinks`) run in plain torch on the
  GPU (`models.attention.attend_sinks`); the CPU's C attention kernel and the compressed
  cache's decode kernels have no sink term, so such a model takes neither attention on
  the CPU nor a compressed KV cache;
- biased experts with the clamped SwiGLU, or MXFP4 experts (gpt-oss), are computed on
  the GPU (`models.moe`); the CPU expert kernel (`kernels.cpu_expert`) computes plain
  SwiGLU experts only, so no expert of such a model is computed on the CPU.
"""

from __future__ import annotations

from offload.core.config import ModelConfig


def cpu_experts_ok(cfg: ModelConfig) -> bool:
    """Whether the CPU expert kernel computes this model's experts."""
    return not (cfg.expert_bias or cfg.swiglu_limit is not None or cfg.mxfp4_experts)


def ruled_out(cfg: ModelConfig, policy) -> str | None:
    """What of `policy` (a `policies.Policy`) this model cannot run, or None."""
    if cfg.attention_sinks and policy.attention_on_cpu:
        return "attention on the CPU (its C kernel has no attention sinks)"
    if cfg.attention_sinks and policy.kv_compression is not None:
        return "a compressed KV cache (its decode kernels have no attention sinks)"
    if policy.cpu_experts and not cpu_experts_ok(cfg):
        return "experts on the CPU (its kernel has no expert biases, clamped SwiGLU or MXFP4)"
    return None
