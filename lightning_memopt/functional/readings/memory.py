"""One device-agnostic memory reading, and the calls that act on a device's allocator (peak reset, cache release).

This module is the only place in the package that knows how each backend reports memory. Everything
else (callbacks, reports, analysis) works with :class:`MemoryReading` and the JSONL record built from it.

Backends:

* ``cuda``: ``torch.cuda.memory_stats`` (current and peak allocated/reserved/active bytes, allocator
  retries, OOM count) and ``torch.cuda.mem_get_info`` (free and total device bytes).
* ``xpu``: the same fields through ``torch.xpu`` where the installed torch provides them.
* ``mps``: current allocated bytes, driver-allocated bytes (reported as reserved) and the recommended
  working-set size (reported as the device total); MPS has no peaks.
* ``cpu`` and anything else: host figures only; every device field is ``None``.

Host resident set size (RSS) is read for every backend.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch

from lightning_memopt.functional.readings.host_memory import host_rss_bytes
from lightning_memopt.utilities.checks import check_device, check_device_usable

__all__ = [
    "MEMORY_FIELDS",
    "DeviceMemory",
    "MemoryReading",
    "empty_device_cache",
    "host_rss_bytes",
    "memory_record",
    "read_memory",
    "reset_peak_memory",
    "resolve_device",
    "supports_device_memory",
]

#: The byte/count fields of a reading, in the order they appear in JSONL records.
MEMORY_FIELDS: tuple[str, ...] = (
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "device_total_bytes",
    "device_free_bytes",
    "host_rss_bytes",
    "num_alloc_retries",
    "num_ooms",
)


@dataclass(frozen=True)
class MemoryReading:
    """Memory figures of one device at one moment.

    All sizes are bytes. Figures the device cannot give are ``None``, never invented.

    Args:
        time: Unix time in seconds when the reading was taken.
        device: The device the reading is for, e.g. ``"cuda:0"`` or ``"cpu"``.
        allocated_bytes: Bytes held by live tensors (the allocator's "allocated").
        reserved_bytes: Bytes the caching allocator holds from the driver (allocated + cached).
        active_bytes: Bytes in active blocks (allocated plus blocks waiting to be freed by a stream).
        peak_allocated_bytes: Highest ``allocated_bytes`` since the last peak reset.
        peak_reserved_bytes: Highest ``reserved_bytes`` since the last peak reset.
        device_total_bytes: Total memory of the device.
        device_free_bytes: Free memory of the device as the driver reports it (all processes).
        host_rss_bytes: Resident set size of this process on the host.
        num_alloc_retries: Times the allocator had to free its cache and retry an allocation.
        num_ooms: Out-of-memory errors the allocator has raised in this process.

    Examples:
        >>> reading = read_memory("cpu")
        >>> reading.allocated_bytes is None and reading.host_rss_bytes > 0
        True
    """

    time: float
    device: str
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    active_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    device_total_bytes: int | None = None
    device_free_bytes: int | None = None
    host_rss_bytes: int | None = None
    num_alloc_retries: int | None = None
    num_ooms: int | None = None

    def as_dict(self) -> dict[str, Any]:
        """The reading as a plain dict (JSON-serialisable)."""
        return dataclasses.asdict(self)

    @property
    def device_type(self) -> str:
        """The device type without index (``"cuda"``, ``"cpu"``, ...)."""
        return self.device.split(":", 1)[0]

    def fraction_of_total(self, field: str) -> float | None:
        """``field`` as a fraction of the device total, or ``None`` if either is unknown.

        Examples:
            >>> MemoryReading(time=0.0, device="cuda:0", allocated_bytes=3, device_total_bytes=4).fraction_of_total(
            ...     "allocated_bytes")
            0.75
        """
        value = getattr(self, field)
        if value is None or not self.device_total_bytes:
            return None
        return value / self.device_total_bytes


def resolve_device(device: torch.device | str | int | None = None) -> torch.device:
    """Normalise ``device`` to a ``torch.device`` with an index for indexed backends.

    ``None`` means the current CUDA device when CUDA is available, else the CPU.

    Examples:
        >>> resolve_device("cpu")
        device(type='cpu')
    """
    if device is None:
        device = "cpu"
        if torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
    check_device("device", device)
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type in ("cuda", "xpu") and device.index is None:
        check_device_usable(device)
        module = getattr(torch, device.type)
        device = torch.device(device.type, module.current_device())
    return device


def supports_device_memory(device: torch.device | str) -> bool:
    """Whether ``device`` gives allocator readings (allocated/reserved bytes) on this build of torch.

    Examples:
        >>> supports_device_memory("cpu")
        False
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available()
    if device.type == "xpu":
        xpu = getattr(torch, "xpu", None)
        return bool(xpu is not None and xpu.is_available() and hasattr(xpu, "memory_stats"))
    if device.type == "mps":
        return bool(torch.backends.mps.is_available() and hasattr(torch.mps, "current_allocated_memory"))
    return False


def _from_allocator_stats(stats: dict[str, Any]) -> dict[str, int | None]:
    def get(key: str) -> int | None:
        value = stats.get(key)
        return None if value is None else int(value)

    return {
        "allocated_bytes": get("allocated_bytes.all.current"),
        "reserved_bytes": get("reserved_bytes.all.current"),
        "active_bytes": get("active_bytes.all.current"),
        "peak_allocated_bytes": get("allocated_bytes.all.peak"),
        "peak_reserved_bytes": get("reserved_bytes.all.peak"),
        "num_alloc_retries": get("num_alloc_retries"),
        "num_ooms": get("num_ooms"),
    }


def _read_cuda_like(module: Any, device: torch.device) -> dict[str, int | None]:
    fields = _from_allocator_stats(module.memory_stats(device))
    mem_get_info = getattr(module, "mem_get_info", None)
    if mem_get_info is not None:
        free, total = mem_get_info(device)
        fields["device_free_bytes"] = int(free)
        fields["device_total_bytes"] = int(total)
    else:
        fields["device_total_bytes"] = int(module.get_device_properties(device).total_memory)
    return fields


def _read_mps() -> dict[str, int | None]:
    fields: dict[str, int | None] = {"allocated_bytes": int(torch.mps.current_allocated_memory())}
    if hasattr(torch.mps, "driver_allocated_memory"):
        fields["reserved_bytes"] = int(torch.mps.driver_allocated_memory())
    if hasattr(torch.mps, "recommended_max_memory"):
        fields["device_total_bytes"] = int(torch.mps.recommended_max_memory())
    return fields


def read_memory(device: torch.device | str | int | None = None) -> MemoryReading:
    """Read the memory figures of ``device`` and of the host process.

    Decide the device once (``supports_device_memory``) rather than calling this in a try/except in a
    hot path: on a device without allocator readings this returns host figures and ``None`` elsewhere.

    Args:
        device: The device to read. ``None`` means the current CUDA device, or the CPU without CUDA.

    Returns:
        A :class:`MemoryReading`.

    Raises:
        ValueError: if ``device`` is not a ``torch.device``, a device string (``"cuda:0"``, ``"cpu"``), an index
            (int >= 0) or ``None``; or names a CUDA/XPU device this process cannot use (the backend is not
            available, or the index is out of range: :func:`check_device_usable`). A monitoring hook that reads
            through this turns the error into one warning.

    Examples:
        >>> r = read_memory("cpu")
        >>> (r.device, r.reserved_bytes, r.peak_allocated_bytes)
        ('cpu', None, None)
    """
    check_device("device", device)
    device = resolve_device(device)
    check_device_usable(device)
    fields: dict[str, int | None] = {}
    if supports_device_memory(device):
        if device.type == "cuda":
            fields = _read_cuda_like(torch.cuda, device)
        elif device.type == "xpu":
            fields = _read_cuda_like(torch.xpu, device)
        elif device.type == "mps":
            fields = _read_mps()
    return MemoryReading(time=time.time(), device=str(device), host_rss_bytes=host_rss_bytes(), **fields)


def reset_peak_memory(device: torch.device | str | int | None = None) -> bool:
    """Reset the allocator's peak counters of ``device``.

    Returns:
        ``True`` if the backend has peaks and they were reset, ``False`` otherwise (CPU, MPS).

    Examples:
        >>> reset_peak_memory("cpu")
        False
    """
    device = resolve_device(device)
    if not supports_device_memory(device) or device.type == "mps":
        return False
    module = getattr(torch, device.type)
    if not hasattr(module, "reset_peak_memory_stats"):
        return False
    module.reset_peak_memory_stats(device)
    return True


def memory_record(
    reading: MemoryReading,
    *,
    rank: int,
    phase: str,
    event: str,
    epoch: int | None = None,
    global_step: int | None = None,
    batch_idx: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """One JSONL record: the reading plus where in training it was taken.

    Keys follow the memory log format (``docs/memory-log.md``): ``time``, ``rank``, ``phase``, ``event``,
    ``epoch``, ``global_step``, ``batch_idx``, ``device``, then the memory fields, then ``extra``.

    Examples:
        >>> rec = memory_record(MemoryReading(time=1.0, device="cpu", host_rss_bytes=10), rank=0, phase="train",
        ...                     event="step", epoch=0, global_step=3, batch_idx=2)
        >>> list(rec)[:8]
        ['time', 'rank', 'phase', 'event', 'epoch', 'global_step', 'batch_idx', 'device']
        >>> rec["host_rss_bytes"], rec["allocated_bytes"]
        (10, None)
    """
    record: dict[str, Any] = {
        "time": reading.time,
        "rank": rank,
        "phase": phase,
        "event": event,
        "epoch": epoch,
        "global_step": global_step,
        "batch_idx": batch_idx,
        "device": reading.device,
    }
    for field in MEMORY_FIELDS:
        record[field] = getattr(reading, field)
    record.update(extra)
    return record


def empty_device_cache(device: torch.device | str | int | None = None) -> bool:
    """Return the caching allocator's unused blocks of ``device`` to the driver.

    Runs under the device's context (``torch.cuda.device(device)``) so that the right GPU's cache is
    emptied in multi-GPU processes. This never lowers peak allocated memory: it only releases cached,
    unreferenced blocks, and later allocations pay for fresh driver calls.

    Returns:
        ``True`` if the backend has a cache and it was emptied, ``False`` otherwise (CPU).

    Examples:
        >>> empty_device_cache("cpu")
        False
    """
    device = resolve_device(device)
    if not supports_device_memory(device):
        return False
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.empty_cache()
    elif device.type == "xpu":
        with torch.xpu.device(device):
            torch.xpu.empty_cache()
    elif device.type == "mps":
        torch.mps.empty_cache()
    else:
        return False
    return True


class DeviceMemory:
    """The memory of one device, as the monitoring cores read it: :meth:`read`, :meth:`reset_peaks`.

    Whether the device gives allocator readings is decided once, here; on a device without them (CPU) peaks are
    never reset and readings carry host figures only. Tests pass a fake with the same two methods instead.

    Args:
        device: The device to read (see :func:`read_memory`).

    Examples:
        >>> memory = DeviceMemory("cpu")
        >>> memory.has_device_memory, memory.reset_peaks(), memory.read().device
        (False, False, 'cpu')
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.has_device_memory = supports_device_memory(self.device)
        # The CPU gives host figures only: its reading is built here directly, without deciding again each time.
        self._host_only = None if self.has_device_memory or self.device.type != "cpu" else str(self.device)

    def read(self) -> MemoryReading:
        """A reading of the device now (raises what :func:`read_memory` raises)."""
        if self._host_only is not None:
            return MemoryReading(time=time.time(), device=self._host_only, host_rss_bytes=host_rss_bytes())
        return read_memory(self.device)

    def reset_peaks(self) -> bool:
        """Reset the allocator's peak counters; ``False`` where the device has none."""
        return self.has_device_memory and reset_peak_memory(self.device)
