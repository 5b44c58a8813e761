"""lightning_memopt.metrics."""

from lightning_memopt.metrics.streaming_retrieval import StreamingRetrievalMetric

__all__ = ["StreamingRetrievalMetric"]
