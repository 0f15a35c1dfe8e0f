"""vLLM's engine arguments, in Python (`LLM(...)`) and as flags (the same names).

Those with a meaning here are mapped onto `EngineArgs`: `max_num_seqs` is the batch
size, `quantization` the weights' format (int4, int8, auto) or a pre-quantized
checkpoint's method (gptq, awq, compressed-tensors: checked against its config.json, whose
own is read), `gpu_memory_utilization`
a GPU cap of that share of the device's memory. The rest are accepted at the value
that changes nothing here and otherwise refused, each naming the fix (in the caller's
terms: keyword arguments in Python, flags on the command line). docs/compat.md lists
them all.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from offload.core.errors import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmArg:
    """One of vLLM's engine arguments: its flag's argparse options, the values at which
    it changes nothing here (accepted), and the fix a refusal names in Python and as
    flags (`cli_fix` None: the same words)."""

    options: dict[str, Any] = field(default_factory=lambda: {"type": str})
    harmless: tuple[Any, ...] = ()
    fix: str = ""
    cli_fix: str | None = None
    short: str | None = None
    note: str = ""  # accepted at any value, with this line in the log (it changes no output)


_INT, _FLOAT, _SWITCH = {"type": int}, {"type": float}, {"action": "store_true"}
_TOKENIZER = "the model's own tokenizer is used: drop it"
_CPU_CAP = (
    "the plan search places weights, cache and activations itself: cap the CPU memory with "
    "max_memory={'cpu': '100GB'} (and give offload_folder=DIR for disk)",
    "the plan search places weights, cache and activations itself: cap the memory with "
    "--gpu-mem 24GB --cpu-mem 100GB (and give --nvme DIR for disk)",
)
# mapped where they have a meaning here (`from_vllm`), else refused with the fix
VLLM_ARGS: dict[str, VllmArg] = {
    "max_num_seqs": VllmArg(_INT),
    "quantization": VllmArg(harmless=(None,), short="-q"),
    "gpu_memory_utilization": VllmArg(_FLOAT),
    "tensor_parallel_size": VllmArg(
        _INT,
        (1,),
        "tensor parallelism runs as one process a rank: offload-run --tp N (docs/parallel.md)",
        short="-tp",
    ),
    "pipeline_parallel_size": VllmArg(
        _INT, (1,), "layers stream through one GPU instead: drop it", short="-pp"
    ),
    "data_parallel_size": VllmArg(
        _INT, (1,), "data-parallel groups run as offload-run --dp M (docs/parallel.md)", short="-dp"
    ),
    "trust_remote_code": VllmArg(
        _SWITCH,
        (False,),
        "no remote code runs; the supported families (Llama, Mistral, "
        "Qwen2, BLOOM, OPT) load without it: drop it",
    ),
    "enforce_eager": VllmArg(
        _SWITCH, (False,), "the policy decides where decode replays CUDA graphs: drop it"
    ),
    "max_model_len": VllmArg(
        _INT,
        (None,),
        "each job's plan is sized for its longest prompt and max_tokens, up to "
        "the model's context: drop it",
    ),
    "max_num_batched_tokens": VllmArg(
        _INT,
        (None,),
        "a block holds batch_size sequences: give max_num_seqs (batch_size)",
        "a block holds --batch-size sequences: give --max-num-seqs (--batch-size)",
    ),
    "tokenizer": VllmArg(harmless=(None,), fix=_TOKENIZER),
    "tokenizer_mode": VllmArg(harmless=("auto",), fix=_TOKENIZER),
    "skip_tokenizer_init": VllmArg(_SWITCH, (False,), _TOKENIZER),
    "cpu_offload_gb": VllmArg(_FLOAT, (0,), *_CPU_CAP),
    "swap_space": VllmArg(_FLOAT, (), *_CPU_CAP),
    "kv_cache_dtype": VllmArg(
        harmless=("auto",),
        fix="the KV cache is compressed group-wise here: kv_compress='int8' (or 'int4')",
        cli_fix="the KV cache is compressed group-wise here: --kv-compress int8 (or int4)",
    ),
    "download_dir": VllmArg(
        harmless=(None,), fix="models come from the Hugging Face cache: set HF_HUB_CACHE=DIR"
    ),
    "load_format": VllmArg(harmless=("auto",), fix="safetensors and GGUF load as found: drop it"),
    "enable_prefix_caching": VllmArg(
        _SWITCH,
        note="enable_prefix_caching: each prompt is prefilled whole here (no prefix cache), "
        "which gives the same tokens",
    ),
    "block_size": VllmArg(_INT, (None,), "the plan sizes the KV cache: drop it"),
    "disable_log_stats": VllmArg(_SWITCH, (True, False)),
}
# vLLM's names of the pre-quantized methods `models.prequant` reads (its Marlin kernels'
# names read the same checkpoints)
PREQUANTIZED = {
    "gptq": "gptq",
    "gptq_marlin": "gptq",
    "awq": "awq",
    "awq_marlin": "awq",
    "compressed-tensors": "compressed-tensors",
}
MAPPED = ("max_num_seqs", "quantization", "gpu_memory_utilization")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_vllm_flags(parser: Any, skip: Iterable[str] = ()) -> None:
    """vLLM's engine flags (`--max-num-seqs`, `-q/--quantization`, `--cpu-offload-gb`,
    ...): a flag not given leaves no attribute, so only what was typed is judged."""
    for name, arg in VLLM_ARGS.items():
        if name in skip:
            continue
        names = [_flag(name), *([arg.short] if arg.short else [])]
        what = (
            "mapped" if name in MAPPED else "accepted: it changes no output" if arg.note
            else "refused with the fix unless it changes nothing"
        )  # fmt: skip
        parser.add_argument(
            *names, dest=name, default=argparse.SUPPRESS, help=f"vLLM's ({what})", **arg.options
        )


def from_vllm(
    kwargs: dict[str, Any],
    fields: Mapping[str, Any],
    device: torch.device,
    gpu_mem: str | None,
    cli: bool = False,
) -> tuple[dict[str, Any], str | None]:
    """(the `EngineArgs` keyword arguments, the GPU cap) of keyword arguments that mix
    `EngineArgs` fields (`fields`: their defaults) and vLLM's. cli: they came as flags
    (messages name flags). A name neither knows is a TypeError, as Python's own."""
    for vllm, ours in (("max_num_seqs", "batch_size"), ("quantization", "compress")):
        if vllm in kwargs and kwargs.get(ours, fields[ours]) != fields[ours]:
            both = f"{_flag(vllm)} or {_flag(ours)}" if cli else f"{vllm} or {ours}"
            raise UserError(f"give {both}, not both (they are the same)")
    out, mapped = {}, {}  # (a mapped value wins over its field's default)
    for name, value in kwargs.items():
        if name in fields:
            out[name] = value
        elif name == "max_num_seqs":
            mapped["batch_size"] = value
        elif name == "quantization" and value in PREQUANTIZED:
            mapped["prequantized"] = PREQUANTIZED[value]  # (checked by the front)
        elif name == "quantization":
            mapped["compress"] = _quantization(value, cli)
        elif name == "gpu_memory_utilization":
            gpu_mem = _gpu_share(value, device, gpu_mem, cli)
        elif name in VLLM_ARGS and value in VLLM_ARGS[name].harmless:
            continue
        elif name in VLLM_ARGS and VLLM_ARGS[name].note:
            if value:
                log.info("%s", VLLM_ARGS[name].note)
            continue
        elif name in VLLM_ARGS:
            arg = VLLM_ARGS[name]
            if not cli:
                raise UserError(f"LLM({name}={value!r}) is vLLM's: {arg.fix}")
            typed = _flag(name) if value is True else f"{_flag(name)} {value}"
            raise UserError(f"{typed} is vLLM's: {arg.cli_fix or arg.fix}")
        else:
            raise TypeError(
                f"LLM() got an unexpected keyword argument {name!r}; it takes the EngineArgs "
                "fields, max_memory, offload_folder and policy (docs/compat.md)"
            )
    return out | mapped, gpu_mem


def _quantization(value: Any, cli: bool) -> str:
    if value is None:
        return "none"
    if str(value) in ("int4", "int8", "auto"):
        return str(value)
    fix = "--compress int4 (or int8)" if cli else "quantization='int4' (or 'int8')"
    given = f"--quantization {value}" if cli else f"quantization={value!r}"
    raise UserError(
        f"{given} is not a format offload reads; a pre-quantized checkpoint is read as its "
        f"config.json says ({', '.join(sorted(set(PREQUANTIZED.values())))} int4), and {fix} "
        "quantizes the weights group-wise as they load (docs/compression.md)"
    )


def check_prequantized(named: str | None, declared: str | None, model: str) -> None:
    """vLLM's `quantization` naming a pre-quantized method (`named`) against the method
    the checkpoint's config.json declares (`declared`; None: not pre-quantized)."""
    if named is None or named == declared:
        return
    if declared is None:
        raise UserError(
            f"quantization {named} (-q): {model} is not pre-quantized (its config.json has no "
            "quantization_config); drop it, or give int4 to quantize as it loads"
        )
    raise UserError(
        f"quantization {named} (-q): {model} is quantized with {declared} (its config.json's "
        f"quantization_config); give {declared} or drop it (the checkpoint's own is read)"
    )


def _gpu_share(share: Any, device: torch.device, gpu_mem: str | None, cli: bool) -> str:
    """vLLM's gpu_memory_utilization as a GPU cap: that share of the device's memory."""
    name = "--gpu-memory-utilization" if cli else "gpu_memory_utilization"
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise UserError(f"{name} {share!r} is not a share in (0, 1]; e.g. 0.9")
    if gpu_mem is not None:
        other = "--gpu-mem" if cli else "a max_memory GPU entry"
        raise UserError(f"{name} and {other} both cap the GPU; give one")
    if device.type != "cuda":
        cpu_cap = "--cpu-mem 8GB" if cli else "max_memory={'cpu': '8GB'}"
        raise UserError(
            f"{name} caps a GPU's memory, and this run has none (device {device}); drop it, "
            f"or cap the CPU memory with {cpu_cap}"
        )
    total = torch.cuda.get_device_properties(device).total_memory
    return f"{int(share * total)}B"
