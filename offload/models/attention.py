"""Attention over a KV cache: `attend` (SDPA, or the CPU's C kernel at decode) over
full-precision keys and values, and one layer's cache on one device (`LayerKV`), full
precision or compressed (`quant_attention` over a `kernels.kv_cache.QuantKV`).

A model whose attention scores are soft-capped (`ModelConfig.attn_softcap`, Gemma 2)
attends through `softcap_attend` on every path: SDPA, the CPU's C kernel and the
compressed cache's decode kernels have no step between the scores and the softmax.

Attention sinks (gpt-oss: a learned logit per head that joins each softmax's
denominator and adds no value) take `attend_sinks`, plain torch in transformers' order
of operations, wherever a layer hands its `sinks`: SDPA, the CPU's C kernel and the
compressed cache's decode kernels have no sink term."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from offload.core.config import ModelConfig
from offload.kernels.cpu_attention import decode_attention_dense
from offload.kernels.formats import Compression
from offload.kernels.kv_attention import decode_attention
from offload.kernels.kv_cache import QuantKV
from offload.models.mla import LatentKV

# Not cuDNN: with a bias over a cache that grows every decode step it re-plans on every
# call, milliseconds of host time each, most of a decode step's CPU time (docs/executor.md).
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    causal: bool = False,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
):
    """Scaled dot-product attention of q [B,H,T,D] over keys/values [B,Hkv,S,D]
    (with `sinks` [H]: `attend_sinks`).

    Returns [B, T, H*D]. Grouped-query heads share KV heads. causal (`StepInputs`): the
    bias is the plain causal mask. Then SDPA runs its flash kernel without the bias,
    with grouped-query heads read in place:
    - where the keys are the T new tokens (a prefill), causally: half the scores. With
      a bias, the memory-efficient kernel computes every score;
    - for one new token on the GPU (a decode step), over every slot.
    softcap: the scores are soft-capped (`softcap_attend`).
    """
    assert softcap is None or sinks is None, "no family soft-caps and sinks both"
    if softcap is not None:
        return softcap_attend(q, keys, values, bias, softcap)
    if sinks is not None:
        return attend_sinks(q, keys, values, bias, sinks)
    batch, heads, num_new, dim = q.shape
    kv_heads = keys.shape[1]
    fresh = num_new > 1 and keys.shape[2] == num_new
    if causal and (fresh or (num_new == 1 and q.is_cuda)):
        with sdpa_kernel(SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(
                q, keys, values, is_causal=fresh, enable_gqa=kv_heads != heads
            )
        return out.transpose(1, 2).reshape(batch, num_new, heads * dim)
    if num_new == 1 and q.device.type == "cpu":
        # decode on the CPU (the executor's CPU attention, the plain CPU run): the C
        # kernel reads each K/V byte once on every core, grouped-query heads together
        # (2x SDPA at the profile's shape, 1.4x at Llama-2-70B's: docs/cpu_attention.md);
        # None where it does not run
        out = decode_attention_dense(q, keys, values, bias)
        if out is not None:
            return out
    if kv_heads != heads and num_new == 1 and bias.shape[1] == 1:
        # decode with grouped-query heads: the query heads of one KV head become rows of
        # one attention over it (same math; SDPA's own GQA path copies K/V per query
        # head, 4-9x slower on the CPU where the executor's CPU attention runs)
        grouped = q.view(batch, kv_heads, heads // kv_heads, dim)
        with sdpa_kernel(SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=bias)
        return out.reshape(batch, 1, heads * dim)
    if kv_heads != heads:
        # prefill with grouped-query heads: SDPA's own GQA path runs in the flash backend
        # only, which takes no mask; with one it falls back to the math backend and holds
        # fp32 scores [B, H, T, S], several times a GPU cap at a large prefill. K/V
        # expanded to every query head keep the memory-efficient backend
        # (`policies.memory` counts them).
        group = heads // kv_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    with sdpa_kernel(SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias)
    return out.transpose(1, 2).reshape(batch, num_new, heads * dim)


# scores [rows, heads, tokens, slots] `softcap_attend` computes at once: with their
# float32 copy and probabilities a few tens of MB, whatever the prefill
# (`policies.memory` counts SOFTCAP_TRANSIENT elements)
SOFTCAP_CHUNK_SCORES = 1 << 22
SOFTCAP_TRANSIENT = 6 * SOFTCAP_CHUNK_SCORES


def softcap_attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, cap: float
) -> torch.Tensor:
    """`attend` with soft-capped scores, as transformers' Gemma 2: cap * tanh(s / cap)
    of each scaled score s, then the additive bias [B, 1|H, T, >= S] and the softmax
    (in float32). q's rows and tokens go in chunks of at most SOFTCAP_CHUNK_SCORES
    scores; grouped-query heads read their KV head in place. Returns [B, T, H*D]."""
    batch, heads, num_new, dim = q.shape
    slots = keys.shape[2]
    assert bias.shape[0] == batch, "one bias row a sequence"
    row_scores = heads * num_new * slots
    rows = max(1, SOFTCAP_CHUNK_SCORES // row_scores)
    tokens = num_new if rows > 1 else max(1, SOFTCAP_CHUNK_SCORES // (heads * slots))
    out = q.new_empty(batch, num_new, heads * dim)
    for first in range(0, batch, rows):
        part = slice(first, first + rows)
        for start in range(0, num_new, tokens):
            new = slice(start, start + tokens)
            out[part, new] = _softcapped(
                q[part, :, new], keys[part], values[part], bias[part, :, new, :slots], cap
            )
    return out


def _softcapped(q, keys, values, bias, cap: float) -> torch.Tensor:
    """One chunk of `softcap_attend`: the query heads of a KV head as rows of one matmul."""
    batch, heads, num_new, dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads * num_new, dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float()
    scores = scores.view(batch, heads, num_new, -1)
    scores.mul_(dim**-0.5 / cap).tanh_().mul_(cap)
    scores += bias
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs.view(batch, kv_heads, -1, probs.shape[-1]), values)
    return out.view(batch, heads, num_new, dim).transpose(1, 2).reshape(batch, num_new, -1)


# the bytes of scores `attend_sinks` holds in one tensor (float32 at most): it takes
# that many bytes' worth of batch rows, or of one row's query tokens, at a time; it holds
# at most `SINK_SCORE_TENSORS` such tensors at once (`policies.memory` counts them)
SINK_SCORE_BYTES = 128 << 20
SINK_SCORE_TENSORS = 5


def attend_sinks(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, sinks
) -> torch.Tensor:
    """`attend` with a sink logit per head [H] in each softmax's denominator, as
    transformers' gpt-oss eager attention: scores in the dtype, the bias added, the sink
    joined, the row's maximum subtracted, softmax, the sink dropped. Grouped-query heads
    are rows of one matmul over their KV head. Returns [B, T, H*D]."""
    batch, heads, num_new, dim = q.shape
    slots = keys.shape[2]
    out = torch.empty((batch, num_new, heads * dim), dtype=q.dtype, device=q.device)
    tokens = max(1, SINK_SCORE_BYTES // (heads * (slots + 1) * 4))  # a tensor's query rows
    rows, span = max(1, tokens // num_new), min(num_new, tokens)
    sink = sinks.to(q.dtype).view(1, heads, 1, 1)
    for b in range(0, batch, rows):
        for t in range(0, num_new, span):
            at = (slice(b, b + rows), slice(None), slice(t, t + span))
            context = _sink_part(q[at], keys[at[0]], values[at[0]], bias[at], sink)
            out[at[0], at[2]] = context.transpose(1, 2).flatten(2)
    return out


def _sink_part(q, keys, values, bias, sink) -> torch.Tensor:
    """`attend_sinks` over q [n, H, t, D]: the context [n, H, t, D]."""
    n, heads, num_new, dim = q.shape
    kv_heads, slots = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    grouped = q.reshape(n, kv_heads, group * num_new, dim)
    scores = torch.matmul(grouped, keys.transpose(2, 3)) * dim**-0.5
    scores = scores.view(n, heads, num_new, slots) + bias
    combined = torch.cat([scores, sink.expand(n, heads, num_new, 1)], dim=-1)
    del scores
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    probs = probs.to(values.dtype).reshape(n, kv_heads, group * num_new, slots)
    return torch.matmul(probs, values).view(n, heads, num_new, dim)


class LayerKV:
    """One layer's KV cache for a batch on one device: k, v [B, Hkv, max_slots, D], or
    with `compression` a `kernels.kv_cache.QuantKV` (read by the quantized decode
    attention kernel). A latent-attention model's cache is a `mla.LatentKV` (full
    precision: no compressed format takes a latent)."""

    def __init__(
        self,
        batch: int,
        cfg: ModelConfig,
        max_slots: int,
        dtype,
        device,
        compression: Compression | None = None,
    ) -> None:
        self.quant: QuantKV | None = None
        self.softcap = cfg.attn_softcap
        self.latent: LatentKV | None = None
        if cfg.kv_lora_rank:
            assert compression is None, "a latent cache is never compressed (policies.latent)"
            self.latent = LatentKV(batch, cfg, max_slots, dtype, device)
            return
        if compression is not None:
            self.quant = QuantKV(
                batch, cfg.num_kv_heads, cfg.head_dim, max_slots, compression, dtype, device
            )
            return
        shape = (batch, cfg.num_kv_heads, max_slots, cfg.head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        if self.quant is not None:
            return self.quant.nbytes
        if self.latent is not None:
            return self.latent.nbytes
        return 2 * self.k.numel() * self.k.element_size()

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor,
        start: int,
        causal: bool = False,
        out: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store the new entries k, v at slots start.. and attend q over the cache
        (a compressed one: `quant_attention`); causal as `attend`'s. out: a buffer the
        decode attention over a compressed cache writes into (others return their own).
        sinks: the layer's attention sinks (`attend_sinks`)."""
        end = start + k.shape[2]
        if self.latent is not None:  # k: the latent entries (v is a view of them)
            return self.latent.attention(q, k, bias, start, causal)
        if self.quant is not None:
            return quant_attention(
                self.quant, q, k, v, bias, start, causal, out, self.softcap, sinks
            )
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return attend(q, self.k[:, :, :end], self.v[:, :, :end], bias, causal, self.softcap, sinks)


def quant_attention(
    cache: QuantKV,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias,
    start: int,
    causal: bool = False,
    out: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Store k, v in the compressed cache at slots start.. and attend q: a prefill
    (start 0) over its fresh entries at full precision, a decode step over the cache
    (into out where given). Soft-capped scores or sinks: over the cache dequantized,
    since the decode kernels have neither (a plan does not choose a compressed cache
    for such a model: `search.kv_formats`, `policies.paths`)."""
    cache.write(k, v, start)
    if start == 0:
        return attend(q, k, v, bias, causal, softcap, sinks)
    end = start + k.shape[2]
    if q.shape[2] == 1 and softcap is None and sinks is None:
        return decode_attention(q, cache, bias, end, out=out)
    return attend(q, *cache.dequantized(end), bias, softcap=softcap, sinks=sinks)
