"""vLLM's `vllm.distributed` as `offload.distributed`: `cleanup_dist_env_and_memory`, which
its examples call between two engines. Only re-exports: it lives in `offload.api.profiling`."""

from offload.api.profiling import cleanup_dist_env_and_memory

__all__ = ["cleanup_dist_env_and_memory"]
