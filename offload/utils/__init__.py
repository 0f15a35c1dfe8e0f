"""vLLM's import path `vllm.utils` as `offload.utils`: the argument parser its examples
import (`from vllm.utils import FlexibleArgumentParser`, older vLLM). Only re-exports:
the parser lives in `offload.api.args`."""

from offload.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
