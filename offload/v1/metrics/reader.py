"""vLLM's `vllm.v1.metrics.reader` as `offload.v1.metrics.reader` (`from vllm.v1.metrics.reader
import Counter, Gauge, Histogram, Vector`, as its metrics example). Only re-exports: the
classes live in `offload.core.metrics`."""

from offload.core.metrics import Counter, Gauge, Histogram, Metric, Vector

__all__ = ["Counter", "Gauge", "Histogram", "Metric", "Vector"]
