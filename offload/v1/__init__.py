"""vLLM's import path `vllm.v1` as `offload.v1` (its metrics reader). Only re-exports."""
