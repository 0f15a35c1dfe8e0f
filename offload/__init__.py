"""offload: high-throughput offline generation with models larger than one GPU."""

from offload.args import EngineArgs
from offload.config import ModelConfig
from offload.engine import LLM
from offload.outputs import CompletionOutput, RequestOutput
from offload.sampling import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"
