"""vLLM's `vllm.utils.argparse_utils` (newer vLLM) as `offload.utils.argparse_utils`."""

from offload.api.args import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
