"""How `offload-plan` shows a plan: its table, its JSON, the weight store's line and the
plot of predicted throughput against the batch size."""

from __future__ import annotations

from pathlib import Path

from offload.core.config import DTYPES
from offload.core.errors import UserError
from offload.policies.advice import FormatHint
from offload.policies.caps import Caps
from offload.policies.cost import Estimate, estimate
from offload.policies.hardware import HardwareProfile
from offload.policies.job import JobEstimate

GB = 1e9


def store_line(store: dict) -> str:
    line = (
        f"weight store: {store['bytes'] / GB:.1f} GB on {store['nvme']} "
        f"({store['free_bytes'] / GB:.1f} GB free"
    )
    if store["bytes"] and not store["write_bytes"]:
        line += "; the store there is reused"
    return line + ")"


def as_json(best: Estimate, what_if, probed=()) -> dict:
    return {
        "verified": [
            {
                "policy": est.policy.to_dict(),
                "predicted_tok_s": est.total_tok_s,
                "probed_tok_s": probe.total_tok_s,
                "predicted_decode_step_s": est.decode_step_s,
                "probed_decode_step_s": probe.decode_step_s,
                "predicted_prefill_s": est.prefill_s,
                "probed_prefill_s": probe.prefill_s,
                "probe_seconds": probe.seconds_spent,
            }
            for est, probe in probed
        ],
        "policy": best.policy.to_dict(),
        "predicted": {
            "total_tok_s": best.total_tok_s,
            "prefill_s": best.prefill_s,
            "decode_s": best.decode_s,
            "decode_step_s": best.decode_step_s,
            "bottleneck": best.bottleneck,
            "lanes_decode_step_s": best.lanes_decode_s,
        },
        "memory": {
            "gpu_bytes": best.gpu_peak_bytes,
            "cpu_bytes": best.cpu_peak_bytes,
            "disk_bytes": best.memory.disk_bytes,
            "detail": best.memory.detail,
        },
        "what_if": {label: speedup for label, speedup in what_if},
        "experts": best.experts,  # a mixture of experts' (`policies.cost_moe`)
    }


def _experts_lines(x: dict) -> list[str]:
    """A mixture of experts' placement and a decode step's expert traffic (none for a
    dense model)."""
    if not x:
        return []
    return [
        f"experts: {x['layers']} layers x {x['experts']}, {x['expert_bytes'] / 1e6:.0f} MB each; "
        f"a layer's {x['gpu']:.0f} on the GPU, {x['cpu']:.0f} in CPU memory, {x['disk']:.0f} on disk",
        f"experts a decode step: {x['decode_chosen']:.1f} chosen a layer, {x['decode_moved']:.1f} "
        f"copied ({x['decode_moved_bytes'] / GB:.1f} GB a step), {x['decode_on_cpu']:.1f} "
        "computed on the CPU",
    ]


def _latent_lines(cfg, dtype: str) -> list[str]:
    """A latent-attention model's KV entry a token (`models.mla`; none for others)."""
    if not cfg.kv_lora_rank:
        return []
    elt = DTYPES[dtype].itemsize if dtype in DTYPES else 2
    heads_kv = cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    return [
        f"latent KV: {cfg.kv_entry_width} values a token and layer ({cfg.kv_lora_rank} latent + "
        f"{cfg.qk_rope_head_dim} RoPE key), {cfg.num_layers * cfg.kv_entry_width * elt:,} bytes "
        f"a token over {cfg.num_layers} layers ({heads_kv / cfg.kv_entry_width:.0f}x less than "
        f"K and V of {cfg.num_heads} heads)"
    ]


def _format(c) -> str:
    if c is None:
        return "none"
    if c.fp8:
        return f"fp8-b{c.group_size}"
    return f"int{c.bits}-g{c.group_size}{'-sym' if c.symmetric else ''}"


def table(
    cfg, args, hw: HardwareProfile, best: Estimate, what_if, store: dict | None, probed=(),
    hint: FormatHint | None = None, job: JobEstimate | None = None,
) -> str:  # fmt: skip
    p, d = best.policy, best.memory.detail
    weights = d["weights_gpu"] + d["weights_cpu"] + d["weights_disk"]
    kv = d["kv_gpu"] + d["kv_cpu"] + d["kv_disk"]
    act = d["act_gpu"] + d["act_cpu"]

    def row(name, gpu, cpu, disk, total):
        pct = lambda x: f"{100 * x / total:5.1f}%" if total else "    -"  # noqa: E731
        return (
            f"  {name:12s} {gpu / GB:8.1f} GB {pct(gpu)}  {cpu / GB:8.1f} GB {pct(cpu)}  "
            f"{disk / GB:8.1f} GB {pct(disk)}"
        )

    lines = [
        f"{cfg.name}: {cfg.param_count() / 1e9:.1f}B parameters, {args.dtype}; prompt {args.prompt_len}"
        f"{args.token_note}, generate {args.gen_len}",
        f"machine: {hw.device_name}",
        "",
        f"  {'placement':12s} {'GPU':>19s}  {'CPU':>19s}  {'disk':>19s}",
        row("weights", d["weights_gpu"], d["weights_cpu"], d["weights_disk"], weights),
        row("KV cache", d["kv_gpu"], d["kv_cpu"], d["kv_disk"], kv),
        row("activations", d["act_gpu"], d["act_cpu"], 0, act),
        "",
        f"batch: {p.num_gpu_batches} x {p.gpu_batch_size} = {p.block_size} sequences; attention over "
        f"off-GPU KV on the {'CPU' if p.attention_on_cpu else 'GPU'}",
        f"compression: weights {_format(p.weight_compression)}, KV cache {_format(p.kv_compression)}",
        *_latent_lines(cfg, args.dtype),
        *_experts_lines(best.experts),
        f"predicted: {best.total_tok_s:.1f} tok/s total (prefill {best.prefill_s:.1f} s = "
        f"{best.prefill_tok_s:.0f} tok/s, decode {best.decode_step_s:.2f} s/step = "
        f"{best.decode_tok_s:.1f} tok/s)",
        "bottleneck: "
        + best.bottleneck
        + " ("
        + ", ".join(
            f"{k} {v:.2f} s" for k, v in sorted(best.lanes_decode_s.items(), key=lambda kv: -kv[1])
        )
        + " per decode step)",
        f"peak memory: GPU {best.gpu_peak_bytes / GB:.1f} GB, CPU {best.cpu_peak_bytes / GB:.1f} GB, "
        f"disk {best.memory.disk_bytes / GB:.1f} GB",
    ]
    if store is not None:  # (a problem with it is told on stderr, first)
        lines.append(store_line(store))
    if job is not None:
        lines.append(job.summary())
    helps = [f"{label} -> {x:.2f}x" for label, x in what_if] + ([hint.text()] if hint else [])
    if helps:
        lines.append("what would help: " + "; ".join(helps))
    for rank, (est, probe) in enumerate(probed):
        q = est.policy
        lines.append(
            f"{'verified' if rank == 0 else '        '} {q.num_gpu_batches} x {q.gpu_batch_size}, "
            f"attention on the {'CPU' if q.attention_on_cpu else 'GPU'}, weights "
            f"{_format(q.weight_compression)}, KV {_format(q.kv_compression)}: predicted "
            f"{est.total_tok_s:.1f}, probed {probe.total_tok_s:.1f} tok/s "
            f"({100 * (probe.total_tok_s / est.total_tok_s - 1):+.0f}%)"
        )
    lines.append(f"policy: {p.to_json()}")
    return "\n".join(lines)


def candidates_table(candidates) -> str:
    """offload-plan --explain: the chosen plan and its neighbours, ranked by predicted job
    time (`policies.explain`)."""
    lines = ["why this plan (ranked by the job's predicted time):"]
    for c in candidates:
        seconds = f"{c.job_seconds:8.1f} s" if c.job_seconds is not None else "    -     "
        p = c.policy
        shape = (
            f"{p.num_gpu_batches} x {p.gpu_batch_size}, W {p.weights.gpu:.0%} GPU, "
            f"KV {p.kv_cache.gpu:.0%} GPU, attn {'CPU' if p.attention_on_cpu else 'GPU'}, "
            f"{_format(p.weight_compression)}/{_format(p.kv_compression)}"
        )
        mark = "*" if c.chosen else " "
        lines.append(f" {mark} {seconds}  {c.change:34s} {shape:58s} {c.reason}")
    return "\n".join(lines)


def plot(path: Path, cfg, dtype, args, hw, caps: Caps, best: Estimate) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError(
            "--plot needs matplotlib: pip install 'offload[plot]' (or matplotlib)"
        ) from None
    from offload.policies.policy import Policy
    from offload.policies.search import BATCH_SIZES

    sizes, rates = [], []
    for size in BATCH_SIZES:
        policy = Policy(
            size,
            best.policy.num_gpu_batches,
            weights=best.policy.weights,
            kv_cache=best.policy.kv_cache,
            attention_on_cpu=best.policy.attention_on_cpu,
            weight_compression=best.policy.weight_compression,
            kv_compression=best.policy.kv_compression,
        )
        est = estimate(cfg, policy, dtype, args.prompt_len, args.gen_len, hw)
        if est.gpu_peak_bytes <= caps.gpu_bytes and est.cpu_peak_bytes <= caps.cpu_bytes:
            sizes.append(policy.block_size)
            rates.append(est.total_tok_s)
    d = best.memory.detail
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    tiers = ["GPU", "CPU", "disk"]
    bottom = [0.0, 0.0, 0.0]
    for label, keys in (
        ("weights", ("weights_gpu", "weights_cpu", "weights_disk")),
        ("KV cache", ("kv_gpu", "kv_cpu", "kv_disk")),
        ("activations", ("act_gpu", "act_cpu", None)),
    ):
        vals = [d[k] / GB if k else 0.0 for k in keys]
        ax1.bar(tiers, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax1.set_ylabel("GB")
    ax1.set_title("placement per tier")
    ax1.legend()
    ax2.plot(sizes, rates, marker="o", label="predicted (this placement)")
    ax2.scatter([best.policy.block_size], [best.total_tok_s], color="red", zorder=3, label="chosen")
    ax2.set_xscale("log")
    ax2.set_xlabel("sequences per block")
    ax2.set_ylabel("total tokens/s")
    ax2.set_title("throughput vs batch size")
    ax2.legend()
    fig.suptitle(f"{cfg.name} on {hw.device_name[:40]}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
