"""vLLM's `vllm.outputs` as `offload.outputs` (`from vllm.outputs import RequestOutput`).
Only re-exports: the classes live in `offload.core.outputs`."""

from offload.core.outputs import CompletionOutput, RequestOutput

__all__ = ["CompletionOutput", "RequestOutput"]
