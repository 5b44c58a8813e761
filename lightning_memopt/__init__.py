"""lightning-memopt: keep PyTorch Lightning training inside GPU memory, and say why when it cannot."""

from lightning_memopt.__about__ import __version__
from lightning_memopt.callbacks import (
    CacheCleaner,
    GarbageCollector,
    GradientCheckpointing,
    MemoryAudit,
    MemoryMonitor,
    OOMReporter,
)
from lightning_memopt.functional.conversion import to_device_and_dtype
from lightning_memopt.functional.memory import MemoryReading, read_memory
from lightning_memopt.metrics import StreamingRetrievalMetric
from lightning_memopt.plugins import MemoryPrecision, MemoryPreset

__all__ = [
    "CacheCleaner",
    "GarbageCollector",
    "GradientCheckpointing",
    "MemoryAudit",
    "MemoryMonitor",
    "MemoryPrecision",
    "MemoryPreset",
    "MemoryReading",
    "OOMReporter",
    "StreamingRetrievalMetric",
    "__version__",
    "read_memory",
    "to_device_and_dtype",
]
