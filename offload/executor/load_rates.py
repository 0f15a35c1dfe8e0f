"""The load's placement rates on this machine, for the hardware profile (`place_gbps`):
what `policies.job.load_estimate` divides a plan's stage bytes by."""

from __future__ import annotations

import torch

from offload.core.config import ModelConfig
from offload.core.presets import PRESETS
from offload.executor.executor import Executor
from offload.io.layout import stage_image_bytes
from offload.kernels.formats import Compression
from offload.models.weights import DummySource
from offload.policies.hardware import GB, format_name
from offload.policies.policy import Placement, Policy

# a Llama layer at full width on the GPU, two of them (0.9 GB in float16); 256 wide on
# the CPU, where the tests measure profiles
PLACE_CONFIG = {**PRESETS["llama-3.1-8b"], "num_hidden_layers": 2, "vocab_size": 512}
CPU_NARROW = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 768}  # fmt: skip


def place_rates(device: torch.device) -> dict[str, float]:
    """The load's placement rate per weight format and home tier ("int4/gpu", ...):
    stage bytes (as stored) a second that `Executor`'s weight loading places from dummy
    weights (drawn and quantized on the device, assembled in host memory, copied to
    the home), on a Llama layer at full width (256 wide on the CPU), two layers. The
    weights' pool is pinned before and timed apart (`measure.pin_rate`)."""
    wide = device.type == "cuda"
    cfg = ModelConfig.from_hf({**PLACE_CONFIG, **({} if wide else CPU_NARROW)}, "place-probe")
    dtype = torch.float16 if wide else torch.float32
    homes = {"gpu": Placement(1.0, 0.0, 0.0), "cpu": Placement(0.0, 1.0, 0.0)}
    int4 = Compression(4, 64, False)

    def place_s(placement: Placement, compression: Compression | None) -> float:
        policy = Policy(1, 1, weights=placement, weight_compression=compression)
        ex = Executor(DummySource(cfg), policy, dtype, device)
        try:
            return ex.load_parts["place_s"]
        finally:
            ex.close()

    place_s(homes["cpu"], int4)  # untimed: loads the drawing and quantizing kernels
    out: dict[str, float] = {}
    for compression in (None, Compression(8, 64, False), int4):
        nbytes = sum(stage_image_bytes(cfg, dtype, compression))
        for tier, placement in homes.items():
            out[f"{format_name(compression)}/{tier}"] = (
                nbytes / place_s(placement, compression) / GB
            )
    return out
