"""Peak resident memory of this process while a block of code runs (sampled in a background thread)."""

from __future__ import annotations

import threading

import psutil

__all__ = ["PeakRSSSampler"]


class PeakRSSSampler:
    """Samples this process's resident set size in a background thread while a ``with`` block runs.

    Matrix products release the GIL, so the thread keeps sampling during them. The growth is the peak seen minus
    the value at entry: what the block needed on top of what the process already held.

    Args:
        interval_s: Seconds between samples.

    Example:
        >>> import torch
        >>> with PeakRSSSampler() as rss:
        ...     block = torch.ones(2**22)  # 16 MiB
        >>> rss.growth_bytes >= 0
        True
    """

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self._process = psutil.Process()
        self.start_bytes = 0
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)

    def __enter__(self) -> PeakRSSSampler:
        self.start_bytes = self.peak_bytes = self._process.memory_info().rss
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="peak-rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)

    @property
    def growth_bytes(self) -> int:
        """Peak RSS during the block minus RSS at its start."""
        return self.peak_bytes - self.start_bytes
