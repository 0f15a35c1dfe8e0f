"""Where a latent-attention model's KV cache can live (`models.mla`).

Its cache holds one latent row a token and layer ([c | k_pe], `kv_lora_rank` +
`qk_rope_head_dim` values), attended in the absorbed form by `mla.latent_attend` on the
device that holds it. The KV tiers beyond the GPU (pinned CPU homes, disk homes and
their GPU scratches), the CPU attention kernels and the compressed cache formats are
built for K and V per KV head: none takes a latent. So a latent model's plans keep the
whole cache on the GPU, uncompressed, attended there; the search offers no other
(`search.candidates`, `search._kv_placement`) and a given policy that asks for one is
refused by name before the load.
"""

from __future__ import annotations

from offload.core.config import ModelConfig
from offload.core.errors import UserError
from offload.policies.policy import Policy


def latent_problem(cfg: ModelConfig, policy: Policy) -> str | None:
    """What of `policy` a latent-attention model cannot run (None: all of it can, or
    the model has no latent attention)."""
    if not cfg.kv_lora_rank:
        return None
    if policy.kv_cache.gpu < 1:
        kv = policy.kv_cache
        return f"its KV cache {kv.cpu:.0%} in CPU memory and {kv.disk:.0%} on disk"
    if policy.attention_on_cpu:
        return "attention on the CPU"
    if policy.kv_compression is not None:
        return "a compressed KV cache"
    return None


def check_latent_policy(cfg: ModelConfig, policy: Policy) -> None:
    """`UserError` naming what a latent-attention model cannot run of `policy`."""
    problem = latent_problem(cfg, policy)
    if problem is not None:
        raise UserError(
            f"{cfg.model_type} (latent attention) keeps its KV cache on the GPU, uncompressed, "
            f"attended there; the policy asks for {problem}: put kv_cache all on the gpu "
            "with attention_on_cpu false and no kv_compression"
        )


def check_latent_kv_formats(cfg: ModelConfig, kv_formats: tuple) -> None:
    """`UserError` where the KV formats a search may choose (--kv-compress) are all
    compressed and the model's cache is a latent one (never compressed)."""
    if cfg.kv_lora_rank and None not in kv_formats:
        raise UserError(
            f"--kv-compress: {cfg.model_type}'s latent KV cache (latent attention) is not "
            "compressed; drop --kv-compress"
        )
