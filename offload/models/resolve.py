"""Turn what the user typed after `--model` into a config, a weight source and a tokenizer.

Accepted, in this order: "demo" (the built-in SmolLM2-135M-Instruct GGUF); a local
path (a Hugging Face model directory or a .gguf file); a preset name (dummy weights);
a hub repo id, looked up in the local Hugging Face cache first and on the hub second.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from offload.core.config import ModelConfig
from offload.core.errors import UserError
from offload.core.hf_config import MissingSize
from offload.core.presets import DEMO_NAME, PRESETS, preset_for
from offload.kernels.formats import Compression
from offload.models.weights import DummySource, WeightSource

log = logging.getLogger(__name__)

HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja"]


@dataclass(frozen=True)
class ModelSpec:
    """A resolved model: its config and where its weights and tokenizer come from."""

    name: str
    config: ModelConfig
    kind: str  # "safetensors", "gguf" or "dummy"
    path: Path | None = None
    dummy_seed: int = 0
    # an already-parsed GGUF reader (parsing the metadata of a large vocabulary costs seconds)
    gguf_reader: Any = field(default=None, compare=False, repr=False)

    def open_weights(self) -> WeightSource:
        if self.kind == "dummy":
            return DummySource(self.config, seed=self.dummy_seed)
        assert self.path is not None
        if self.kind == "gguf":
            from offload.models.gguf_file import GGUFSource, open_gguf

            return GGUFSource(self.path, self.gguf_reader or open_gguf(self.path), self.config)
        from offload.models.checkpoint import CheckpointSource

        return CheckpointSource(self.path, self.config)

    def weight_format(self) -> Compression | None:
        """A pre-quantized checkpoint's format, which its plan must keep (None: the
        checkpoint is not quantized, or runs with dummy weights)."""
        return self.checkpoint_format() if self.kind == "safetensors" else None

    def checkpoint_format(self) -> Compression | None:
        """The format of the checkpoint directory's weights, whatever this run loads
        (offload-plan resolves a model without its weights)."""
        if self.path is None or not self.path.is_dir():
            return None
        from offload.models.prequant import format_of

        fmt = format_of(self.path)
        return None if fmt is None else fmt.compression

    def generation_config(self) -> dict[str, Any]:
        """The model's generation_config.json ({} when it has none, as GGUF files)."""
        if self.path is None or not self.path.is_dir():
            return {}
        path = self.path / "generation_config.json"
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError:
            return {}
        except json.JSONDecodeError as exc:
            raise UserError(f"{path} is not valid JSON ({exc}); fix or delete it") from None
        return config if isinstance(config, dict) else {}

    @property
    def byte_tokens(self) -> bool:
        """No tokenizer ships with the model (a preset's dummy weights, a directory
        without one): its tokens are the text's UTF-8 bytes (`tokenizer.ByteTokenizer`)."""
        from offload.models.tokenizer import ships_tokenizer

        if self.kind == "gguf":
            return False
        return not (self.path is not None and self.path.is_dir() and ships_tokenizer(self.path))

    def checkpoint_bytes(self) -> int:
        """Bytes of the weight files at the model's path (0 where it has none)."""
        if self.path is None:
            return 0
        if self.path.is_file():
            return self.path.stat().st_size
        return sum(f.stat().st_size for f in self.path.glob("*.safetensors"))

    def tokenizer(self, byte_tokenizer: bool = False):
        """The model's tokenizer; byte_tokenizer: UTF-8 bytes for a checkpoint without
        one (else a real checkpoint without one is refused, naming the files)."""
        from offload.models.tokenizer import load_tokenizer

        if self.kind == "gguf":
            assert self.path is not None
            if byte_tokenizer:  # (as for a directory that ships one: `load_tokenizer`)
                raise UserError(
                    f"{self.path} ships its tokenizer in the GGUF file; drop --byte-tokenizer "
                    "(byte_tokenizer=True), which is for checkpoints without one"
                )
            return load_tokenizer(self.path.parent, gguf_file=self.path.name)
        byte_ids = "asked" if byte_tokenizer else "dummy" if self.kind == "dummy" else "refuse"
        return load_tokenizer(
            self.path if self.path and self.path.is_dir() else None, None, byte_ids
        )


def _config_from_dir(directory: Path, name: str) -> ModelConfig:
    config_path = directory / "config.json"
    try:
        hf = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise UserError(
            f"{directory} has no config.json; point --model at a Hugging Face model directory"
        ) from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{config_path} is not valid JSON ({exc})") from None
    try:
        return ModelConfig.from_hf(hf, name=name)
    except (KeyError, MissingSize) as exc:  # a field the model's family requires
        field = exc.fields[0] if isinstance(exc, MissingSize) else exc.args[0]
        raise UserError(
            f"{config_path} lacks the field {field!r}, which a "
            f"{hf.get('model_type', 'model')} config needs; restore config.json from the "
            "model's repo"
        ) from None


def _from_path(path: Path, dummy: bool, seed: int) -> ModelSpec:
    if path.is_dir():
        config = _config_from_dir(path, path.name)
        spec = ModelSpec(path.name, config, "dummy" if dummy else "safetensors", path, seed)
        spec.weight_format()  # a quantization we cannot read is refused here, by name
        if not dummy:  # a missing or cut shard is refused here, not at its layer
            from offload.models.checkpoint import check_shards

            check_shards(path)
        return spec
    if path.suffix == ".gguf":
        from offload.models.gguf_file import gguf_config, open_gguf

        reader = open_gguf(path)
        config = gguf_config(reader, path.stem)
        return ModelSpec(path.stem, config, "dummy" if dummy else "gguf", path, seed, reader)
    raise UserError(f"{path} is neither a model directory nor a .gguf file")


def _hub_error(repo_id: str, revision: str | None, exc: Exception) -> UserError | None:
    """One line naming the repo and the fix for the hub's typed errors (None: not one)."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    page = f"https://huggingface.co/{repo_id}"
    if isinstance(exc, GatedRepoError):
        return UserError(
            f"model {repo_id} is gated on the hub; accept its terms at {page}, then log in "
            "(hf auth login, or set HF_TOKEN)"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return UserError(
            f"model {repo_id} is not on the hub (or is private); check the repo id, or log in "
            "(hf auth login, or set HF_TOKEN) if it is private"
        )
    if isinstance(exc, RevisionNotFoundError):
        return UserError(
            f"revision {revision!r} of model {repo_id} does not exist; pass --revision with a "
            f"branch, tag or commit listed at {page}"
        )
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "an error"
        return UserError(f"the hub answered {status} for model {repo_id}; try again later")
    return None


def _from_hub(repo_id: str, revision: str | None = None) -> Path:
    """The repo's snapshot: from the local cache, else downloaded (config, weights,
    tokenizer). Hub failures become one-line `UserError`s naming the repo and the fix."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    def download(local_only: bool) -> Path:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=HUB_PATTERNS,
                local_files_only=local_only,
            )
        )

    try:
        return download(local_only=True)
    except LocalEntryNotFoundError:
        pass
    except HFValidationError as exc:
        raise UserError(f"{repo_id!r} is not a valid hub repo id ({exc})") from None
    try:
        return download(local_only=False)
    except (LocalEntryNotFoundError, ConnectionError) as exc:  # offline, or no network
        log.debug("hub download of %s failed: %s", repo_id, exc)
        raise UserError(
            f"model {repo_id}{'@' + revision if revision else ''} is not in the local Hugging "
            "Face cache and the hub cannot be reached (offline); download it on a connected "
            f"machine (hf download {repo_id})"
        ) from None
    except Exception as exc:  # the hub client raises many types; typed ones are named
        error = _hub_error(repo_id, revision, exc)
        if error is None:
            raise UserError(f"cannot fetch model {repo_id} from the hub: {exc}") from None
        raise error from None


def _looks_like_path(text: str) -> bool:
    return (
        text.startswith(("/", "./", "../", "~"))
        or text.endswith((".gguf", ".json", ".safetensors"))
        or text.count("/") > 1
    )


def resolve_model(
    text: str, dummy: bool = False, seed: int = 0, revision: str | None = None
) -> ModelSpec:
    """Resolve a --model argument; raise `UserError` with the fix when nothing matches."""
    if text.lower() in ("demo", DEMO_NAME):
        if dummy:
            return ModelSpec(DEMO_NAME, ModelConfig.from_hf(PRESETS[DEMO_NAME], DEMO_NAME), "dummy")
        from offload.models.demo import demo_model_path

        return _from_path(demo_model_path(), dummy=False, seed=seed)
    path = Path(text).expanduser()
    if path.exists():
        return _from_path(path, dummy, seed)
    if _looks_like_path(text):
        raise UserError(f"model path {text} does not exist; check the path")
    preset = preset_for(text)
    if preset is not None and (dummy or "/" not in text):
        return ModelSpec(preset, ModelConfig.from_hf(PRESETS[preset], preset), "dummy", None, seed)
    if "/" in text:
        try:
            return _from_path(_from_hub(text, revision), dummy, seed)
        except UserError as exc:
            if preset is None:
                raise
            raise UserError(
                f"{exc}, or pass --dummy (dummy=True in Python) to run its preset "
                f"'{preset}' with random weights"
            ) from None
    raise UserError(
        f"unknown model {text!r}: not a path, a preset or a hub repo id; presets: "
        f"demo, {', '.join(PRESETS)}"
    )
