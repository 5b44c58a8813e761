"""Reading memory JSONL logs back: load, summarise per run, rank and phase, plot a timeline.

:func:`analyze_memory_logs` streams the logs: it reads one line at a time and keeps, per rank and phase, only
the few numbers a summary or a plot needs (in compact ``array`` buffers), so its memory stays a fraction of
the logs' size however long the run was. A record it cannot use (not JSON, not an object, a field of the
wrong type, NaN) is skipped, and each file with skipped records gets one warning that names the lines.

Records may carry a ``run_id``: records of different runs (a log appended to by a second run, or logs of two
runs analysed together) get rows and plot panels of their own instead of sharing one time axis.
"""

from __future__ import annotations

import json
import math
import os
import stat
import warnings
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from lightning_memopt.utilities.checks import check_path, is_finite_number
from lightning_memopt.utilities.files import regular_file_problem
from lightning_memopt.utilities.formatting import format_bytes

__all__ = [
    "MemoryLogError",
    "PhaseSummary",
    "analyze_memory_logs",
    "format_summary",
    "load_memory_log",
    "plot_memory_timeline",
    "summarize_memory_log",
]

_REQUIRED_KEYS = ("time", "rank", "phase", "event")
_PHASE_ORDER = {"train": 0, "validate": 1, "test": 2, "predict": 3}
_PHASE_COLORS = {"train": "#4C72B0", "validate": "#55A868", "test": "#C44E52", "predict": "#8172B2"}
_READING_EVENTS = frozenset({"step", "phase_start", "phase_end"})
#: Where the peak allocated figure of a reading can be (the first record that shows the highest one wins).
_ALLOC_KEYS = ("phase_peak_allocated_bytes", "peak_allocated_bytes", "allocated_bytes")
_RESERVED_KEYS = ("peak_reserved_bytes", "reserved_bytes", "phase_peak_reserved_bytes")
#: Every byte figure the summary or the plot reads: null, or a finite number >= 0.
_BYTE_KEYS = (*_ALLOC_KEYS, *_RESERVED_KEYS, "host_rss_bytes", "device_total_bytes")
_OPTIONAL_INT_KEYS = ("epoch", "global_step", "batch_idx")
_OPTIONAL_STR_KEYS = ("device", "run_id")
#: Plotted series: (field, label, line style) with device figures, and the host's without.
_DEVICE_SERIES = (("allocated_bytes", "allocated", "-"), ("reserved_bytes", "reserved", "-"),
                  ("peak_allocated_bytes", "peak allocated (since phase start)", ":"))
_HOST_SERIES = (("host_rss_bytes", "host RSS (no device readings)", "-"),)
_MAX_LINE_BYTES = 1 << 20
_LISTED_LINES = 10
_LISTED_REASONS = 3
_NO_RUN = "-"


class MemoryLogError(ValueError):
    """A memory log that cannot be read: missing, unreadable or not a JSONL memory log."""


# ----------------------------------------------------------------------------------------------------------------
# Reading and checking records
# ----------------------------------------------------------------------------------------------------------------


class _NonFinite(ValueError):
    """NaN or Infinity in a line: Python's ``json`` accepts them, JSON does not."""


def _reject_constant(name: str) -> Any:
    raise _NonFinite(name)


#: Decodes one line; NaN and Infinity raise (Python's ``json`` accepts them, JSON does not). Built once: a
#: ``json.loads`` with keyword arguments builds a decoder for every line.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _record_problem(record: Any) -> str | None:
    """Why ``record`` cannot be used (one short phrase), or ``None`` when it can."""
    if not isinstance(record, Mapping):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(record), "a number")
        return f"is not a memory record (a JSON value that is {kind}, not an object)"
    if any(key not in record for key in _REQUIRED_KEYS):
        return f"is not a memory record (needs keys {', '.join(_REQUIRED_KEYS)})"
    value = record["time"]
    if not is_finite_number(value):
        return f"`time` is {_show(value)}, not a number of seconds"
    value = record["rank"]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return f"`rank` is {_show(value)}, not an int >= 0"
    for key in ("phase", "event"):
        if not isinstance(record[key], str):
            return f"`{key}` is {_show(record[key])}, not a string"
    for key in _OPTIONAL_STR_KEYS:
        value = record.get(key)
        if value is not None and not isinstance(value, str):
            return f"`{key}` is {_show(value)}, not a string"
    for key in _OPTIONAL_INT_KEYS:
        value = record.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or abs(value) >= 2**63):
            return f"`{key}` is {_show(value)}, not an int"
    for key in _BYTE_KEYS:
        value = record.get(key)
        if value is not None and not (is_finite_number(value) and value >= 0):
            return f"`{key}` is {_show(value)}, not a number of bytes"
    return None


def _check_log_path(path: Path) -> None:
    """Refuse what is not a regular file before opening it: a named pipe would block forever."""
    problem = regular_file_problem(path)
    if problem == "is a directory":
        raise MemoryLogError(f"{path}: is a directory; pass the memory_rank*.jsonl files inside it")
    if problem is not None:
        hint = "; pass a memory_rank*.jsonl file (save a stream to a file first)" if "regular" in problem else ""
        raise MemoryLogError(f"{path}: {problem}{hint}")


def _open_log(path: Path) -> BinaryIO:
    _check_log_path(path)
    try:
        # O_NONBLOCK: should the path have become a pipe since the check, opening it does not wait for a writer.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except OSError as err:
        raise MemoryLogError(f"{path}: cannot be read ({err.strerror or err})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise MemoryLogError(f"{path}: is not a regular file; pass a memory_rank*.jsonl file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


@dataclass
class _Line:
    number: int
    record: dict[str, Any] | None
    problem: str | None = None
    truncated: bool = False


def _scan(path: Path) -> Iterator[_Line]:
    """The non-blank lines of a log, one at a time, each with its record or the reason it has none."""
    with _open_log(path) as f:

        def read() -> bytes:
            try:
                return f.readline(_MAX_LINE_BYTES)
            except OSError as err:
                raise MemoryLogError(f"{path}: cannot be read ({err.strerror or err})") from None

        number = 0
        while raw := read():
            number += 1
            ends = raw.endswith(b"\n")
            if not ends and len(raw) == _MAX_LINE_BYTES:
                while raw and not raw.endswith(b"\n"):  # skip the rest of an overlong line
                    raw = read()
                yield _Line(number, None, f"is longer than {_MAX_LINE_BYTES // 2**20} MiB")
                continue
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark
                raw = raw[3:]
            if not raw.strip():
                continue
            try:
                record = _DECODER.decode(raw.decode("utf-8"))
            except _NonFinite as err:
                yield _Line(number, None, f"holds {err}, which is not JSON")
                continue
            except (ValueError, RecursionError):
                truncated = not ends
                reason = "is truncated (the run stopped mid-write)" if truncated else "is not JSON"
                yield _Line(number, None, reason, truncated=truncated)
                continue
            problem = _record_problem(record)
            yield _Line(number, None if problem else record, problem)


def load_memory_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read one JSONL memory log written by :class:`~lightning_memopt.MemoryMonitor`, all records in memory.

    A truncated last line (a run killed mid-write) is skipped with a warning that names the line. Any
    other line that is not a JSON object with ``time``, ``rank``, ``phase`` and ``event`` of the right types
    makes the file invalid. :func:`analyze_memory_logs` does not use this: it streams the file and skips bad
    lines instead.

    Raises:
        MemoryLogError: the file is missing, not a regular file, unreadable, empty or not a memory log.

    Example:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "m.jsonl")
        >>> _ = open(p, "w").write('{"time": 1, "rank": 0, "phase": "train", "event": "step"}\\n{"time": 2, "ra')
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as w:
        ...     warnings.simplefilter("always")
        ...     records = load_memory_log(p)
        >>> len(records), "line 2" in str(w[0].message)
        (1, True)
    """
    check_path("path", path, allow_none=False)
    path = Path(path)
    records: list[dict[str, Any]] = []
    for line in _scan(path):
        if line.record is not None:
            records.append(line.record)
        elif line.truncated and records:
            warnings.warn(f"{path}: line {line.number} is truncated (the run stopped mid-write); skipped it.",
                          stacklevel=2)
        elif line.truncated or line.problem == "is not JSON":
            raise MemoryLogError(f"{path}: line {line.number} is not JSON; is this a memory JSONL log?")
        else:
            raise MemoryLogError(f"{path}: line {line.number} {line.problem}")
    if not records:
        raise MemoryLogError(f"{path}: holds no memory records")
    return records


# ----------------------------------------------------------------------------------------------------------------
# Streaming summaries
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PhaseSummary:
    """What one rank's log says about one phase of one run. Sizes in bytes; ``None`` where the log has no figure.

    ``run_id`` is the records' ``run_id`` (``None`` for records without one).
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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _max(current: float | None, value: float | None) -> float | None:
    if value is None:
        return current
    return value if current is None or value > current else current


@dataclass
class _PhaseStats:
    """Running figures of one (run, rank, phase): what :class:`PhaseSummary` needs and nothing more."""

    device: str | None = None
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
    # (global_step, value) of step readings, for the growth fit; host RSS only until a device figure appears.
    alloc_x: array = field(default_factory=lambda: array("d"))
    alloc_y: array = field(default_factory=lambda: array("d"))
    rss_x: array = field(default_factory=lambda: array("d"))
    rss_y: array = field(default_factory=lambda: array("d"))

    def add(self, r: Mapping[str, Any], event: str, t: float) -> None:
        if self.device is None and r.get("device"):
            self.device = r["device"]
        self.device_total = _max(self.device_total, r.get("device_total_bytes"))
        if event == "warning":
            self.warnings += 1
        if event not in _READING_EVENTS:
            return
        alloc = None
        for key in _ALLOC_KEYS:
            alloc = _max(alloc, r.get(key))
        if alloc is not None and (self.peak_alloc is None or alloc > self.peak_alloc):
            self.peak_alloc, self.peak_alloc_at = alloc, (r.get("global_step"), r.get("epoch"), t)
        for key in _RESERVED_KEYS:
            self.peak_reserved = _max(self.peak_reserved, r.get(key))
        rss = r.get("host_rss_bytes")
        if rss is not None and (self.peak_rss is None or rss > self.peak_rss):
            self.peak_rss, self.peak_rss_at = rss, (r.get("global_step"), r.get("epoch"), t)
        if event != "step":
            return
        self.steps += 1
        step = r.get("global_step")
        value = r.get("allocated_bytes")
        if value is not None:
            if not self.alloc_n and self.rss_x:
                self.rss_x, self.rss_y = array("d"), array("d")  # device figures win: host points not needed
            self.alloc_sum += value
            self.alloc_n += 1
            if step is not None:
                self.alloc_x.append(step)
                self.alloc_y.append(value)
        value = r.get("reserved_bytes")
        if value is not None:
            self.reserved_sum += value
            self.reserved_n += 1
        value = r.get("host_rss_bytes")
        if value is not None:
            self.rss_sum += value
            self.rss_n += 1
            if step is not None and not self.alloc_n:
                self.rss_x.append(step)
                self.rss_y.append(value)

    def summary(self, run_id: str | None, rank: int, phase: str, t0: float) -> PhaseSummary:
        growth_field = "allocated_bytes" if self.alloc_n else ("host_rss_bytes" if self.rss_n else None)
        growth = None
        if growth_field == "allocated_bytes":
            growth = _growth(self.alloc_x, self.alloc_y)
        elif growth_field == "host_rss_bytes":
            growth = _growth(self.rss_x, self.rss_y)
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
            growth_bytes_per_1k_steps=growth,
            warnings=self.warnings,
            peak_global_step=None if where is None else where[0],
            peak_epoch=None if where is None else where[1],
            peak_seconds=None if where is None else round(where[2] - t0, 3),
            run_id=run_id,
        )


def _growth(xs: array, ys: array) -> float | None:
    """Least-squares slope times 1000 over the later half of the points sorted by (step, value) (all if < 6)."""
    n = len(xs)
    in_order = all(xs[i] < xs[i + 1] or (xs[i] == xs[i + 1] and ys[i] <= ys[i + 1]) for i in range(n - 1))
    if in_order:
        first = n // 2 if n >= 6 else 0
        px, py = xs[first:], ys[first:]
    else:  # rare (a resumed run appended earlier steps): sort a copy
        points = sorted(zip(xs, ys))
        if n >= 6:
            points = points[n // 2:]
        px, py = array("d", (x for x, _ in points)), array("d", (y for _, y in points))
    m = len(px)
    if m < 2 or min(px) == max(px):
        return None
    mx = sum(px) / m
    my = sum(py) / m
    sxx = sum((x - mx) ** 2 for x in px)
    sxy = sum((x - mx) * (y - my) for x, y in zip(px, py))
    return 1000.0 * sxy / sxx


@dataclass
class _Panel:
    """What the timeline plot needs of one (run, rank): the plotted series, phase spans, warnings."""

    device: str | None = None
    device_time: float = math.inf
    has_device: bool = False
    top_device: float = 0.0
    top_host: float = 0.0
    total: float = 0.0
    series: dict[str, tuple[array, array]] = field(default_factory=dict)  # field -> (times, values)
    phase_t: array = field(default_factory=lambda: array("d"))
    phase_start: array = field(default_factory=lambda: array("b"))  # 1 start, 0 end
    phase_name: list[str] = field(default_factory=list)
    warn_t: array = field(default_factory=lambda: array("d"))
    warn_v: array = field(default_factory=lambda: array("d"))

    def add(self, r: Mapping[str, Any], event: str, t: float) -> None:
        if r.get("device") and t < self.device_time:
            self.device, self.device_time = r["device"], t
        if event == "warning":
            key = r.get("field") if isinstance(r.get("field"), str) and r.get("field") else "allocated_bytes"
            value = r.get(key)
            self.warn_t.append(t)
            self.warn_v.append(float(value) if is_finite_number(value) else 0.0)
            return
        if event not in _READING_EVENTS:
            return
        for key, _, _ in (*_DEVICE_SERIES, *_HOST_SERIES):
            value = r.get(key)
            if value is not None:
                times, values = self.series.setdefault(key, (array("d"), array("d")))
                times.append(t)
                values.append(value)
                if key == "host_rss_bytes":
                    self.top_host = max(self.top_host, float(value))
                else:
                    self.top_device = max(self.top_device, float(value))
        if r.get("allocated_bytes") is not None:
            self.has_device = True
        self.total = max(self.total, float(r.get("device_total_bytes") or 0))
        if event != "step":
            self.phase_t.append(t)
            self.phase_start.append(event == "phase_start")
            self.phase_name.append(r["phase"])


class _LogSummarizer:
    """Takes checked records one at a time; keeps per-group figures, never the records."""

    def __init__(self, plot: bool = False) -> None:
        self.num_records = 0
        self._t0: dict[str | None, float] = {}  # run -> first time (a run's own time axis)
        self._runs: dict[str | None, int] = {}  # run -> order of first appearance
        self._phases: dict[tuple[str | None, int, str], _PhaseStats] = {}
        self._panels: dict[tuple[str | None, int], _Panel] | None = {} if plot else None

    def add(self, r: Mapping[str, Any]) -> None:
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
                panel = self._panels[(run, rank)] = _Panel()
            panel.add(r, event, t)

    def _run_order(self) -> dict[str | None, int]:
        """Runs in the order they started (first record), ties in the order they appeared."""
        ordered = sorted(self._runs, key=lambda run: (self._t0[run], self._runs[run]))
        return {run: i for i, run in enumerate(ordered)}

    @property
    def several_runs(self) -> bool:
        return len(self._runs) > 1

    def summaries(self) -> list[PhaseSummary]:
        order = self._run_order()
        keys = sorted(self._phases, key=lambda k: (order[k[0]], k[1], _PHASE_ORDER.get(k[2], 9)))
        return [self._phases[k].summary(k[0], k[1], k[2], self._t0[k[0]]) for k in keys]

    def panels(self) -> list[tuple[str | None, int, float, _Panel]]:
        """``(run_id, rank, t0, panel)`` in plotting order."""
        order = self._run_order()
        panels = self._panels or {}
        keys = sorted(panels, key=lambda k: (order[k[0]], k[1]))
        return [(run, rank, self._t0[run], panels[(run, rank)]) for run, rank in keys]


def _lines_text(numbers: Sequence[int], total: int) -> str:
    shown = ", ".join(map(str, numbers))
    more = f" and {total - len(numbers)} more" if total > len(numbers) else ""
    return f"line {shown}" if total == 1 else f"lines {shown}{more}"


@dataclass
class _FileReport:
    """What reading one file found: usable records, and the first few skipped lines with their reasons."""

    path: Path
    usable: int = 0
    skipped: int = 0
    lines: list[int] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)  # problem -> first line showing it

    def skip(self, number: int, problem: str) -> None:
        self.skipped += 1
        if len(self.lines) < _LISTED_LINES:
            self.lines.append(number)
        if problem not in self.reasons and len(self.reasons) < _LISTED_REASONS + 1:
            self.reasons[problem] = number

    def why(self) -> str:
        listed = list(self.reasons.items())[:_LISTED_REASONS]
        text = "; ".join(f"line {number} {problem}" for problem, number in listed)
        return text + ("; ..." if len(self.reasons) > _LISTED_REASONS else "")

    def warning(self) -> str | None:
        if not self.skipped:
            return None
        if not self.usable:
            return f"{self.path}: holds no usable memory records ({self.why()}); left it out"
        return (f"{self.path}: skipped {self.skipped} of {self.skipped + self.usable} records"
                f" ({_lines_text(self.lines, self.skipped)}): {self.why()}")

    def error(self) -> str:
        if not self.skipped:
            return f"{self.path}: holds no memory records"
        return f"{self.path}: holds no usable memory records ({self.why()}); is this a memory JSONL log?"


def _read_into(path: Path, summarizer: _LogSummarizer) -> _FileReport:
    report = _FileReport(path)
    for line in _scan(path):
        if line.record is None:
            report.skip(line.number, line.problem or "is not a memory record")
        else:
            summarizer.add(line.record)
            report.usable += 1
    return report


def summarize_memory_log(records: Iterable[Mapping[str, Any]]) -> list[PhaseSummary]:
    """Summarise records (of one or more ranks and runs) per (run, rank, phase).

    Growth is the least-squares slope of allocated bytes (host RSS where the device gives none) against
    ``global_step``, times 1000, over the later half of the phase's step readings (all of them when there are
    fewer than 6): the first readings hold the warm-up (data, optimizer state, the allocator's cache arriving),
    which is not growth. ``peak_seconds`` counts from the first record of the same run.

    Records that cannot be used (a field of the wrong type) are left out with one warning.

    Example:
        >>> recs = [{"time": t, "rank": 0, "phase": "train", "event": "step", "global_step": s, "epoch": 0,
        ...          "allocated_bytes": 100 + 2 * s, "reserved_bytes": 400, "host_rss_bytes": 10}
        ...         for t, s in [(1.0, 10), (2.0, 20), (3.0, 30)]]
        >>> s = summarize_memory_log(recs)[0]
        >>> s.peak_allocated_bytes, s.growth_bytes_per_1k_steps, s.peak_global_step
        (160, 2000.0, 30)
    """
    summarizer = _LogSummarizer()
    _add_checked(summarizer, records, "records")
    return summarizer.summaries()


def _add_checked(summarizer: _LogSummarizer, records: Iterable[Any], label: str) -> None:
    """Add the usable records; one warning for the others, naming their indices and the first one's problem."""
    skipped: list[tuple[int, str]] = []
    count = total = 0
    for index, record in enumerate(records):
        total += 1
        problem = _record_problem(record)
        if problem is None:
            summarizer.add(record)
            continue
        count += 1
        if len(skipped) < _LISTED_LINES:
            skipped.append((index, problem))
    if count:
        where = ", ".join(str(i) for i, _ in skipped)
        more = f" and {count - len(skipped)} more" if count > len(skipped) else ""
        warnings.warn(f"{label}: skipped {count} of {total} records (index {where}{more}):"
                      f" record {skipped[0][0]} {skipped[0][1]}", stacklevel=3)


# ----------------------------------------------------------------------------------------------------------------
# Text and plot
# ----------------------------------------------------------------------------------------------------------------


def format_summary(summaries: Sequence[PhaseSummary]) -> str:
    """A plain-text table of summaries, one row per (rank, phase); a ``run`` column when there are several runs."""
    several_runs = len({s.run_id for s in summaries}) > 1
    header = ("rank", *(("run",) if several_runs else ()), "phase", "readings", "peak alloc", "peak reserved",
              "mean alloc", "peak host RSS", "growth/1k steps", "warnings", "peak at")
    rows = [header]
    for s in summaries:
        growth = "n/a" if s.growth_bytes_per_1k_steps is None else (
            ("+" if s.growth_bytes_per_1k_steps >= 0 else "-") + format_bytes(abs(s.growth_bytes_per_1k_steps)))
        if s.growth_field == "host_rss_bytes" and s.growth_bytes_per_1k_steps is not None:
            growth += " (RSS)"
        peak_at = "n/a" if s.peak_global_step is None else (
            f"step {s.peak_global_step}, epoch {s.peak_epoch}, {s.peak_seconds:.1f} s")
        run = ((s.run_id or _NO_RUN),) if several_runs else ()
        rows.append((str(s.rank), *run, s.phase, str(s.num_readings), format_bytes(s.peak_allocated_bytes),
                     format_bytes(s.peak_reserved_bytes), format_bytes(s.mean_allocated_bytes),
                     format_bytes(s.peak_host_rss_bytes), growth, str(s.warnings), peak_at))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    devices = {s.device for s in summaries if s.device}
    totals = {s.device_total_bytes for s in summaries if s.device_total_bytes}
    foot = f"device: {', '.join(sorted(devices)) or 'n/a'}"
    if totals:
        foot += f"; device total {format_bytes(max(totals))}"
    return "\n".join([*lines, foot])


def _unit(max_bytes: float) -> tuple[float, str]:
    return (1024**3, "GiB") if max_bytes >= 1024**3 else (1024**2, "MiB")


def _check_plot_path(plot: str | os.PathLike[str]) -> tuple[Path, str]:
    """The plot's path and format, checked before any log is read; creates its directory.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: the extension is not one matplotlib writes, or the file cannot be created there.
    """
    import matplotlib
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(plot)
    supported = sorted(FigureCanvasBase.get_supported_filetypes())
    fmt = path.suffix[1:].lower() or str(matplotlib.rcParams["savefig.format"])
    if fmt not in supported:
        raise ValueError(
            f"plot file {path}: matplotlib cannot write '.{fmt}' files; end the name with one of"
            f" {', '.join('.' + e for e in supported)} (e.g. {path.with_suffix('.png').name})"
        )
    if path.is_dir():
        raise ValueError(f"plot file {path}: is a directory; name a file in it, e.g. {path / 'memory_timeline.png'}")
    parent = path.parent
    existing = parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise ValueError(f"plot file {path}: {existing} is a file, not a directory; choose a path in a directory")
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(
            f"plot file {path}: cannot create the directory {parent} ({err.strerror or err}); choose a writable place"
        ) from None
    if not os.access(parent, os.W_OK):
        raise ValueError(f"plot file {path}: the directory {parent} is not writable; choose a writable place")
    return path, fmt


def _sorted_by_time(times: array, *columns: Any) -> tuple[Any, ...]:
    import numpy as np

    # Zero-copy views of the buffers; stable, so records of equal time keep the order they were written in.
    t = np.frombuffer(times, dtype=np.float64) if len(times) else np.empty(0)
    order = np.argsort(t, kind="stable")
    out: list[Any] = [t[order]]
    for column in columns:
        if isinstance(column, array) and len(column):
            out.append(np.frombuffer(column, dtype=np.float64 if column.typecode == "d" else np.int8)[order])
        else:
            out.append([column[i] for i in order])
    return tuple(out)


def _envelope(times: Any, values: Any, buckets: int = 4000) -> tuple[Any, Any]:
    """At most ``2 * buckets`` points that draw like all of them: the lowest and highest of each run of readings.

    A plot is about a thousand pixels wide, so 300k readings per line only cost matplotlib memory; keeping
    each bucket's extremes (in time order) keeps every peak and dip visible.
    """
    import numpy as np

    n = len(times)
    size = -(-n // buckets)  # ceil
    if size < 2:
        return times, values
    rows = n // size
    body = values[: rows * size].reshape(rows, size)
    starts = np.arange(rows) * size
    keep = np.concatenate([starts + body.argmin(axis=1), starts + body.argmax(axis=1), np.arange(rows * size, n)])
    keep = np.unique(keep)  # sorted: time order
    return times[keep], values[keep]


def _draw(summarizer: _LogSummarizer, labels: Iterable[str], path: Path, fmt: str) -> Path:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    panels = summarizer.panels()
    if not panels:
        raise MemoryLogError("no memory records to plot")
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.6 * len(panels)), squeeze=False, sharex=True)
    try:
        for ax, (run, rank, t0, panel) in zip(axes[:, 0], panels):
            _draw_panel(ax, run, rank, t0, panel, summarizer.several_runs)
        axes[-1, 0].set_xlabel("seconds since the first record" + (" of each run" if summarizer.several_runs else ""))
        fig.suptitle("Memory timeline: " + ", ".join(labels), fontsize=11)
        fig.tight_layout()
        try:
            fig.savefig(path, dpi=110, format=fmt)
        except OSError as err:
            raise ValueError(f"plot file {path}: cannot be written ({err.strerror or err})") from None
    finally:
        plt.close(fig)
    return path


def _draw_panel(ax: Any, run: str | None, rank: int, t0: float, panel: _Panel, several_runs: bool) -> None:
    series = _DEVICE_SERIES if panel.has_device else _HOST_SERIES
    top = max(panel.top_device if panel.has_device else panel.top_host, 1.0)
    total = panel.total
    # The device total as a line when it is on the same scale as the data; else as a note, so that
    # a run using 1 GiB of an 80 GiB card is still readable.
    total_on_scale = bool(panel.has_device and total and total <= 3 * top)
    scale, unit = _unit(max(top, total) if total_on_scale else top)
    for key, label, style in series:
        if key not in panel.series:
            continue
        times, values = _sorted_by_time(*panel.series[key])
        marker = "." if len(times) < 200 else None
        times, values = _envelope(times, values)
        ax.plot(times - t0, values / scale, style, marker=marker, label=label)
    if total_on_scale:
        ax.axhline(total / scale, color="black", linestyle="--", linewidth=1, label="device total")
    # Phase shading from phase_start/phase_end pairs.
    times, starts, names = _sorted_by_time(panel.phase_t, panel.phase_start, panel.phase_name)
    open_phases: dict[str, float] = {}
    shaded: set[str] = set()
    for t, start, phase in zip(times - t0, starts, names):
        if start:
            open_phases[phase] = float(t)
        elif phase in open_phases:
            begin = open_phases.pop(phase)
            ax.axvspan(begin, float(t), color=_PHASE_COLORS.get(phase, "grey"), alpha=0.12,
                       label=None if phase in shaded else f"{phase} phase")
            shaded.add(phase)
    if len(panel.warn_t):
        times, values = _sorted_by_time(panel.warn_t, panel.warn_v)
        ax.scatter(times - t0, values / scale, color="red", marker="x", zorder=5, label="threshold warning")
    ax.set_ylabel(f"memory ({unit})")
    off_scale = panel.has_device and total and not total_on_scale
    note = f", device total {format_bytes(total)} (off the scale)" if off_scale else ""
    name = f"rank {rank}" + ((f", run {run}" if run is not None else ", no run_id") if several_runs else "")
    ax.set_title(f"{name} ({panel.device or '?'}{note})", loc="left", fontsize=10)
    ax.grid(alpha=0.3)
    ax.set_ylim(0, (max(top, total) if total_on_scale else top) / scale * 1.2)
    ax.legend(loc="lower right", fontsize=8, ncol=3, framealpha=0.9)


def plot_memory_timeline(
    records_by_file: Mapping[str, Iterable[Mapping[str, Any]]], path: str | os.PathLike[str]
) -> Path:
    """Plot allocated / reserved / peak (or host RSS) against time, one panel per rank (and run), phases shaded.

    Args:
        records_by_file: Records of each log, keyed by a label (the file name).
        path: Where to write the plot; the extension picks the format (``.png``, ``.svg``, ``.pdf``, ...).

    Returns:
        The path written.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: ``path`` has an extension matplotlib cannot write or cannot be created.
    """
    check_path("path", path, allow_none=False)
    if not isinstance(records_by_file, Mapping) or not records_by_file:
        raise ValueError(
            "`records_by_file` must be a non-empty mapping of a label (the file name) to that log's records,"
            f" got {records_by_file!r}. Example: `{{'memory_rank0.jsonl': load_memory_log('memory_rank0.jsonl')}}`."
        )
    target, fmt = _check_plot_path(path)
    summarizer = _LogSummarizer(plot=True)
    for label, records in records_by_file.items():
        _add_checked(summarizer, records, str(label))
    return _draw(summarizer, records_by_file, target, fmt)


def _labels(paths: Sequence[Path]) -> list[str]:
    names = [p.name for p in paths]
    return [p.name if names.count(p.name) == 1 else str(p) for p in paths]


def analyze_memory_logs(
    paths: Sequence[str | os.PathLike[str]], plot: str | os.PathLike[str] | None = None
) -> tuple[list[PhaseSummary], str]:
    """Read logs, summarise them and optionally plot them: what ``lightning-memopt analyze`` does.

    The files are streamed (memory stays a fraction of their size). Paths and the plot's path are checked
    before any file is read. Records that cannot be used are skipped with one ``UserWarning`` per file naming
    the lines; a file with nothing usable is left out with a warning.

    Returns:
        The summaries and the text table (with the plot's path appended when one was written).

    Raises:
        MemoryLogError: a file is missing or not a regular file, or no file holds a usable record.
        ValueError: ``plot`` has an extension matplotlib cannot write, or its directory cannot be created.
        ImportError: ``plot`` is given and matplotlib is not installed.
    """
    if isinstance(paths, (str, os.PathLike)) or not isinstance(paths, Iterable):
        example = os.fspath(paths) if isinstance(paths, (str, os.PathLike)) else "memory_rank0.jsonl"
        raise ValueError(
            f"`paths` must be a list of memory log paths, got {paths!r} ({type(paths).__name__})."
            f" Pass a list, e.g. `analyze_memory_logs([{example!r}])`."
        )
    paths = list(paths)
    if not paths:
        raise MemoryLogError(
            "`paths` must name at least one memory log, got []; pass the memory_rank*.jsonl files written by"
            " MemoryMonitor."
        )
    for index, p in enumerate(paths):
        check_path(f"paths[{index}]", p, allow_none=False)
    files = [Path(p) for p in paths]
    for file in files:
        _check_log_path(file)
    target = _check_plot_path(plot) if plot is not None else None
    summarizer = _LogSummarizer(plot=target is not None)
    reports = [_read_into(file, summarizer) for file in files]
    if not summarizer.num_records:
        if len(reports) == 1:
            raise MemoryLogError(reports[0].error())
        raise MemoryLogError("no usable memory records: " + "; ".join(r.error() for r in reports))
    for report in reports:
        message = report.warning()
        if message:
            warnings.warn(message, stacklevel=2)
    summaries = summarizer.summaries()
    text = format_summary(summaries)
    if target is not None:
        used = [r.path for r in reports if r.usable]
        written = _draw(summarizer, _labels(used), *target)
        text += f"\nplot: {written}"
    return summaries, text
