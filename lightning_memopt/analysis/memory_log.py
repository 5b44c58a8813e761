"""Reading memory JSONL logs back: load, summarise per run, rank and phase, plot a timeline.

:func:`analyze_memory_logs` streams the logs: it reads one line at a time and keeps, per rank and phase, only
the few numbers a summary or a plot needs (in compact ``array`` buffers), so its memory stays a fraction of
the logs' size however long the run was. A record it cannot use (not JSON, not an object, a field of the
wrong type, NaN) is skipped, and each file with skipped records gets one warning that names the lines.

Records may carry a ``run_id``: records of different runs (a log appended to by a second run, or logs of two
runs analysed together) get rows and plot panels of their own instead of sharing one time axis.

Growth is judged from a straight line fitted to a phase's step readings against ``global_step`` (see
:func:`summarize_memory_log` for the rule): it is reported with the steps it was measured over, and only when the
line rises or falls clearly more than the readings scatter around it; otherwise the phase is "flat", or "too short
to tell" when there are too few readings over too few steps. ``warning`` records (MemoryAudit's duplicate and leak
findings, MemoryMonitor's threshold warnings) are kept with their text: the summary lists them under the table and
the plot marks each one with a label. ``micro_batch`` records (AutoMicroBatch's changes of the micro-batch size)
are listed under the table, summed up in a ``micro-batch`` column and marked on the plot with a dotted line.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import textwrap
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
    "MemoryFinding",
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
_DEVICE_SERIES = (
    ("allocated_bytes", "allocated", "-"),
    ("reserved_bytes", "reserved", "-"),
    ("peak_allocated_bytes", "peak allocated (since phase start)", ":"),
)
_HOST_SERIES = (("host_rss_bytes", "host RSS (no device readings)", "-"),)
_MAX_LINE_BYTES = 1 << 20
_LISTED_LINES = 10
_LISTED_REASONS = 3
_NO_RUN = "-"
#: Warnings kept with their text per (run, rank, phase) and check, and per plot panel and check; the rest are counted.
_LISTED_FINDINGS = 5
_MAX_FINDING_CHARS = 2000
#: The growth rule (see `summarize_memory_log`): the fit leaves out this fraction of a phase's steps (warm-up)
#: and needs this many readings over this many steps, in at least this many of 8 blocks, in the rest ...
_GROWTH_WARM_UP = 1 / 3
_GROWTH_MIN_READINGS = 10
_GROWTH_MIN_STEPS = 100
_GROWTH_BLOCKS = 8
_GROWTH_MIN_BLOCKS = 4
#: ... and reports a slope only when it is this many standard errors from zero and the line's change over the
#: fitted steps is this many times the readings' scatter around the line (residual standard deviation).
_GROWTH_MIN_T = 4.0
_GROWTH_MIN_CHANGE_OVER_NOISE = 2.0
#: Step buckets the fit keeps per phase: sums per bucket, never the readings, so memory does not grow with the log.
_GROWTH_BUCKETS = 64
#: AutoMicroBatch's record of a micro-batch change; kept with its text per (run, rank, phase) and per plot panel.
_MICRO_BATCH_EVENT = "micro_batch"
_LISTED_CHANGES = 20


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
            warnings.warn(
                f"{path}: line {line.number} is truncated (the run stopped mid-write); skipped it.", stacklevel=2
            )
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
class MemoryFinding:
    """One ``warning`` record of a log, with its text.

    ``check`` is what found it: ``"duplicates"`` or ``"leak"`` (MemoryAudit's ``check`` field), ``"threshold"``
    (MemoryMonitor's ``warn_threshold``) or ``"warning"`` (a warning record that says neither). ``seconds`` counts
    from the first record of the same run. Messages longer than 2,000 characters are cut there.
    """

    check: str
    message: str
    global_step: int | None
    epoch: int | None
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PhaseSummary:
    """What one rank's log says about one phase of one run. Sizes in bytes; ``None`` where the log has no figure.

    ``run_id`` is the records' ``run_id`` (``None`` for records without one).

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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _max(current: float | None, value: float | None) -> float | None:
    if value is None:
        return current
    return value if current is None or value > current else current


def _merge(a: list[float], b: list[float]) -> list[float]:
    """Two buckets' least-squares sums as one (pairwise update of means and co-moments: stable, exact)."""
    n = a[0] + b[0]
    dx, dy = b[3] - a[3], b[4] - a[4]
    w = a[0] * b[0] / n
    return [
        n,
        min(a[1], b[1]),
        max(a[2], b[2]),
        a[3] + dx * b[0] / n,
        a[4] + dy * b[0] / n,
        a[5] + b[5] + dx * dx * w,
        a[6] + b[6] + dy * dy * w,
        a[7] + b[7] + dx * dy * w,
    ]


@dataclass(frozen=True)
class _Growth:
    verdict: str  # "growing", "shrinking", "flat" or "too short"
    per_1k_steps: float | None
    readings: int
    first_step: int | None
    last_step: int | None


class _StepFit:
    """(global_step, bytes) readings as least-squares sums in at most ``_GROWTH_BUCKETS`` step buckets.

    A bucket holds ``[n, first step, last step, mean step, mean bytes, Sxx, Syy, Sxy]`` (sums of squares about
    its means, updated one reading at a time, so large byte counts lose no precision). Buckets cover steps
    ``[k * width, (k + 1) * width)``; when there are too many, the width doubles and neighbours merge. The buckets
    depend only on which readings arrived, not on their order, and fitting any run of buckets is exact.
    """

    __slots__ = ("buckets", "width")

    def __init__(self) -> None:
        self.width = 1
        self.buckets: dict[int, list[float]] = {}

    def __len__(self) -> int:
        return len(self.buckets)

    def add(self, step: int, value: float) -> None:
        key = step // self.width
        b = self.buckets.get(key)
        if b is None:
            self.buckets[key] = [1.0, step, step, float(step), float(value), 0.0, 0.0, 0.0]
            while len(self.buckets) > _GROWTH_BUCKETS:
                self._coarsen()
            return
        n = b[0] + 1.0
        dx, dy = step - b[3], value - b[4]
        b[3] += dx / n
        b[4] += dy / n
        b[5] += dx * (step - b[3])
        b[6] += dy * (value - b[4])
        b[7] += dx * (value - b[4])
        b[0] = n
        if step < b[1]:
            b[1] = step
        elif step > b[2]:
            b[2] = step

    def _coarsen(self) -> None:
        self.width *= 2
        merged: dict[int, list[float]] = {}
        for key, b in self.buckets.items():
            half = key // 2
            merged[half] = b if half not in merged else _merge(merged[half], b)
        self.buckets = merged

    def growth(self) -> _Growth:
        """The verdict of the rule in :func:`summarize_memory_log`."""
        buckets = [self.buckets[k] for k in sorted(self.buckets)]
        if not buckets:
            return _Growth("too short", None, 0, None, None)
        first, last = int(buckets[0][1]), int(buckets[-1][2])
        short = _Growth("too short", None, int(sum(b[0] for b in buckets)), first, last)
        cut = first + (last - first) * _GROWTH_WARM_UP
        window = [b for b in buckets if b[1] >= cut]  # the first part of the steps holds the warm-up
        if not window:
            return short
        fit = window[0]
        for b in window[1:]:
            fit = _merge(fit, b)
        n, lo, hi, mx, my, sxx, syy, sxy = fit
        blocks = _blocks(window, _GROWTH_BLOCKS)
        if n < _GROWTH_MIN_READINGS or hi - lo < _GROWTH_MIN_STEPS or len(blocks) < _GROWTH_MIN_BLOCKS:
            return short
        slope = sxy / sxx
        scatter = max(syy - slope * sxy, 0.0) / (n - 2)  # the readings' variance about the line
        # The block means' variance about the line, per reading: as large as `scatter` when the readings
        # scatter independently, larger when memory wanders in plateaus (host RSS); the slope's error uses the larger.
        wander = sum(b[0] * (b[4] - my - slope * (b[3] - mx)) ** 2 for b in blocks) / (len(blocks) - 2)
        error = math.sqrt(max(scatter, wander) / sxx)
        change = slope * (hi - lo)
        significant = (
            slope != 0
            and abs(slope) >= _GROWTH_MIN_T * error
            and (abs(change) >= _GROWTH_MIN_CHANGE_OVER_NOISE * math.sqrt(scatter))
        )
        if not significant:
            return _Growth("flat", None, int(n), int(lo), int(hi))
        return _Growth("growing" if slope > 0 else "shrinking", 1000.0 * slope, int(n), int(lo), int(hi))


def _blocks(buckets: list[list[float]], count: int) -> list[list[float]]:
    """Consecutive buckets merged into at most ``count`` blocks of about the same number of readings."""
    total = sum(b[0] for b in buckets)
    blocks: list[list[float]] = []
    current: list[float] | None = None
    done = 0.0
    for b in buckets:
        current = b if current is None else _merge(current, b)
        done += b[0]
        if done * count >= total * (len(blocks) + 1):
            blocks.append(current)
            current = None
    if current is not None:
        blocks.append(current)
    return blocks


def _finding_check(r: Mapping[str, Any]) -> str:
    check = r.get("check")
    if isinstance(check, str) and check:
        return check
    return "threshold" if isinstance(r.get("field"), str) and r.get("field") else "warning"


def _finding_text(r: Mapping[str, Any]) -> str:
    message = r.get("message")
    if not isinstance(message, str) or not message.strip():
        return "(no message)"
    message = " ".join(message.split())
    return message if len(message) <= _MAX_FINDING_CHARS else message[: _MAX_FINDING_CHARS - 3] + "..."


def _int_field(r: Mapping[str, Any], key: str) -> int | None:
    value = r.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _micro_batch_text(r: Mapping[str, Any]) -> str:
    """``micro-batch 16 -> 8 (out of memory; batch of 16)`` from a ``micro_batch`` record; "?" for a missing size."""
    old, new, n = (_int_field(r, k) for k in ("previous_micro_batch_size", "micro_batch_size", "batch_size"))
    reason = r.get("reason")
    why = [" ".join(reason.split())[:200]] if isinstance(reason, str) and reason.strip() else []
    if n is not None:
        why.append(f"batch of {n}")
    text = f"micro-batch {old if old is not None else '?'} -> {new if new is not None else '?'}"
    return text + (f" ({'; '.join(why)})" if why else "")


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
    # Step readings for the growth fit; host RSS only until a device figure appears.
    alloc_fit: _StepFit = field(default_factory=_StepFit)
    rss_fit: _StepFit = field(default_factory=_StepFit)
    checks: dict[str, int] = field(default_factory=dict)  # check -> warnings
    findings: list[tuple[str, str, Any, Any, float]] = field(default_factory=list)  # check, text, step, epoch, time
    changes: list[tuple[str, str, Any, Any, float]] = field(default_factory=list)  # micro-batch changes, as findings
    num_changes: int = 0
    micro_batch_size: int | None = None

    def add(self, r: Mapping[str, Any], event: str, t: float) -> None:
        if self.device is None and r.get("device"):
            self.device = r["device"]
        self.device_total = _max(self.device_total, r.get("device_total_bytes"))
        if event == "warning":
            self.warnings += 1
            check = _finding_check(r)
            seen = self.checks.get(check, 0)
            self.checks[check] = seen + 1
            if seen < _LISTED_FINDINGS:
                self.findings.append((check, _finding_text(r), r.get("global_step"), r.get("epoch"), t))
        elif event == _MICRO_BATCH_EVENT:
            self.num_changes += 1
            self.micro_batch_size = _int_field(r, "micro_batch_size") or self.micro_batch_size
            if len(self.changes) < _LISTED_CHANGES:
                self.changes.append((_MICRO_BATCH_EVENT, _micro_batch_text(r), r.get("global_step"), r.get("epoch"), t))
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
            if not self.alloc_n and len(self.rss_fit):
                self.rss_fit = _StepFit()  # device figures win: the host's are not needed
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
        growth_field = "allocated_bytes" if self.alloc_n else ("host_rss_bytes" if self.rss_n else None)
        growth = None
        if growth_field is not None:
            growth = (self.alloc_fit if growth_field == "allocated_bytes" else self.rss_fit).growth()
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
            findings=tuple(
                MemoryFinding(check, text, step, epoch, round(t - t0, 3))
                for check, text, step, epoch, t in self.findings
            ),
            micro_batch_changes=tuple(
                MemoryFinding(check, text, step, epoch, round(t - t0, 3))
                for check, text, step, epoch, t in self.changes
            ),
            num_micro_batch_changes=self.num_changes,
            micro_batch_size=self.micro_batch_size,
        )


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
    # Threshold warnings with the figure they are about: a mark at that figure.
    warn_t: array = field(default_factory=lambda: array("d"))
    warn_v: array = field(default_factory=lambda: array("d"))
    # Every other warning (MemoryAudit's findings): a labelled line at its time. (time, check, text)
    findings: list[tuple[float, str, str]] = field(default_factory=list)
    checks: dict[str, int] = field(default_factory=dict)
    # AutoMicroBatch's changes: a labelled dotted line at their time. (time, "micro_batch", text)
    changes: list[tuple[float, str, str]] = field(default_factory=list)

    def add(self, r: Mapping[str, Any], event: str, t: float) -> None:
        if r.get("device") and t < self.device_time:
            self.device, self.device_time = r["device"], t
        if event == "warning":
            check = _finding_check(r)
            value = r.get(r["field"]) if check == "threshold" else None
            if is_finite_number(value) and value >= 0:
                self.warn_t.append(t)
                self.warn_v.append(float(value))
                return
            seen = self.checks.get(check, 0)
            self.checks[check] = seen + 1
            if seen < _LISTED_FINDINGS:
                self.findings.append((t, check, _finding_text(r)))
            return
        if event == _MICRO_BATCH_EVENT and len(self.changes) < _LISTED_CHANGES:
            self.changes.append((t, _MICRO_BATCH_EVENT, _micro_batch_text(r)))
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
        return (
            f"{self.path}: skipped {self.skipped} of {self.skipped + self.usable} records"
            f" ({_lines_text(self.lines, self.skipped)}): {self.why()}"
        )

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

    Example:
        >>> recs = [{"time": float(s), "rank": 0, "phase": "train", "event": "step", "global_step": s, "epoch": 0,
        ...          "allocated_bytes": 100 + 2 * s, "reserved_bytes": 400, "host_rss_bytes": 10}
        ...         for s in range(0, 401, 10)]
        >>> s = summarize_memory_log(recs)[0]
        >>> s.peak_allocated_bytes, s.growth, s.growth_bytes_per_1k_steps, s.growth_first_step, s.growth_last_step
        (900, 'growing', 2000.0, 140, 400)
        >>> summarize_memory_log(recs[:3])[0].growth
        'too short'
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
        warnings.warn(
            f"{label}: skipped {count} of {total} records (index {where}{more}):"
            f" record {skipped[0][0]} {skipped[0][1]}",
            stacklevel=3,
        )


# ----------------------------------------------------------------------------------------------------------------
# Text and plot
# ----------------------------------------------------------------------------------------------------------------


def _growth_text(s: PhaseSummary) -> str:
    """The growth cell: the fitted change over the steps it was measured on, "flat", or "too short to tell"."""
    if s.growth is None:
        return "n/a"
    first, last, n = s.growth_first_step, s.growth_last_step, s.growth_readings
    if s.growth == "too short":
        if not n or first is None:
            text = "too short to tell (no step readings)"
        elif n == 1:
            text = f"too short to tell (1 reading, step {first})"
        elif first == last:
            text = f"too short to tell ({n} readings, all at step {first})"
        else:
            text = f"too short to tell ({n} readings over steps {first}-{last})"
    elif s.growth == "flat" or s.growth_bytes_per_1k_steps is None or first is None or last is None:
        text = f"flat over steps {first}-{last}"
    else:
        change = s.growth_bytes_per_1k_steps * (last - first) / 1000
        text = f"{'+' if change >= 0 else '-'}{format_bytes(abs(change))} over steps {first}-{last}"
    return text + (" (RSS)" if s.growth_field == "host_rss_bytes" else "")


def format_summary(summaries: Sequence[PhaseSummary]) -> str:
    """A plain-text table of summaries, one row per (rank, phase); a ``run`` column when there are several runs.

    The ``growth`` column gives the fitted change over the steps it was measured on (``+96.00 MiB over steps
    200-400``), ``flat over steps ...``, or ``too short to tell (N readings over steps ...)``; ``(RSS)`` marks
    host memory where the device gives no figures. The ``warnings`` column counts warnings per check
    (``1 duplicates, 1 leak``), and below the table each warning is listed with its text (the first five of
    each check per row).

    When a log holds AutoMicroBatch's ``micro_batch`` records, a ``micro-batch`` column gives the first and last
    size and the number of changes (``16 -> 4 (2 changes)``), and each change is listed under the table.
    """
    several_runs = len({s.run_id for s in summaries}) > 1
    with_changes = any(s.num_micro_batch_changes for s in summaries)
    header = (
        "rank",
        *(("run",) if several_runs else ()),
        "phase",
        "readings",
        "peak alloc",
        "peak reserved",
        "mean alloc",
        "peak host RSS",
        "growth",
        "warnings",
        *(("micro-batch",) if with_changes else ()),
        "peak at",
    )
    rows = [header]
    findings: list[str] = []
    changes: list[str] = []
    for s in summaries:
        checks = s.warnings_by_check or ({"warning": s.warnings} if s.warnings else {})
        warned = ", ".join(f"{count} {check}" for check, count in checks.items()) or "0"
        peak_at = (
            "n/a"
            if s.peak_global_step is None
            else (f"step {s.peak_global_step}, epoch {s.peak_epoch}, {s.peak_seconds:.1f} s")
        )
        run = ((s.run_id or _NO_RUN),) if several_runs else ()
        micro = (_micro_batch_cell(s),) if with_changes else ()
        rows.append(
            (
                str(s.rank),
                *run,
                s.phase,
                str(s.num_readings),
                format_bytes(s.peak_allocated_bytes),
                format_bytes(s.peak_reserved_bytes),
                format_bytes(s.mean_allocated_bytes),
                format_bytes(s.peak_host_rss_bytes),
                _growth_text(s),
                warned,
                *micro,
                peak_at,
            )
        )
        where = f"rank {s.rank}" + (f", run {s.run_id or _NO_RUN}" if several_runs else "") + f", {s.phase}"
        for f in s.micro_batch_changes:
            step = "" if f.global_step is None else f", step {f.global_step}"
            changes.append(f"  {where}{step}, {f.seconds:.1f} s: {f.message}")
        if s.num_micro_batch_changes > len(s.micro_batch_changes):
            changes.append(
                f"  {where}: {s.num_micro_batch_changes - len(s.micro_batch_changes)} more changes (not listed)"
            )
        for f in s.findings:
            step = "" if f.global_step is None else f", step {f.global_step}"
            findings.append(f"  {where}{step}, {f.seconds:.1f} s: {f.check}: {f.message}")
        for check, count in checks.items():
            listed = sum(f.check == check for f in s.findings)
            if count > listed:
                findings.append(f"  {where}: {count - listed} more {check} warnings (not listed)")
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    devices = {s.device for s in summaries if s.device}
    totals = {s.device_total_bytes for s in summaries if s.device_total_bytes}
    foot = f"device: {', '.join(sorted(devices)) or 'n/a'}"
    if totals:
        foot += f"; device total {format_bytes(max(totals))}"
    lines.append(foot)
    if findings:
        lines += ["warnings in the logs:", *findings]
    if changes:
        lines += ["micro-batch changes (AutoMicroBatch):", *changes]
    return "\n".join(lines)


def _micro_batch_cell(s: PhaseSummary) -> str:
    if not s.num_micro_batch_changes:
        return "-"
    first = re.match(r"micro-batch (\S+) ->", s.micro_batch_changes[0].message) if s.micro_batch_changes else None
    start = first.group(1) if first else "?"
    end = "?" if s.micro_batch_size is None else str(s.micro_batch_size)
    count = s.num_micro_batch_changes
    return f"{start} -> {end} ({count} change{'s' if count != 1 else ''})"


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
            ax.axvspan(
                begin,
                float(t),
                color=_PHASE_COLORS.get(phase, "grey"),
                alpha=0.12,
                label=None if phase in shaded else f"{phase} phase",
            )
            shaded.add(phase)
    if len(panel.warn_t):
        times, values = _sorted_by_time(panel.warn_t, panel.warn_v)
        ax.scatter(times - t0, values / scale, color="red", marker="x", zorder=5, label="threshold warning")
    _draw_findings(ax, t0, panel)
    ax.set_ylabel(f"memory ({unit})")
    off_scale = panel.has_device and total and not total_on_scale
    note = f", device total {format_bytes(total)} (off the scale)" if off_scale else ""
    unmarked = sum(panel.checks.values()) - len(panel.findings)
    if unmarked:
        note += f"; {unmarked} more warnings not marked"
    name = f"rank {rank}" + ((f", run {run}" if run is not None else ", no run_id") if several_runs else "")
    ax.set_title(f"{name} ({panel.device or '?'}{note})", loc="left", fontsize=10)
    ax.grid(alpha=0.3)
    headroom = 1.6 if panel.findings or panel.changes else 1.2  # room for the warnings' boxes above the lines
    ax.set_ylim(0, (max(top, total) if total_on_scale else top) / scale * headroom)
    ax.legend(loc="lower right", fontsize=8, ncol=3, framealpha=0.9)


def _finding_label(check: str, text: str, width: int = 60, limit: int = 150) -> str:
    """A finding's text for the plot: its check and first sentence, without the callback's prefix, wrapped."""
    # "MemoryAudit [rank 0] (first step): 3 tensors ..." -> "3 tensors ..."
    text = re.sub(r"^\w+ \[rank \d+\](?: \([^)]*\))?: ", "", text)
    sentence = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0]
    if len(sentence) > limit:
        sentence = sentence[: limit - 3].rstrip() + "..."
    label = sentence if check == _MICRO_BATCH_EVENT else f"{check}: {sentence}"
    return "\n".join(textwrap.wrap(label, width=width))


def _draw_findings(ax: Any, t0: float, panel: _Panel) -> None:
    """Each listed warning that is not a threshold mark, and each micro-batch change: a line at its time and a box
    with its text (dashed for warnings, dotted for micro-batch changes)."""
    if not panel.findings and not panel.changes:
        return
    findings = sorted([*panel.findings, *panel.changes])
    low, high = ax.get_xlim() if ax.lines or ax.collections else (0.0, 1.0)
    low, high = min(low, findings[0][0] - t0), max(high, findings[-1][0] - t0)
    labelled: set[str] = set()
    for i, (t, check, text) in enumerate(findings):
        x = t - t0
        change = check == _MICRO_BATCH_EVENT
        color = "purple" if change else "darkred" if check in ("leak", "duplicates") else "darkorange"
        ax.axvline(
            x,
            color=color,
            linestyle=":" if change else "--",
            linewidth=1.2,
            zorder=4,
            label=None if check in labelled else "micro-batch change" if change else f"{check} warning",
        )
        labelled.add(check)
        right = high > low and x > (low + high) / 2
        ax.annotate(
            _finding_label(check, text),
            xy=(x, 1.0),
            xycoords=ax.get_xaxis_transform(),
            xytext=(-4 if right else 4, -4 - 28 * (i % 3)),
            textcoords="offset points",
            ha="right" if right else "left",
            va="top",
            fontsize=7,
            color=color,
            zorder=6,
            bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": color, "alpha": 0.9},
        )


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
