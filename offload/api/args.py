"""`EngineArgs`: every engine option, defined once with its default and help.

`LLM(...)` and every CLI (offload-run, offload-plan, offload-convert) build from this
dataclass (`offload.cli.common.add_engine_flags` turns its fields into argparse flags),
so a flag means the same everywhere, dtype default included. Like vLLM's `EngineArgs`;
memory caps use our flag names here and accelerate's (`max_memory`, `offload_folder`) in
`LLM`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from offload.api.vllm_args import VLLM_ARGS, add_vllm_flags, from_vllm
from offload.core.config import DTYPE_CHOICES
from offload.core.errors import UserError
from offload.io.atomic import atomic_write, check_writable
from offload.kernels.formats import KV_GROUPS, Compression

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int, flag: str = "size") -> int:
    """Parse "24GB", "24GiB", "512MB", "1.5TB" or "1000B" into bytes (an int is bytes). A
    number without a unit is refused (but 0): `--gpu-mem 24` meant 24 GB, not 24 bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise UserError(f"cannot parse size {text!r} ({flag}); write it like 24GB, 24GiB or 512MB")
    value = float(match.group(1))
    if not unit and value:
        raise UserError(
            f"size {text!r} ({flag}) has no unit; write {match.group(1)}GB (or GiB, MB, B)"
        )
    return int(value * _UNITS[unit])


_COMPRESS = re.compile(r"int(4|8)(?:-g(\d+))?(-sym)?")


def parse_compression(text: str | None, flag: str = "--compress") -> tuple[Compression | None, ...]:
    """--compress / --kv-compress: the formats the plan may use (None is uncompressed)."""
    if text is None or text == "none":
        return (None,)
    if text == "auto":
        return (None, Compression(4, 64, False), Compression(8, 64, False))
    match = _COMPRESS.fullmatch(text)
    if match is None:
        raise UserError(
            f"{flag} {text!r} is not understood; use none, int4, int8, int4-g128, int8-sym or auto"
        )
    bits, group, sym = match.groups()
    try:
        return (Compression(int(bits), int(group or 64), sym is not None),)
    except ValueError as exc:
        raise UserError(f"{flag} {text}: {exc}") from None


def compression_text(compression: Compression | None) -> str:
    """A format as --compress writes it (`parse_compression`'s inverse): none, int4,
    int8-g128-sym, ..."""
    if compression is None:
        return "none"
    if compression.fp8:  # a checkpoint's format (`models.fp8_checkpoint`), not a flag's
        return "fp8"
    group = "" if compression.group_size == 64 else f"-g{compression.group_size}"
    return f"int{compression.bits}{group}{'-sym' if compression.symmetric else ''}"


def parse_kv_compression(text: str | None) -> tuple[Compression | None, ...]:
    """--kv-compress: as --compress, with the group counted in tokens (16 to 128)."""
    formats = parse_compression(text, "--kv-compress")
    for c in formats:
        if c is not None and c.group_size not in KV_GROUPS:
            raise UserError(
                f"--kv-compress {text}: the group is tokens a key group, one of "
                f"{', '.join(map(str, KV_GROUPS))}"
            )
    return formats


def policy_file(path: Path) -> Path:
    """--policy: a readable file. A pipe or FIFO (`--policy <(offload-plan ... --json)`)
    is read once, now, and kept in a file named by its content (a policy is read again
    for each plan a job tries)."""
    if not path.exists():
        raise UserError(f"--policy {path} does not exist; check the path")
    if path.is_dir():
        raise UserError(f"--policy {path} is a directory; give the policy's JSON file")
    if path.is_file():
        if not os.access(path, os.R_OK):
            raise UserError(f"--policy {path} cannot be read; check its permissions")
        return path
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise UserError(f"--policy {path} cannot be read ({exc.strerror})") from None
    kept = (
        Path(tempfile.gettempdir()) / f"offload-policy-{hashlib.sha256(text).hexdigest()[:16]}.json"
    )
    atomic_write(kept, text)
    return kept


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(
            "--device cuda was asked for but no CUDA device is visible; use --device cpu"
        )
    try:
        return torch.device(name)
    except RuntimeError:
        raise UserError(f"--device {name!r} is not a device; use auto, cpu or cuda[:N]") from None


def _meta(help: str, **cli: Any) -> dict[str, Any]:
    """A field's help and argparse options (for `offload.cli.common`)."""
    return {"help": help, **cli}


COMPRESS_HELP = (
    "weight compression: none (default), int4 or int8 (group-wise, group 64, asymmetric; "
    "add -gN for another group size, -sym for symmetric), or auto (the plan search chooses "
    "among none, int4 and int8)"
)
KV_COMPRESS_HELP = (
    "KV cache compression: none (default), int4 or int8 (keys per channel over groups of "
    "64 tokens, values per token; -gN for 16, 32 or 128 tokens, -sym for symmetric), or "
    "auto (the plan search chooses among none, int4 and int8); kept on the GPU"
)


# prompt tokens a plan is sized for when neither --prompt-len nor a job says
PLAN_PROMPT_LEN = 512


@dataclass(frozen=True)
class EngineArgs:
    """The engine's options. Sizes are strings like "24GB" or "1000B" (a number needs its unit)."""

    model: str = field(
        default="",
        metadata=_meta(
            "demo, a preset (random weights), a hub repo id or a local path", required=True
        ),
    )
    revision: str | None = field(
        default=None, metadata=_meta("hub revision: a branch, tag or commit (default: main)")
    )
    dtype: str = field(
        default="auto",
        metadata=_meta(
            "compute and store dtype; auto: float32 on the CPU, on a GPU the checkpoint's "
            "float16 else bfloat16",
            choices=DTYPE_CHOICES,
        ),
    )
    device: str = field(default="auto", metadata=_meta("auto, cpu or cuda[:N]"))
    dummy: bool = field(
        default=False, metadata=_meta("random weights of the model's shape (no download)")
    )
    batch_size: int = field(
        default=16, metadata=_meta("sequences per batch (a policy sets its own)", type=int)
    )
    byte_tokenizer: bool = field(
        default=False,
        metadata=_meta(
            "a checkpoint without tokenizer files takes UTF-8 bytes as token ids (0-255); "
            "without it such a checkpoint is refused (its outputs would be garbage unless "
            "the model was trained on bytes); refused for a model with a tokenizer (a GGUF "
            "holds one)"
        ),
    )
    chat_template: str | None = field(
        default=None,
        metadata=_meta("a Jinja chat template, or a file holding one, instead of the model's"),
    )
    generation_config: str = field(
        default="auto",
        metadata=_meta(
            "auto: sampling defaults and EOS ids from the model's generation_config.json; "
            "none: ignore it",
            choices=("auto", "none"),
        ),
    )
    policy: Path | None = field(
        default=None,
        metadata=_meta("placement policy JSON (runs the offloading executor)", type=Path),
    )
    gpu_mem: str | None = field(
        default=None, metadata=_meta("GPU memory cap, e.g. 24GB (runs the plan search)")
    )
    cpu_mem: str | None = field(
        default=None, metadata=_meta("CPU memory cap, e.g. 100GB (default: 90%% of the RAM)")
    )
    nvme: Path | None = field(
        default=None,
        metadata=_meta("directory on a fast drive for the weight store and KV spill", type=Path),
    )
    profile: Path | None = field(
        default=None,
        metadata=_meta(
            "hardware profile JSON for the plan search (default: this machine's)", type=Path
        ),
    )
    compress: str = field(default="none", metadata=_meta(COMPRESS_HELP))
    kv_compress: str = field(default="none", metadata=_meta(KV_COMPRESS_HELP))
    prompt_len: int | None = field(
        default=None,
        metadata=_meta(
            "prompt tokens the plan and its fit checks are sized for (default: offload-run "
            f"sizes for the job's longest prompt; offload-plan and Python for {PLAN_PROMPT_LEN})",
            type=int,
        ),
    )
    verify_plan: bool = field(
        default=False,
        metadata=_meta(
            "before the load, time the search's best plans of differing kinds on this machine "
            "(a few layers each at the real shapes; the time is printed) and run the fastest "
            "measured"
        ),
    )
    served_model_name: str | None = field(
        default=None,
        metadata=_meta("the model's name in the log and in results (default: --model as given)"),
    )
    # vLLM's `quantization` naming a pre-quantized checkpoint's method (gptq, awq,
    # compressed-tensors): checked against its config.json by the front; no flag of its own
    prequantized: str | None = field(default=None, metadata={"flag": False})
    hold_gpu_mem: bool | None = field(
        default=None,
        metadata=_meta(
            "hold the GPU's caching allocator to --gpu-mem, so what it reserves (what "
            "nvidia-smi shows), not only what it hands out, stays under the cap: the default "
            "with --gpu-mem on a GPU, except under tensor parallelism (not supported there); "
            "--no-hold-gpu-mem leaves the allocator free (W1c at 24 GB reserved 27.25 GB "
            "free, 23.85 held; docs/throughput.md)",
            action=argparse.BooleanOptionalAction,
        ),
    )

    def __post_init__(self) -> None:
        if not self.model:
            raise UserError("no model given; pass --model (demo, a preset, a repo id or a path)")
        if self.dtype not in DTYPE_CHOICES:
            raise UserError(f"--dtype {self.dtype!r}: choose {', '.join(DTYPE_CHOICES)}")
        if self.generation_config not in ("auto", "none"):
            raise UserError(f"--generation-config {self.generation_config!r}: choose auto or none")
        for name in ("batch_size", "prompt_len"):
            value = getattr(self, name)
            if name == "prompt_len" and value is None:
                continue
            if not isinstance(value, int) or value < 1:
                raise UserError(
                    f"--{name.replace('_', '-')} must be a positive integer, got {value!r}"
                )
        if self.hold_gpu_mem and self.gpu_mem is None:  # (None: held where there is a cap)
            raise UserError("--hold-gpu-mem holds the GPU's allocator to --gpu-mem; give --gpu-mem")
        if self.hold_gpu_mem and resolve_device(self.device).type != "cuda":
            raise UserError("--hold-gpu-mem holds a GPU's allocator; this run has no GPU: drop it")
        for name in ("gpu_mem", "cpu_mem"):
            flag = f"--{name.replace('_', '-')}"
            value = getattr(self, name)
            if value is not None and parse_size(value, flag) <= 0:
                raise UserError(f"{flag} {value} must be more than 0; give a cap like 24GB")
        if self.nvme is not None:  # the weight store and the KV spill are written there
            check_writable(Path(self.nvme), "--nvme", directory=True)
        if self.policy is not None:
            object.__setattr__(self, "policy", policy_file(Path(self.policy)))
        if self.profile is not None and not Path(self.profile).is_file():
            raise UserError(f"--profile {self.profile} does not exist; run offload-profile")
        self.compressions()
        self.kv_compressions()

    @property
    def gpu_bytes(self) -> int | None:
        return parse_size(self.gpu_mem, "--gpu-mem") if self.gpu_mem is not None else None

    @property
    def cpu_bytes(self) -> int | None:
        return parse_size(self.cpu_mem, "--cpu-mem") if self.cpu_mem is not None else None

    @property
    def planned_prompt_len(self) -> int:
        """The prompt tokens the plan is sized for: --prompt-len, else 512 (offload-run
        first sets it to the job's longest prompt, `offload.cli.sizing`)."""
        return self.prompt_len if self.prompt_len is not None else PLAN_PROMPT_LEN

    @property
    def wants_search(self) -> bool:
        """Caps or a store directory without a policy: the plan search picks one."""
        return self.policy is None and any(
            v is not None for v in (self.gpu_mem, self.cpu_mem, self.nvme)
        )

    def compressions(self) -> tuple[Compression | None, ...]:
        return parse_compression(self.compress)

    def kv_compressions(self) -> tuple[Compression | None, ...]:
        return parse_kv_compression(self.kv_compress)

    def replace(self, **changes: Any) -> EngineArgs:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return EngineArgs(**{**values, **changes})

    @staticmethod
    def add_cli_args(parser: Any) -> Any:
        """vLLM's `EngineArgs.add_cli_args(parser)` (a parser or an argument group): a flag
        for every field (`--model` may be left to the script's `set_defaults`), vLLM's
        engine flags (mapped or refused naming the fix when `LLM(**vars(args))` gets
        them) and `--seed` (`LLM`'s). Returns the parser."""
        add_engine_flags(parser, ENGINE_FIELDS, optional=("model",))
        add_vllm_flags(parser)
        parser.add_argument(
            "--seed", type=int, default=argparse.SUPPRESS, help="LLM(seed=...): sampled "
            "requests without a seed of their own draw one from it",
        )  # fmt: skip
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """vLLM's `EngineArgs.from_cli_args`: the fields' flags, and vLLM's engine flags
        mapped or refused (`--seed` is `LLM`'s, not a field: pass it there)."""
        return cli_engine_args(args)


ENGINE_FIELDS = tuple(f.name for f in fields(EngineArgs) if f.metadata.get("flag", True))
ENGINE_DEFAULTS = {f.name: f.default for f in fields(EngineArgs)}


def from_vllm_arguments(
    kwargs: dict[str, Any], device: torch.device, gpu_mem: str | None, cli: bool = False
) -> tuple[dict[str, Any], str | None]:
    """vLLM's `LLM(...)` arguments (or flags, `cli`) as this engine's (`docs/compat.md`):
    (the EngineArgs keyword arguments, the GPU cap). `max_num_seqs` is the batch size,
    `quantization` the weights' format (int4, int8, auto), `gpu_memory_utilization` the
    share of the GPU's memory the run may use; the rest of vLLM's refused with the fix,
    at their defaults accepted (`vllm_args.VLLM_ARGS`); anything else is a TypeError, as
    Python's own."""
    return from_vllm(kwargs, ENGINE_DEFAULTS, device, gpu_mem, cli)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_flags(
    parser: Any, names: Sequence[str], required: Sequence[str] = (), optional: Sequence[str] = ()
) -> None:
    """Flags for these `EngineArgs` fields, with the dataclass's defaults and help.
    required / optional: fields whose flag must be given / may be left out, whatever the
    field says."""
    by_name = {f.name: f for f in fields(EngineArgs)}
    for name in names:
        f = by_name[name]
        meta = dict(f.metadata)
        help_text = meta.pop("help")
        must = (meta.pop("required", False) or name in required) and name not in optional
        if f.type in (bool, "bool"):
            parser.add_argument(_flag(name), action="store_true", help=help_text)
            continue
        default = None if must or name in optional else f.default
        suffix = "" if default in (None, "") else f" (default: {default})"
        parser.add_argument(
            _flag(name), required=must, default=default, help=help_text + suffix, **meta
        )


def cli_engine_args(args: argparse.Namespace, **extra: Any) -> EngineArgs:
    """The `EngineArgs` of parsed flags: the fields' own flags, and vLLM's engine flags
    where they were given, mapped or refused naming the flags to use instead (fields
    without a flag keep their defaults; `extra` overrides)."""
    given = {k: v for k, v in vars(args).items() if k in ENGINE_DEFAULTS or k in VLLM_ARGS}
    given |= extra
    gpu_mem = given.pop("gpu_mem", None)
    device = resolve_device(given.get("device", "auto"))
    values, gpu_mem = from_vllm(given, ENGINE_DEFAULTS, device, gpu_mem, cli=True)
    return EngineArgs(**values, gpu_mem=gpu_mem)


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vLLM's argument parser as its examples use it: an `ArgumentParser` that also takes
    `--flag_name` for `--flag-name` (vLLM's other additions, YAML `--config` files among
    them, are not here: docs/compat.md)."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([_dashes(a) for a in args], namespace)


def _dashes(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value
