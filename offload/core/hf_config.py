"""A `config.json`'s dict as transformers reads it: the keys a family's config class
fills by default made explicit (`config.ModelConfig.from_hf` reads this, never the
raw JSON).

A key a checkpoint's `config.json` leaves out means the value its transformers class
defaults to: Gemma 2's `attn_logit_softcapping` (50.0) and `final_logit_softcapping`
(30.0), Gemma 2's `head_dim` (256, not hidden / heads), Llama's `eos_token_id` (2).
Read as raw JSON, such a key was missed and the model silently computed something
else. The class is built from the dict (`from_dict`, the step `AutoConfig` takes after
reading the file; no remote code: only the classes transformers ships) and its
`to_dict()` lies over the raw keys, so a reader sees transformers' names and values
(transformers 5's `rope_parameters` and `layer_types`, `dtype`) and keeps any raw key
the class drops.

The sizes a checkpoint's tensors have (`SIZE_KEYS`) are not taken from a default: the
class's is the size of some other model (Llama-7B's 4096), so a config.json without
one is refused, naming it.
"""

from __future__ import annotations

from typing import Any

from offload.core.errors import UserError

# the sizes a config.json must state itself, each with the older names some families'
# configs use for it
SIZE_KEYS: dict[str, tuple[str, ...]] = {
    "vocab_size": (),
    "hidden_size": ("n_embed",),
    "num_hidden_layers": ("n_layer",),
    "num_attention_heads": ("n_head",),
}


# model types whose checkpoints ship their own code (remote code, never run here) for an
# architecture transformers has a class of: read with that class, the type kept
READ_AS = {"kimi_k2": "deepseek_v3"}


def with_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` (a config.json's dict, model_type one transformers knows) with every key its
    transformers config class fills, in the class's names; UserError where a size is
    missing or the class refuses a value."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = raw["model_type"]
    _refuse_missing_sizes(raw)
    config_class = CONFIG_MAPPING[READ_AS.get(model_type, model_type)]
    try:
        config = config_class.from_dict(raw)
    except (ValueError, TypeError, KeyError, StrictDataclassError) as exc:
        # (transformers 5 validates its config classes' fields through huggingface_hub)
        message = " ".join(str(exc).split())
        raise UserError(
            f"config.json of model type {model_type!r} does not read as transformers' "
            f"{config_class.__name__}: {message}"
        ) from None
    return {**raw, **config.to_dict(), "model_type": model_type}


class MissingSize(UserError):
    """A config without a size its model needs; `fields` names them (the reader of a
    file adds its path: `models.resolve`)."""

    def __init__(self, fields: list[str]) -> None:
        self.fields = fields
        super().__init__(
            f"config.json has no {', '.join(fields)}: the checkpoint's sizes must be "
            "stated there (transformers' default is another model's)"
        )


def _refuse_missing_sizes(raw: dict[str, Any]) -> None:
    """A multimodal config's sizes are its language model's (`text_config`)."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    missing = [
        key
        for key, older in SIZE_KEYS.items()
        if all(text.get(name) is None for name in (key, *older))
    ]
    if missing:
        raise MissingSize(missing)
