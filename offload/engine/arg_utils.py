"""vLLM's `vllm.engine.arg_utils` as `offload.engine.arg_utils`
(`from vllm.engine.arg_utils import EngineArgs`). Only re-exports: `EngineArgs` lives in
`offload.api.args`."""

from offload.api.args import EngineArgs

__all__ = ["EngineArgs"]
