"""vLLM's `vllm.v1.metrics` as `offload.v1.metrics`. Only re-exports."""
