"""Per (run, rank, phase) summaries of memory records, built while the records stream by.

:class:`LogSummarizer` takes checked records one at a time and keeps, per group, only the few numbers a summary
(and, when asked, the timeline plot) needs, never the records. :func:`summarize_memory_log` is its public face
for records already in memory.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from lightning_memopt.analysis.findings import (
    LISTED_CHANGES,
    LISTED_FINDINGS,
    MemoryFinding,
    finding_check,
    finding_text,
    int_field,
    micro_batch_text,
)
from lightning_memopt.analysis.growth import StepFit
from lightning_memopt.analysis.records import (
    ALLOC_KEYS,
    MICRO_BATCH_EVENT,
    READING_EVENTS,
    RESERVED_KEYS,
    record_problem,
)
from lightning_memopt.analysis.timeline import TimelinePanel
from lightning_memopt.utilities.formatting import printable

__all__ = ["LogSummarizer", "PhaseSummary", "add_checked", "listed", "summarize_memory_log"]

_PHASE_ORDER = {"train": 0, "validate": 1, "test": 2, "predict": 3}
#: Skipped records named in a warning; the rest are counted.
LISTED_SKIPS = 10


@dataclass(frozen=True)
class PhaseSummary:
    """What one rank's log says about one phase of one run. Sizes in bytes; ``None`` where the log has no figure.

    ``run_id`` is the records' ``run_id`` (``None`` for records without one). ``node_rank`` and ``host`` say where
    the rank ran (``None`` in logs written without them); a rank whose run was resumed on other machines lists
    each host, in the order they appear, joined by ``", "`` (``node_rank`` is then the first record's).

    Growth (the rule is in :func:`summarize_memory_log`): ``growth_field`` is the figure judged
    (``allocated_bytes``, or ``host_rss_bytes`` when the device gives none), ``growth`` the verdict:
    ``"growing"`` or ``"shrinking"`` (then ``growth_bytes_per_1k_steps`` is the fitted slope times 1000),
    ``"flat"``, ``"too short"`` (too few readings over too few steps to tell), or ``None`` when the phase has no
    figure at all. ``growth_readings``, ``growth_first_step`` and ``growth_last_step`` are the readings the verdict
    rests on: those fitted for growing, shrinking and flat; all of the phase's step readings for too short.

    ``warnings`` counts the phase's ``warning`` records, ``warnings_by_check`` per check, and ``findings`` holds
    the first five of each check with their text.

    ``micro_batch_changes`` holds AutoMicroBatch's ``micro_batch`` records (the first 20, as findings with check
    ``"micro_batch"`` and a text such as ``micro-batch 16 -> 8 (out of memory; batch of 16)``),
    ``num_micro_batch_changes`` counts them, ``micro_batch_size`` is the size the last one set.
    """

    rank: int
    phase: str
    device: str | None
    num_readings: int
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    mean_allocated_bytes: float | None
    mean_reserved_bytes: float | None
    peak_host_rss_bytes: int | None
    mean_host_rss_bytes: float | None
    device_total_bytes: int | None
    growth_field: str | None
    growth_bytes_per_1k_steps: float | None
    warnings: int
    peak_global_step: int | None
    peak_epoch: int | None
    peak_seconds: float | None
    run_id: str | None = None
    growth: str | None = None
    growth_readings: int = 0
    growth_first_step: int | None = None
    growth_last_step: int | None = None
    warnings_by_check: dict[str, int] = field(default_factory=dict)
    findings: tuple[MemoryFinding, ...] = ()
    micro_batch_changes: tuple[MemoryFinding, ...] = ()
    num_micro_batch_changes: int = 0
    micro_batch_size: int | None = None
    node_rank: int | None = None
    host: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _max(current: float | None, value: float | None) -> float | None:
    if value is None:
        return current
    return value if current is None or value > current else current


#: A finding as kept while streaming: (check, text, global_step, epoch, time).
_Kept = tuple[str, str, Any, Any, float]


def _as_findings(kept: list[_Kept], t0: float) -> tuple[MemoryFinding, ...]:
    return tuple(MemoryFinding(check, text, step, epoch, round(t - t0, 3)) for check, text, step, epoch, t in kept)


@dataclass
class _PhaseStats:
    """Running figures of one (run, rank, phase): what :class:`PhaseSummary` needs and nothing more."""

    device: str | None = None
    node_rank: int | None = None
    hosts: list[str] = field(default_factory=list)
    steps: int = 0
    warnings: int = 0
    peak_alloc: float | None = None
    peak_alloc_at: tuple[Any, Any, float] | None = None  # (global_step, epoch, time)
    peak_reserved: float | None = None
    peak_rss: float | None = None
    peak_rss_at: tuple[Any, Any, float] | None = None
    device_total: float | None = None
    alloc_sum: float = 0
    alloc_n: int = 0
    reserved_sum: float = 0
    reserved_n: int = 0
    rss_sum: float = 0
    rss_n: int = 0
    # Step readings for the growth fit; host RSS only until a device figure appears.
    alloc_fit: StepFit = field(default_factory=StepFit)
    rss_fit: StepFit = field(default_factory=StepFit)
    checks: dict[str, int] = field(default_factory=dict)  # check -> warnings
    findings: list[_Kept] = field(default_factory=list)
    changes: list[_Kept] = field(default_factory=list)  # micro-batch changes, as findings
    num_changes: int = 0
    micro_batch_size: int | None = None

    def add(self, r: Mapping[str, Any], event: str, t: float) -> None:
        if self.device is None and r.get("device"):
            self.device = r["device"]
        if self.node_rank is None:
            self.node_rank = r.get("node_rank")
        host = r.get("host")
        if host is not None and host not in self.hosts:
            self.hosts.append(host)
        self.device_total = _max(self.device_total, r.get("device_total_bytes"))
        if event == "warning":
            self._add_warning(r, t)
        elif event == MICRO_BATCH_EVENT:
            self._add_micro_batch(r, t)
        elif event in READING_EVENTS:
            self._add_peaks(r, t)
            if event == "step":
                self._add_step(r)

    def _add_warning(self, r: Mapping[str, Any], t: float) -> None:
        """Count the warning per check; keep the first ``LISTED_FINDINGS`` of each check as findings."""
        self.warnings += 1
        check = finding_check(r)
        seen = self.checks.get(check, 0)
        self.checks[check] = seen + 1
        if seen < LISTED_FINDINGS:
            self.findings.append((check, finding_text(r), r.get("global_step"), r.get("epoch"), t))

    def _add_micro_batch(self, r: Mapping[str, Any], t: float) -> None:
        """Count AutoMicroBatch's change, keep the size it set and the first ``LISTED_CHANGES`` as findings."""
        self.num_changes += 1
        self.micro_batch_size = int_field(r, "micro_batch_size") or self.micro_batch_size
        if len(self.changes) < LISTED_CHANGES:
            self.changes.append((MICRO_BATCH_EVENT, micro_batch_text(r), r.get("global_step"), r.get("epoch"), t))

    def _add_peaks(self, r: Mapping[str, Any], t: float) -> None:
        """The peaks of a reading (any of its allocated and reserved figures, host RSS) and where they were."""
        alloc = None
        for key in ALLOC_KEYS:
            alloc = _max(alloc, r.get(key))
        if alloc is not None and (self.peak_alloc is None or alloc > self.peak_alloc):
            self.peak_alloc, self.peak_alloc_at = alloc, (r.get("global_step"), r.get("epoch"), t)
        for key in RESERVED_KEYS:
            self.peak_reserved = _max(self.peak_reserved, r.get(key))
        rss = r.get("host_rss_bytes")
        if rss is not None and (self.peak_rss is None or rss > self.peak_rss):
            self.peak_rss, self.peak_rss_at = rss, (r.get("global_step"), r.get("epoch"), t)

    def _add_step(self, r: Mapping[str, Any]) -> None:
        """A step reading's means and growth fit (host RSS fitted only while no device figure has come)."""
        self.steps += 1
        step = r.get("global_step")
        value = r.get("allocated_bytes")
        if value is not None:
            if not self.alloc_n and len(self.rss_fit):
                self.rss_fit = StepFit()  # device figures win: the host's are not needed
            self.alloc_sum += value
            self.alloc_n += 1
            if step is not None:
                self.alloc_fit.add(step, value)
        value = r.get("reserved_bytes")
        if value is not None:
            self.reserved_sum += value
            self.reserved_n += 1
        value = r.get("host_rss_bytes")
        if value is not None:
            self.rss_sum += value
            self.rss_n += 1
            if step is not None and not self.alloc_n:
                self.rss_fit.add(step, value)

    def summary(self, run_id: str | None, rank: int, phase: str, t0: float) -> PhaseSummary:
        growth_field: str | None = None
        growth = None
        if self.alloc_n:
            growth_field = "allocated_bytes"
            growth = self.alloc_fit.growth()
        elif self.rss_n:
            growth_field = "host_rss_bytes"
            growth = self.rss_fit.growth()
        # No device figures: the peak is the host's.
        where = self.peak_alloc_at if self.peak_alloc_at is not None else self.peak_rss_at
        return PhaseSummary(
            rank=rank,
            phase=phase,
            device=self.device,
            num_readings=self.steps,
            peak_allocated_bytes=None if self.peak_alloc is None else int(self.peak_alloc),
            peak_reserved_bytes=None if self.peak_reserved is None else int(self.peak_reserved),
            mean_allocated_bytes=self.alloc_sum / self.alloc_n if self.alloc_n else None,
            mean_reserved_bytes=self.reserved_sum / self.reserved_n if self.reserved_n else None,
            peak_host_rss_bytes=None if self.peak_rss is None else int(self.peak_rss),
            mean_host_rss_bytes=self.rss_sum / self.rss_n if self.rss_n else None,
            device_total_bytes=None if self.device_total is None else int(self.device_total),
            growth_field=growth_field,
            growth_bytes_per_1k_steps=None if growth is None else growth.per_1k_steps,
            warnings=self.warnings,
            peak_global_step=None if where is None else where[0],
            peak_epoch=None if where is None else where[1],
            peak_seconds=None if where is None else round(where[2] - t0, 3),
            run_id=run_id,
            growth=None if growth is None else growth.verdict,
            growth_readings=0 if growth is None else growth.readings,
            growth_first_step=None if growth is None else growth.first_step,
            growth_last_step=None if growth is None else growth.last_step,
            warnings_by_check=dict(sorted(self.checks.items())),
            findings=_as_findings(self.findings, t0),
            micro_batch_changes=_as_findings(self.changes, t0),
            num_micro_batch_changes=self.num_changes,
            micro_batch_size=self.micro_batch_size,
            node_rank=self.node_rank,
            host=", ".join(self.hosts) or None,
        )


class LogSummarizer:
    """Takes checked records one at a time; keeps per-group figures, never the records.

    Args:
        plot: Also keep what the timeline plot needs, one :class:`~.timeline.TimelinePanel` per (run, rank).

    Examples:
        >>> summarizer = LogSummarizer()
        >>> for step in (1, 2, 3):
        ...     summarizer.add({"time": step, "rank": 0, "phase": "train", "event": "step", "allocated_bytes": step})
        >>> [(s.phase, s.num_readings, s.peak_allocated_bytes) for s in summarizer.summaries()]
        [('train', 3, 3)]
    """

    def __init__(self, plot: bool = False) -> None:
        self.num_records = 0
        self._t0: dict[str | None, float] = {}  # run -> first time (a run's own time axis)
        self._runs: dict[str | None, int] = {}  # run -> order of first appearance
        self._phases: dict[tuple[str | None, int, str], _PhaseStats] = {}
        self._panels: dict[tuple[str | None, int], TimelinePanel] | None = {} if plot else None

    def add(self, r: Mapping[str, Any]) -> None:
        """Take one record that :func:`~.records.record_problem` passed."""
        run, rank, phase, event = r.get("run_id"), r["rank"], r["phase"], r["event"]
        t = float(r["time"])
        self.num_records += 1
        self._runs.setdefault(run, len(self._runs))
        if run not in self._t0 or t < self._t0[run]:
            self._t0[run] = t
        stats = self._phases.get((run, rank, phase))
        if stats is None:
            stats = self._phases[(run, rank, phase)] = _PhaseStats()
        stats.add(r, event, t)
        if self._panels is not None:
            panel = self._panels.get((run, rank))
            if panel is None:
                panel = self._panels[(run, rank)] = TimelinePanel()
            panel.add(r, event, t)

    def _run_order(self) -> dict[str | None, int]:
        """Runs in the order they started (first record), ties in the order they appeared."""
        ordered = sorted(self._runs, key=lambda run: (self._t0[run], self._runs[run]))
        return {run: i for i, run in enumerate(ordered)}

    @property
    def several_runs(self) -> bool:
        return len(self._runs) > 1

    def summaries(self) -> list[PhaseSummary]:
        """One summary per (run, rank, phase): runs in the order they started, then ranks, then phases."""
        order = self._run_order()
        keys = sorted(self._phases, key=lambda k: (order[k[0]], k[1], _PHASE_ORDER.get(k[2], 9)))
        return [self._phases[k].summary(k[0], k[1], k[2], self._t0[k[0]]) for k in keys]

    def panels(self) -> list[tuple[str | None, int, float, TimelinePanel]]:
        """``(run_id, rank, t0, panel)`` in plotting order (empty unless built with ``plot=True``)."""
        order = self._run_order()
        panels = self._panels or {}
        keys = sorted(panels, key=lambda k: (order[k[0]], k[1]))
        return [(run, rank, self._t0[run], panels[(run, rank)]) for run, rank in keys]


def listed(numbers: Sequence[int], total: int) -> str:
    """``4, 10, 11`` or, when ``total`` is more than the numbers listed, ``3, 4, 5 and 16 more``."""
    more = f" and {total - len(numbers)} more" if total > len(numbers) else ""
    return ", ".join(map(str, numbers)) + more


def add_checked(summarizer: LogSummarizer, records: Iterable[Any], label: str) -> None:
    """Add the usable records; one warning for the others, naming their indices and the first one's problem."""
    skipped: list[tuple[int, str]] = []
    count = total = 0
    for index, record in enumerate(records):
        total += 1
        problem = record_problem(record)
        if problem is None:
            summarizer.add(record)
            continue
        count += 1
        if len(skipped) < LISTED_SKIPS:
            skipped.append((index, problem))
    if count:
        where = listed([i for i, _ in skipped], count)
        warnings.warn(
            printable(
                f"{label}: skipped {count} of {total} records (index {where}): record {skipped[0][0]} {skipped[0][1]}"
            ),
            stacklevel=3,
        )


def summarize_memory_log(records: Iterable[Mapping[str, Any]]) -> list[PhaseSummary]:
    """Summarise records (of one or more ranks and runs) per (run, rank, phase).

    Growth is judged on one figure per phase, allocated bytes (host RSS where the device gives none), at its
    ``step`` records, against ``global_step``:

    1. **Warm-up left out**: readings in the first third of the phase's steps do not count. Memory climbs there
       without leaking (data, optimizer state, the allocator's cache and, on CPU, the host allocator's pools
       arriving).
    2. **Enough readings**: the rest needs at least 10 readings spanning at least 100 steps and not bunched at
       fewer than 4 steps (they must fill at least 4 of the 8 blocks below); with fewer the verdict is
       ``"too short"``. A phase of 150 steps with a reading every 10 steps is enough; 3 readings never are.
    3. **Clearly more than noise**: a straight line is fitted to those readings by least squares. Its slope is
       reported (``"growing"``, or ``"shrinking"`` for a fall) only when both hold; otherwise the verdict is
       ``"flat"``:

       * the slope is at least 4 standard errors from zero. The error is taken from the readings' scatter about
         the line or, when larger, from the scatter about it of the means of 8 consecutive blocks of about
         equally many readings: memory that sits on one plateau for a while and then another (host RSS does)
         has block means that stray much further than independent noise would, and must not pass for a trend;
       * the line's change over the fitted steps is at least twice the readings' scatter about it (their
         residual standard deviation), so that a slope that is real but small beside the noise is not called
         growth either (a few KiB over a run whose readings jump by megabytes).

    ``growth_bytes_per_1k_steps`` is the slope times 1000, ``growth_first_step`` and ``growth_last_step`` the
    steps it was measured over. The fit keeps sums in at most 64 step buckets, never the readings; the warm-up
    is cut at a bucket boundary, so on long runs slightly less than two thirds of the steps are fitted.

    Each ``warning`` record is counted per check and the first five of each check are kept with their text
    (:class:`MemoryFinding`). ``peak_seconds`` counts from the first record of the same run. Records that cannot
    be used (a field of the wrong type) are left out with one warning.

    Examples:
        >>> recs = [{"time": float(s), "rank": 0, "phase": "train", "event": "step", "global_step": s, "epoch": 0,
        ...          "allocated_bytes": 100 + 2 * s, "reserved_bytes": 400, "host_rss_bytes": 10}
        ...         for s in range(0, 401, 10)]
        >>> s = summarize_memory_log(recs)[0]
        >>> s.peak_allocated_bytes, s.growth, s.growth_bytes_per_1k_steps, s.growth_first_step, s.growth_last_step
        (900, 'growing', 2000.0, 140, 400)
        >>> summarize_memory_log(recs[:3])[0].growth
        'too short'
    """
    summarizer = LogSummarizer()
    add_checked(summarizer, records, "records")
    return summarizer.summaries()
