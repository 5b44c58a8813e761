"""The Trainer-free core of ``MemoryMonitor``: per-phase peaks, threshold crossings and the metrics of a reading.

Nothing here knows about a Trainer or a hook. The monitor feeds it readings through a :class:`MemoryReader` (a
:class:`~lightning_memopt.functional.readings.memory.DeviceMemory` in training, a fake in tests) and decides what to
write
and log.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lightning_memopt.functional.readings.memory import MemoryReading, memory_record
from lightning_memopt.utilities.formatting import format_bytes

__all__ = [
    "CROSS_RANK_FIELDS",
    "PEAK_FIELDS",
    "STEP_FIELDS",
    "MemoryReader",
    "MonitorRecords",
    "PhasePeaks",
    "Position",
    "position_record",
    "ThresholdWatch",
    "cross_rank_metrics",
    "cross_rank_values",
    "step_metrics",
]

#: Fields logged to Lightning loggers on every logged step (when the device gives them).
STEP_FIELDS = (
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "device_free_bytes",
    "host_rss_bytes",
    "num_alloc_retries",
    "num_ooms",
)
#: Fields logged once per phase, at its end.
PEAK_FIELDS = ("peak_allocated_bytes", "peak_reserved_bytes")
#: Fields compared with the device total for a threshold warning.
THRESHOLD_FIELDS = ("allocated_bytes", "reserved_bytes")
#: Fields the ranks exchange for their min, max and mean.
CROSS_RANK_FIELDS = ("allocated_bytes", "reserved_bytes", "host_rss_bytes")


class MemoryReader(Protocol):
    """Where the cores get readings: ``read()`` (``None``: no reading this time) and ``reset_peaks()``."""

    def read(self) -> MemoryReading | None: ...

    def reset_peaks(self) -> bool: ...


class PhasePeaks:
    """A stack of running phases, each with its own peak: a nested phase's memory does not count for the outer one.

    The allocator's peak counters are reset when a phase starts and when it ends; before a nested phase starts, the
    outer phase's peak so far is folded into its running maximum, so the outer phase's peak at its end covers its
    own time only.

    Args:
        reader: Gives the readings and resets the peaks.

    Examples:
        >>> from lightning_memopt.functional.readings.memory import MemoryReading
        >>> class Fake:
        ...     peak = 0
        ...     def read(self): return MemoryReading(time=0.0, device="cuda:0", peak_allocated_bytes=self.peak)
        ...     def reset_peaks(self): self.peak = 0; return True
        >>> fake = Fake(); peaks = PhasePeaks(fake)
        >>> _ = peaks.start("train"); fake.peak = 300
        >>> _ = peaks.start("validate"); fake.peak = 900
        >>> peaks.end("validate")[1], peaks.end("train")[1]
        ({'peak_allocated_bytes': 900}, {'peak_allocated_bytes': 300})
    """

    def __init__(self, reader: MemoryReader) -> None:
        self.reader = reader
        self.active: list[str] = []
        self._peaks: dict[str, dict[str, int]] = {}

    def start(self, phase: str) -> MemoryReading | None:
        """Open ``phase`` (on top of any running one) and return a reading taken at its start."""
        if self.active:
            self._fold(self.active[-1], self.reader.read())
        self.reader.reset_peaks()
        self.active.append(phase)
        self._peaks[phase] = {}
        return self.reader.read()

    def end(self, phase: str) -> tuple[MemoryReading | None, dict[str, int]]:
        """Close ``phase``: a reading taken now and the phase's peaks (``PEAK_FIELDS`` the device gives)."""
        reading = self.reader.read()
        self._fold(phase, reading)
        peaks = self._peaks.pop(phase, {})
        if phase in self.active:
            self.active.remove(phase)
        self.reader.reset_peaks()  # the outer phase continues from here
        return reading, peaks

    def clear(self) -> None:
        """Forget the running phases (at teardown)."""
        self.active.clear()

    def _fold(self, phase: str, reading: MemoryReading | None) -> None:
        if reading is None:
            return
        peaks = self._peaks.setdefault(phase, {})
        for field in PEAK_FIELDS:
            value = getattr(reading, field)
            if value is not None:
                peaks[field] = max(peaks.get(field, 0), value)


class ThresholdWatch:
    """Tells when allocated or reserved memory goes above ``threshold`` of the device total: once per crossing.

    Args:
        threshold: Fraction of the device total in (0, 1].

    Examples:
        >>> from lightning_memopt.functional.readings.memory import MemoryReading
        >>> watch = ThresholdWatch(0.9)
        >>> at = lambda n: MemoryReading(time=0.0, device="cuda:0", allocated_bytes=n, device_total_bytes=100)
        >>> watch.crossings(at(95)), watch.crossings(at(96)), watch.crossings(at(10)), watch.crossings(at(91))
        ([('allocated_bytes', 0.95)], [], [], [('allocated_bytes', 0.91)])
    """

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self._above: dict[str, bool] = {}

    def crossings(self, reading: MemoryReading) -> list[tuple[str, float]]:
        """``(field, fraction of the total)`` of each field that went above the threshold since the last reading."""
        found = []
        for field in THRESHOLD_FIELDS:
            fraction = reading.fraction_of_total(field)
            if fraction is None:
                continue
            above = fraction > self.threshold
            was_above = self._above.get(field, False)
            self._above[field] = above
            if above and not was_above:
                found.append((field, fraction))
        return found

    def message(self, reading: MemoryReading, field: str, fraction: float, where: str) -> str:
        """The warning for one crossing; ``where`` says on which rank and step (``"[rank 0] train step 5"``)."""
        return (
            f"{where}: {field.replace('_bytes', '')} memory is"
            f" {format_bytes(getattr(reading, field))} = {fraction:.0%} of {reading.device}'s"
            f" {format_bytes(reading.device_total_bytes)}, above `warn_threshold`={self.threshold:g}."
        )


def step_metrics(phase: str, reading: MemoryReading) -> dict[str, float]:
    """The logger metrics of one step reading: ``memory/<phase>/<field>`` for each known ``STEP_FIELDS`` entry.

    Examples:
        >>> from lightning_memopt.functional.readings.memory import MemoryReading
        >>> step_metrics("train", MemoryReading(time=0.0, device="cpu", host_rss_bytes=10))
        {'memory/train/host_rss_bytes': 10.0}
    """
    return {
        f"memory/{phase}/{field}": float(value)
        for field in STEP_FIELDS
        if (value := getattr(reading, field)) is not None
    }


def cross_rank_values(reading: MemoryReading) -> torch.Tensor:
    """This rank's ``CROSS_RANK_FIELDS`` as a float64 tensor for ``all_gather``; an unknown figure is ``-1``."""
    values = [getattr(reading, field) for field in CROSS_RANK_FIELDS]
    return torch.tensor([-1.0 if v is None else float(v) for v in values], dtype=torch.float64)


def cross_rank_metrics(gathered: torch.Tensor) -> dict[str, float]:
    """Min, max and mean over the ranks of each field every rank knows, from the gathered :func:`cross_rank_values`.

    Examples:
        >>> rows = torch.tensor([[-1.0, -1.0, 10.0], [-1.0, -1.0, 30.0]], dtype=torch.float64)
        >>> cross_rank_metrics(rows)  # doctest: +NORMALIZE_WHITESPACE
        {'memory/train/host_rss_bytes_min': 10.0, 'memory/train/host_rss_bytes_max': 30.0,
         'memory/train/host_rss_bytes_mean': 20.0}
    """
    gathered = gathered.reshape(-1, len(CROSS_RANK_FIELDS))
    metrics: dict[str, float] = {}
    for i, field in enumerate(CROSS_RANK_FIELDS):
        column = gathered[:, i].double().cpu()
        if bool((column < 0).any()):
            continue  # the field is unknown on this device type
        metrics[f"memory/train/{field}_min"] = float(column.min())
        metrics[f"memory/train/{field}_max"] = float(column.max())
        metrics[f"memory/train/{field}_mean"] = float(column.mean())
    return metrics


@dataclass(frozen=True)
class Position:
    """Where in training a record is taken: the position keys of a JSONL record.

    ``node_rank`` and ``host`` (the machine's name) say on which node the rank runs; ``None`` leaves them out of
    the record.
    """

    epoch: int | None
    global_step: int | None
    batch_idx: int | None
    run_id: str | None
    node_rank: int | None = None
    host: str | None = None


def position_record(
    reading: MemoryReading, rank: int, phase: str, event: str, at: Position, **extra: Any
) -> dict[str, Any]:
    """One JSONL record: ``reading`` at ``at`` (``extra`` keys after the memory fields, then ``node_rank`` and
    ``host`` when ``at`` has them, ``run_id`` last).

    Examples:
        >>> rec = position_record(MemoryReading(time=0.0, device="cpu"), 1, "train", "audit", Position(0, 3, None, "r"))
        >>> rec["rank"], rec["global_step"], list(rec)[-1], "host" in rec
        (1, 3, 'run_id', False)
        >>> at = Position(0, 3, None, "r", node_rank=1, host="gpu-b")
        >>> list(position_record(MemoryReading(time=0.0, device="cpu"), 2, "train", "step", at))[-3:]
        ['node_rank', 'host', 'run_id']
    """
    node = {key: value for key, value in (("node_rank", at.node_rank), ("host", at.host)) if value is not None}
    return memory_record(
        reading,
        rank=rank,
        phase=phase,
        event=event,
        epoch=at.epoch,
        global_step=at.global_step,
        batch_idx=at.batch_idx,
        **extra,
        **node,
        run_id=at.run_id,
    )


class MonitorRecords:
    """The records and metrics ``MemoryMonitor`` writes for one rank, from the readings of ``reader``.

    Each method reads memory once and returns what to write (JSONL records, see ``docs/memory-log.md``) and what to
    log; nothing is written here. A ``reader`` that gives ``None`` (a failed reading) gives nothing to write.

    Args:
        reader: Gives the readings and resets the peaks.
        rank: The rank written into every record.
        warn_threshold: Fraction of the device total above which a step gives a ``warning`` record.

    Examples:
        >>> from lightning_memopt.functional.readings.memory import DeviceMemory
        >>> core = MonitorRecords(DeviceMemory("cpu"), rank=0, warn_threshold=0.9)
        >>> [r["event"] for r in core.phase_start("train", Position(0, 0, None, "run"))]
        ['phase_start']
        >>> records, metrics, warnings = core.step("train", Position(0, 5, 4, "run"))
        >>> records[0]["global_step"], list(metrics), warnings
        (5, ['memory/train/host_rss_bytes'], [])
    """

    def __init__(self, reader: MemoryReader, rank: int, warn_threshold: float) -> None:
        self.reader = reader
        self.rank = rank
        self.phases = PhasePeaks(reader)
        self.thresholds = ThresholdWatch(warn_threshold)

    def record(self, reading: MemoryReading, phase: str, event: str, at: Position, **extra: Any) -> dict[str, Any]:
        """One JSONL record of ``reading`` for this rank (see :func:`position_record`)."""
        return position_record(reading, self.rank, phase, event, at, **extra)

    def step(self, phase: str, at: Position) -> tuple[list[dict[str, Any]], dict[str, float], list[str]]:
        """A logged step: its records (the step, then a ``warning`` per threshold crossing), metrics and warnings."""
        reading = self.reader.read()
        if reading is None:
            return [], {}, []
        records = [self.record(reading, phase, "step", at)]
        messages = []
        for field, fraction in self.thresholds.crossings(reading):
            message = self.thresholds.message(
                reading, field, fraction, f"[rank {self.rank}] {phase} step {at.global_step}"
            )
            extra = {"field": field, "fraction": round(fraction, 6), "threshold": self.thresholds.threshold}
            records.append(self.record(reading, phase, "warning", at, **extra, message=message))
            messages.append(message)
        return records, step_metrics(phase, reading), messages

    def phase_start(self, phase: str, at: Position) -> list[dict[str, Any]]:
        """Open ``phase`` (see :class:`PhasePeaks`): its ``phase_start`` record."""
        reading = self.phases.start(phase)
        if reading is None:
            return []
        return [self.record(reading, phase, "phase_start", at)]

    def phase_end(
        self, phase: str, at: Position
    ) -> tuple[list[dict[str, Any]], dict[str, float], MemoryReading | None, dict[str, int]]:
        """Close ``phase``: its ``phase_end`` record with ``phase_<peak field>`` keys, peak metrics, reading, peaks."""
        reading, peaks = self.phases.end(phase)
        if reading is None:
            return [], {}, None, peaks
        record = self.record(reading, phase, "phase_end", at, **{f"phase_{k}": v for k, v in peaks.items()})
        return [record], {f"memory/{phase}/{k}": float(v) for k, v in peaks.items()}, reading, peaks
