"""offload: high-throughput offline generation with models larger than one GPU."""

from offload.api.args import EngineArgs
from offload.api.llm import LLM
from offload.core.config import ModelConfig
from offload.core.logs import configure_package_logger
from offload.core.outputs import CompletionOutput, RequestOutput
from offload.core.sampling import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"

configure_package_logger()  # vLLM's habit: the load's lines show without set-up
