"""One record per model family: what its layers are made of, and how it is priced.

`ModelConfig.family` names a record here; the models (`models.decoder`, `models.ops`),
the memory plan and the cost model read its fields instead of checking names. The
elementwise probe is the family whose measured figure prices a layer's work besides
its matmuls and attention (`executor.fixed_costs.ELEMENTWISE_CONFIGS` measures those;
`policies.cost` reads `hw.decode_elementwise_s[record.elementwise_probe]`), so every
supported family is priced from a measured figure, never from a default of zero
(`tests/test_families.py` checks each supported model type).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """A family's layer: its norm (`kernels.norm`'s kind), MLP activation, position
    encoding, whether the MLP is gated and the projections carry biases, and the probed
    family its elementwise time is priced as."""

    name: str
    norm: str  # "rms", "rms_offset" (Gemma's (1 + w)) or "layer"
    activation: str  # "silu", "gelu_tanh", "gelu" or "relu"
    positions: str  # "rope", "alibi" or "learned"
    gated_mlp: bool
    linear_bias: bool  # o-proj and MLP biases (a config's `bias` can add them)
    elementwise_probe: str

    def __post_init__(self) -> None:
        assert self.norm in ("rms", "rms_offset", "layer"), self.norm
        assert self.activation in ("silu", "gelu_tanh", "gelu", "relu"), self.activation
        assert self.positions in ("rope", "alibi", "learned"), self.positions
        assert self.elementwise_probe in PROBED, self.elementwise_probe


# the families whose layers the elementwise probe measures (`executor.fixed_costs`)
PROBED = ("llama", "opt", "bloom")

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "rms", "silu", "rope", True, False, "llama"),
        # Gemma as Llama: RMS norms, a gated MLP, RoPE
        Family("gemma", "rms_offset", "gelu_tanh", "rope", True, False, "llama"),
        Family("opt", "layer", "relu", "learned", False, True, "opt"),
        Family("bloom", "layer", "gelu_tanh", "alibi", False, True, "bloom"),
        # Falcon as BLOOM: LayerNorm and GELU, no gate
        Family("falcon", "layer", "gelu", "rope", False, False, "bloom"),
    )
}


def family(name: str) -> Family:
    """The record of a family (`ModelConfig.family`)."""
    return FAMILIES[name]
