"""The weight formats a plan may use: --compress's, or a pre-quantized checkpoint's own
(`models.prequant`), which runs as it is (an fp8 one may be converted once). Judged by
`planning.plan` before any search, and by offload-convert."""

from __future__ import annotations

from offload.api.args import EngineArgs, compression_text
from offload.api.front import ModelFront
from offload.core.errors import UserError
from offload.kernels.formats import Compression
from offload.policies.policy import Policy


def checkpoint_formats(
    front: ModelFront, args: EngineArgs, policy: Policy | None, tensor_parallel: bool
) -> tuple[Compression | None, ...]:
    """The weight formats a search may choose: --compress's, or a pre-quantized
    checkpoint's own (`models.prequant`), whose matrices stay as they are; a --compress
    or --policy asking for another format is refused then (an fp8 checkpoint's: one
    asking for int4 or int8 converts it, `weight_formats`)."""
    fixed = front.spec.weight_format()
    formats = weight_formats(fixed, args.compress, args.compressions())
    if fixed is None:
        return formats
    if tensor_parallel:
        raise UserError(
            f"--tp with a pre-quantized ({compression_text(fixed)}) checkpoint is not "
            "supported; run it on one GPU with offloading (--gpu-mem, --cpu-mem, --nvme)"
        )
    converts = fixed.fp8 and policy is not None and policy.weight_compression is not None
    if policy is not None and policy.weight_compression != fixed and not converts:
        raise UserError(
            f"the policy's weight_compression {policy.weight_compression} is not the "
            f"pre-quantized checkpoint's; set it to {fixed.__dict__}"
        )
    return formats


def weight_formats(
    fixed: Compression | None, compress: str, requested: tuple[Compression | None, ...]
) -> tuple[Compression | None, ...]:
    """The weight formats a plan may use: --compress's (`requested`), or a pre-quantized
    checkpoint's own (`fixed`), refusing a --compress that names another. An fp8
    checkpoint with --compress int4 or int8 is converted once, from its dequantized
    values (`kernels.quant.compress_stage`); none and auto keep it in fp8."""
    if fixed is None:
        return requested
    text = compression_text(fixed)
    if fixed.fp8 and compress not in ("none", "auto", text):
        return requested
    if compress not in ("none", "auto", text):
        raise UserError(
            f"--compress {compress}: the checkpoint is already quantized ({text}) "
            "and runs in its own format; drop --compress"
        )
    return (fixed,)
