"""A fake allocator that stands in for CUDA readings on CPU, to test peak and threshold logic."""

from __future__ import annotations

import time

import torch

from lightning_memopt.functional.readings.memory import MemoryReading


class FakeAllocator:
    """Tracks allocated/reserved bytes and their peaks the way the CUDA caching allocator reports them.

    It has the two methods of a :class:`~lightning_memopt.functional.readings.monitoring.MemoryReader` (``read``,
    ``reset_peaks``): pass it to a core directly, or :meth:`install` it where a callback builds its reader.
    """

    has_device_memory = True
    device = torch.device("cuda", 0)

    def __init__(self, total: int = 10_000) -> None:
        self.total = total
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.resets = 0
        self.fail = False

    def set(self, allocated: int, reserved: int | None = None) -> None:
        self.allocated = allocated
        self.reserved = max(self.reserved, allocated) if reserved is None else reserved
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def read(self) -> MemoryReading:
        if self.fail:
            raise RuntimeError("driver went away")
        return MemoryReading(
            time=time.time(),
            device="cuda:0",
            allocated_bytes=self.allocated,
            reserved_bytes=self.reserved,
            active_bytes=self.allocated,
            peak_allocated_bytes=self.peak_allocated,
            peak_reserved_bytes=self.peak_reserved,
            device_total_bytes=self.total,
            device_free_bytes=self.total - self.reserved,
            host_rss_bytes=123,
            num_alloc_retries=0,
            num_ooms=0,
        )

    def reset_peaks(self) -> bool:
        self.resets += 1
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved
        return True

    def install(self, monkeypatch, module) -> FakeAllocator:
        """Make ``module`` (a callback module) read this allocator instead of the real device: the callback's
        ``DeviceMemory(device)`` becomes this fake."""
        monkeypatch.setattr(module, "DeviceMemory", lambda device: self)
        return self
