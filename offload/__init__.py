"""offload: high-throughput offline generation with models larger than one GPU."""

from offload.config import ModelConfig
from offload.engine import LLM, RequestOutput
from offload.sampling import SamplingParams

__all__ = ["LLM", "ModelConfig", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
