"""Trainer-free cores: no Trainer, no hooks. The callbacks, metrics and plugins are thin shells over them.

Grouped by feature: ``micro_batch`` (AutoMicroBatch), ``audit`` (MemoryAudit), ``readings`` (memory readings),
``oom`` (the OOM report), ``planning`` (the estimator), ``footprint``, ``retrieval``; one module per single core.

Not all of them are pure: some act on what they are given (``to_device_and_dtype`` converts the model in place,
``reset_peak_memory`` resets the allocator's peak counters, ``wrap_checkpointing`` wraps the model's blocks).
"""

from lightning_memopt.functional.checkpointing import wrap_checkpointing
from lightning_memopt.functional.conversion import to_device_and_dtype
from lightning_memopt.functional.readings.memory import MemoryReading, memory_record, read_memory, reset_peak_memory

__all__ = [
    "MemoryReading",
    "memory_record",
    "read_memory",
    "reset_peak_memory",
    "to_device_and_dtype",
    "wrap_checkpointing",
]
