"""Pure functions: no Trainer, no hooks."""

from lightning_memopt.functional.conversion import to_device_and_dtype
from lightning_memopt.functional.memory import MemoryReading, memory_record, read_memory, reset_peak_memory

__all__ = ["MemoryReading", "memory_record", "read_memory", "reset_peak_memory", "to_device_and_dtype"]
