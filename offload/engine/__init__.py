"""vLLM's `vllm.engine` import path as `offload.engine` (only `arg_utils` is here)."""
