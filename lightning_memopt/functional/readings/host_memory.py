"""The resident set size of this process, read cheaply enough for every step.

On Linux it is read from ``/proc/self/statm`` through a descriptor kept open (one ``pread`` a reading: opening the
file, or asking psutil, costs several times more); elsewhere, or without ``/proc``, psutil is asked.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["host_rss_bytes"]

_PROCESS: Any = None


class _StatmReader:
    """``/proc/self/statm`` kept open, one ``pread`` a reading (opening it, or psutil, costs several times more).
    Reopened in a forked child; after a failure (no ``/proc``) it gives ``None`` for good: psutil is asked instead."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.pid, self.page_size = -1, 0
        self.failed = not os.path.exists("/proc/self/statm")

    def read(self) -> int | None:
        if self.failed:
            return None
        try:
            pid = os.getpid()
            if self.fd is None or self.pid != pid:  # first use, or a forked child holding its parent's file
                # A child leaves its copy of the parent's descriptor open: the number may have been reused since.
                self.fd, self.pid = None, pid
                self.page_size = os.sysconf("SC_PAGE_SIZE")
                self.fd = os.open("/proc/self/statm", os.O_RDONLY)  # not inherited by programs it runs (PEP 446)
            return int(os.pread(self.fd, 256, 0).split()[1]) * self.page_size
        except (OSError, ValueError, IndexError, AttributeError):
            self.failed = True
            return None


_STATM = _StatmReader()


def host_rss_bytes() -> int | None:
    """Resident set size of this process in bytes, or ``None`` if the platform does not say.

    Examples:
        >>> host_rss_bytes() > 0
        True
    """
    global _PROCESS
    rss = _STATM.read()
    if rss is not None:
        return rss
    try:
        import psutil
    except ImportError:
        return None
    try:
        if _PROCESS is None:
            _PROCESS = psutil.Process(os.getpid())
        return int(_PROCESS.memory_info().rss)
    except (psutil.Error, OSError, RuntimeError):
        return None
