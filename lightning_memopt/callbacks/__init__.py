"""Lightning callbacks."""

from lightning_memopt.callbacks.allocator_settings import AllocatorSettings
from lightning_memopt.callbacks.auto_micro_batch import AutoMicroBatch
from lightning_memopt.callbacks.cache_cleaner import CacheCleaner
from lightning_memopt.callbacks.garbage_collector import GarbageCollector
from lightning_memopt.callbacks.gradient_checkpointing import GradientCheckpointing
from lightning_memopt.callbacks.memory_audit import MemoryAudit
from lightning_memopt.callbacks.memory_monitor import MemoryMonitor
from lightning_memopt.callbacks.oom_reporter import OOMReporter

__all__ = [
    "AllocatorSettings",
    "AutoMicroBatch",
    "CacheCleaner",
    "GarbageCollector",
    "GradientCheckpointing",
    "MemoryAudit",
    "MemoryMonitor",
    "OOMReporter",
]
