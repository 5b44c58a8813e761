"""Reading memory JSONL logs back: load, summarise per phase and rank, plot a timeline."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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


class MemoryLogError(ValueError):
    """A memory log that cannot be read: missing, unreadable or not a JSONL memory log."""


def load_memory_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read one JSONL memory log written by :class:`~lightning_memopt.MemoryMonitor`.

    A truncated last line (a run killed mid-write) is skipped with a warning that names the line. Any
    other line that is not a JSON object with ``time``, ``rank``, ``phase`` and ``event`` makes the file
    invalid.

    Raises:
        MemoryLogError: the file is missing, unreadable, empty or not a memory log.

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
    path = Path(path)
    if not path.exists():
        raise MemoryLogError(f"{path}: no such file")
    if path.is_dir():
        raise MemoryLogError(f"{path}: is a directory; pass the memory_rank*.jsonl files inside it")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise MemoryLogError(f"{path}: cannot be read as text ({err})") from err
    lines = text.split("\n")
    ends_cleanly = text.endswith("\n")
    if ends_cleanly:
        lines = lines[:-1]
    records: list[dict[str, Any]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        is_last = number == len(lines)
        try:
            record = json.loads(line)
        except ValueError:
            if is_last and not ends_cleanly and records:
                warnings.warn(f"{path}: line {number} is truncated (the run stopped mid-write); skipped it.",
                              stacklevel=2)
                continue
            raise MemoryLogError(f"{path}: line {number} is not JSON; is this a memory JSONL log?") from None
        if not isinstance(record, dict) or any(k not in record for k in _REQUIRED_KEYS):
            raise MemoryLogError(
                f"{path}: line {number} is not a memory record (needs keys {', '.join(_REQUIRED_KEYS)})"
            )
        records.append(record)
    if not records:
        raise MemoryLogError(f"{path}: holds no memory records")
    return records


@dataclass(frozen=True)
class PhaseSummary:
    """What one rank's log says about one phase. Sizes in bytes; ``None`` where the log has no figure."""

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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _values(records: Iterable[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in records if isinstance(r.get(key), (int, float))]


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _slope_per_1k(points: Sequence[tuple[float, float]]) -> float | None:
    xs = {x for x, _ in points}
    if len(xs) < 2:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    return 1000.0 * sxy / sxx


def _peak(records: Sequence[dict[str, Any]]) -> tuple[int | None, dict[str, Any] | None]:
    """Highest allocated figure and the first record that shows it."""
    best, where = None, None
    for r in records:
        for key in ("phase_peak_allocated_bytes", "peak_allocated_bytes", "allocated_bytes"):
            value = r.get(key)
            if isinstance(value, (int, float)) and (best is None or value > best):
                best, where = int(value), r
    return best, where


def summarize_memory_log(records: Sequence[dict[str, Any]]) -> list[PhaseSummary]:
    """Summarise records (of one or more ranks) per (rank, phase).

    Growth is the least-squares slope of allocated bytes (host RSS where the device gives none) against
    ``global_step``, times 1000, over the later half of the phase's step readings (all of them when there are
    fewer than 6): the first readings hold the warm-up (data, optimizer state, the allocator's cache arriving),
    which is not growth.

    Example:
        >>> recs = [{"time": t, "rank": 0, "phase": "train", "event": "step", "global_step": s, "epoch": 0,
        ...          "allocated_bytes": 100 + 2 * s, "reserved_bytes": 400, "host_rss_bytes": 10}
        ...         for t, s in [(1.0, 10), (2.0, 20), (3.0, 30)]]
        >>> s = summarize_memory_log(recs)[0]
        >>> s.peak_allocated_bytes, s.growth_bytes_per_1k_steps, s.peak_global_step
        (160, 2000.0, 30)
    """
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((int(r["rank"]), str(r["phase"])), []).append(r)
    t0 = min((float(r["time"]) for r in records), default=0.0)
    out = []
    for (rank, phase), recs in sorted(groups.items(), key=lambda kv: (kv[0][0], _PHASE_ORDER.get(kv[0][1], 9))):
        steps = [r for r in recs if r.get("event") == "step"]
        readings = [r for r in recs if r.get("event") in ("step", "phase_start", "phase_end")]
        peak_alloc, where = _peak(readings)
        peak_reserved_values = _values(readings, "peak_reserved_bytes") + _values(readings, "reserved_bytes") + _values(
            readings, "phase_peak_reserved_bytes")
        rss = _values(readings, "host_rss_bytes")
        growth_field = "allocated_bytes" if _values(steps, "allocated_bytes") else (
            "host_rss_bytes" if _values(steps, "host_rss_bytes") else None)
        growth = None
        if growth_field is not None:
            points = [(float(r["global_step"]), float(r[growth_field])) for r in steps
                      if isinstance(r.get("global_step"), int) and isinstance(r.get(growth_field), (int, float))]
            if len(points) >= 6:
                points = sorted(points)[len(points) // 2:]
            growth = _slope_per_1k(points)
        if where is None and rss:
            # No device figures: the peak is the host's.
            where = max((r for r in readings if isinstance(r.get("host_rss_bytes"), (int, float))),
                        key=lambda r: r["host_rss_bytes"])
        totals = _values(recs, "device_total_bytes")
        out.append(
            PhaseSummary(
                rank=rank,
                phase=phase,
                device=next((r.get("device") for r in recs if r.get("device")), None),
                num_readings=len(steps),
                peak_allocated_bytes=peak_alloc,
                peak_reserved_bytes=int(max(peak_reserved_values)) if peak_reserved_values else None,
                mean_allocated_bytes=_mean(_values(steps, "allocated_bytes")),
                mean_reserved_bytes=_mean(_values(steps, "reserved_bytes")),
                peak_host_rss_bytes=int(max(rss)) if rss else None,
                mean_host_rss_bytes=_mean(_values(steps, "host_rss_bytes")),
                device_total_bytes=int(max(totals)) if totals else None,
                growth_field=growth_field,
                growth_bytes_per_1k_steps=growth,
                warnings=sum(1 for r in recs if r.get("event") == "warning"),
                peak_global_step=None if where is None else where.get("global_step"),
                peak_epoch=None if where is None else where.get("epoch"),
                peak_seconds=None if where is None else round(float(where["time"]) - t0, 3),
            )
        )
    return out


def format_summary(summaries: Sequence[PhaseSummary]) -> str:
    """A plain-text table of summaries, one row per (rank, phase)."""
    header = ("rank", "phase", "readings", "peak alloc", "peak reserved", "mean alloc", "peak host RSS",
              "growth/1k steps", "warnings", "peak at")
    rows = [header]
    for s in summaries:
        growth = "n/a" if s.growth_bytes_per_1k_steps is None else (
            ("+" if s.growth_bytes_per_1k_steps >= 0 else "-") + format_bytes(abs(s.growth_bytes_per_1k_steps)))
        if s.growth_field == "host_rss_bytes" and s.growth_bytes_per_1k_steps is not None:
            growth += " (RSS)"
        peak_at = "n/a" if s.peak_global_step is None else (
            f"step {s.peak_global_step}, epoch {s.peak_epoch}, {s.peak_seconds:.1f} s")
        rows.append((str(s.rank), s.phase, str(s.num_readings), format_bytes(s.peak_allocated_bytes),
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


def plot_memory_timeline(
    records_by_file: dict[str, Sequence[dict[str, Any]]], path: str | os.PathLike[str]
) -> Path:
    """Plot allocated / reserved / peak (or host RSS) against time, one panel per rank, phases shaded.

    Args:
        records_by_file: Records of each log, keyed by a label (the file name).
        path: Where to write the PNG.

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    by_rank: dict[int, list[dict[str, Any]]] = {}
    for recs in records_by_file.values():
        for r in recs:
            by_rank.setdefault(int(r["rank"]), []).append(r)
    ranks = sorted(by_rank)
    all_records = [r for recs in by_rank.values() for r in recs]
    t0 = min(float(r["time"]) for r in all_records)
    fig, axes = plt.subplots(len(ranks), 1, figsize=(11, 3.6 * len(ranks)), squeeze=False, sharex=True)
    for ax, rank in zip(axes[:, 0], ranks):
        recs = sorted(by_rank[rank], key=lambda r: float(r["time"]))
        readings = [r for r in recs if r.get("event") in ("step", "phase_start", "phase_end")]
        has_device = any(isinstance(r.get("allocated_bytes"), (int, float)) for r in readings)
        series = (
            [("allocated_bytes", "allocated", "-"), ("reserved_bytes", "reserved", "-"),
             ("peak_allocated_bytes", "peak allocated (since phase start)", ":")]
            if has_device else [("host_rss_bytes", "host RSS (no device readings)", "-")]
        )
        top = max([float(r.get(k) or 0) for r in readings for k, _, _ in series] + [1.0])
        total = max([float(r.get("device_total_bytes") or 0) for r in readings] + [0.0])
        # The device total as a line when it is on the same scale as the data; else as a note, so that
        # a run using 1 GiB of an 80 GiB card is still readable.
        total_on_scale = bool(has_device and total and total <= 3 * top)
        scale, unit = _unit(max(top, total) if total_on_scale else top)
        for key, label, style in series:
            pts = [(float(r["time"]) - t0, float(r[key]) / scale) for r in readings
                   if isinstance(r.get(key), (int, float))]
            if pts:
                ax.plot(*zip(*pts), style, marker="." if len(pts) < 200 else None, label=label)
        if total_on_scale:
            ax.axhline(total / scale, color="black", linestyle="--", linewidth=1, label="device total")
        # Phase shading from phase_start/phase_end pairs.
        open_phases: dict[str, float] = {}
        shaded: set[str] = set()
        for r in recs:
            t = float(r["time"]) - t0
            if r.get("event") == "phase_start":
                open_phases[r["phase"]] = t
            elif r.get("event") == "phase_end" and r["phase"] in open_phases:
                start = open_phases.pop(r["phase"])
                ax.axvspan(start, t, color=_PHASE_COLORS.get(r["phase"], "grey"), alpha=0.12,
                           label=None if r["phase"] in shaded else f"{r['phase']} phase")
                shaded.add(r["phase"])
        warn = [(float(r["time"]) - t0, float(r.get(r.get("field") or "allocated_bytes") or 0) / scale)
                for r in recs if r.get("event") == "warning"]
        if warn:
            ax.scatter(*zip(*warn), color="red", marker="x", zorder=5, label="threshold warning")
        ax.set_ylabel(f"memory ({unit})")
        device = next((r.get("device") for r in recs if r.get("device")), "?")
        off_scale = has_device and total and not total_on_scale
        note = f", device total {format_bytes(total)} (off the scale)" if off_scale else ""
        ax.set_title(f"rank {rank} ({device}{note})", loc="left", fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_ylim(0, (max(top, total) if total_on_scale else top) / scale * 1.2)
        ax.legend(loc="lower right", fontsize=8, ncol=3, framealpha=0.9)
    axes[-1, 0].set_xlabel("seconds since the first record")
    fig.suptitle("Memory timeline: " + ", ".join(records_by_file), fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def analyze_memory_logs(
    paths: Sequence[str | os.PathLike[str]], plot: str | os.PathLike[str] | None = None
) -> tuple[list[PhaseSummary], str]:
    """Load logs, summarise them and optionally plot them: what ``lightning-memopt analyze`` does.

    Returns:
        The summaries and the text table (with the plot's path appended when one was written).

    Raises:
        MemoryLogError: a file is missing or not a memory log.
    """
    loaded = {str(p): load_memory_log(p) for p in paths}
    records = [r for recs in loaded.values() for r in recs]
    summaries = summarize_memory_log(records)
    text = format_summary(summaries)
    if plot is not None:
        labels = {Path(k).name if list(map(lambda q: Path(q).name, loaded)).count(Path(k).name) == 1 else k: v
                  for k, v in loaded.items()}
        written = plot_memory_timeline(labels, plot)
        text += f"\nplot: {written}"
    return summaries, text
