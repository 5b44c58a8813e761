"""The timeline plot of memory logs: allocated / reserved / peak (or host RSS) against time, one panel per rank (and
run), phases shaded, warnings and micro-batch changes marked with their text.

matplotlib and numpy are imported when a plot is drawn, never when this module is imported.
"""

from __future__ import annotations

import os
import re
import textwrap
from array import array
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from lightning_memopt.analysis.ranks import node_key, rank_where
from lightning_memopt.analysis.records import MICRO_BATCH_EVENT, MemoryLogError
from lightning_memopt.analysis.summary import LogSummarizer, add_checked
from lightning_memopt.analysis.timeline import DEVICE_SERIES, HOST_SERIES, TimelinePanel
from lightning_memopt.utilities.checks import check_path
from lightning_memopt.utilities.formatting import format_bytes

__all__ = ["check_plot_path", "draw", "plot_memory_timeline"]

_PHASE_COLORS = {"train": "#4C72B0", "validate": "#55A868", "test": "#C44E52", "predict": "#8172B2"}


def _unit(max_bytes: float) -> tuple[float, str]:
    return (1024**3, "GiB") if max_bytes >= 1024**3 else (1024**2, "MiB")


def check_plot_path(plot: str | os.PathLike[str]) -> tuple[Path, str]:
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


def _float64_view(buffer: array) -> Any:
    """A zero-copy float64 view of ``buffer``; an empty array when it holds nothing."""
    import numpy as np

    if not len(buffer):
        return np.empty(0)
    return np.frombuffer(buffer, dtype=np.float64)


def _sorted_by_time(times: array, *columns: Any) -> tuple[Any, ...]:
    import numpy as np

    # Zero-copy views of the buffers; stable, so records of equal time keep the order they were written in.
    t = _float64_view(times)
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


def draw(summarizer: LogSummarizer, labels: Iterable[str], path: Path, fmt: str) -> Path:
    """Draw the panels ``summarizer`` kept (built with ``plot=True``) into ``path`` (checked by
    :func:`check_plot_path`), titled with the logs' ``labels``; returns ``path``.

    Raises:
        MemoryLogError: there is nothing to plot.
        ValueError: the file cannot be written.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    panels = summarizer.panels()
    if not panels:
        raise MemoryLogError("no memory records to plot")
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 3.6 * len(panels)), squeeze=False, sharex=True)
    try:
        several_nodes = len({node_key(panel.node_rank, panel.host) for *_, panel in panels}) > 1
        for ax, (run, rank, t0, panel) in zip(axes[:, 0], panels):
            title = f"rank {rank}"
            if several_nodes:
                title = rank_where(rank, panel.node_rank, panel.host)
            _draw_panel(ax, run, title, t0, panel, summarizer.several_runs)
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


def _draw_panel(ax: Any, run: str | None, rank: str, t0: float, panel: TimelinePanel, several_runs: bool) -> None:
    """One (run, rank) panel; ``rank`` is its name (``rank 2``, or ``rank 2 (node 1, gpu-b)`` over several nodes)."""
    series = DEVICE_SERIES if panel.has_device else HOST_SERIES
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
    note = ""
    if off_scale:
        note = f", device total {format_bytes(total)} (off the scale)"
    unmarked = sum(panel.checks.values()) - len(panel.findings)
    if unmarked:
        note += f"; {unmarked} more warnings not marked"
    name = _panel_name(rank, run, several_runs)
    ax.set_title(f"{name} ({panel.device or '?'}{note})", loc="left", fontsize=10)
    ax.grid(alpha=0.3)
    headroom = 1.6 if panel.findings or panel.changes else 1.2  # room for the warnings' boxes above the lines
    ax.set_ylim(0, (max(top, total) if total_on_scale else top) / scale * headroom)
    ax.legend(loc="lower right", fontsize=8, ncol=3, framealpha=0.9)


def _panel_name(rank: str, run: str | None, several_runs: bool) -> str:
    """A panel's name: ``rank``, followed by its run when the logs hold several runs."""
    if not several_runs:
        return rank
    return rank + (f", run {run}" if run is not None else ", no run_id")


def _finding_label(check: str, text: str, width: int = 60, limit: int = 150) -> str:
    """A finding's text for the plot: its check and first sentence, without the callback's prefix, wrapped."""
    # "MemoryAudit [rank 0] (first step): 3 tensors ..." -> "3 tensors ..."
    text = re.sub(r"^\w+ \[rank \d+\](?: \([^)]*\))?: ", "", text)
    sentence = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0]
    if len(sentence) > limit:
        sentence = sentence[: limit - 3].rstrip() + "..."
    label = sentence if check == MICRO_BATCH_EVENT else f"{check}: {sentence}"
    return "\n".join(textwrap.wrap(label, width=width))


def _finding_color(check: str) -> str:
    """The colour of a finding's line and box: purple for a micro-batch change, dark red for a leak or duplicates."""
    if check == MICRO_BATCH_EVENT:
        return "purple"
    if check in ("leak", "duplicates"):
        return "darkred"
    return "darkorange"


def _draw_findings(ax: Any, t0: float, panel: TimelinePanel) -> None:
    """Each listed warning that is not a threshold mark, and each micro-batch change: a line at its time and a box
    with its text (dashed for warnings, dotted for micro-batch changes)."""
    if not panel.findings and not panel.changes:
        return
    findings = sorted([*panel.findings, *panel.changes])
    if ax.lines or ax.collections:
        low, high = ax.get_xlim()
    else:
        low, high = 0.0, 1.0
    low, high = min(low, findings[0][0] - t0), max(high, findings[-1][0] - t0)
    labelled: set[str] = set()
    for i, (t, check, text) in enumerate(findings):
        x = t - t0
        change = check == MICRO_BATCH_EVENT
        color = _finding_color(check)
        label = None
        if check not in labelled:
            label = "micro-batch change" if change else f"{check} warning"
        ax.axvline(
            x,
            color=color,
            linestyle=":" if change else "--",
            linewidth=1.2,
            zorder=4,
            label=label,
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

    Records that cannot be used are left out with one warning per label, naming their indices.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: ``path`` has an extension matplotlib cannot write or cannot be created, or
            ``records_by_file`` is not a non-empty mapping.
        MemoryLogError: no record can be used.
    """
    check_path("path", path, allow_none=False)
    if not isinstance(records_by_file, Mapping) or not records_by_file:
        raise ValueError(
            "`records_by_file` must be a non-empty mapping of a label (the file name) to that log's records,"
            f" got {records_by_file!r}. Example: `{{'memory_rank0.jsonl': load_memory_log('memory_rank0.jsonl')}}`."
        )
    target, fmt = check_plot_path(path)
    summarizer = LogSummarizer(plot=True)
    for label, records in records_by_file.items():
        add_checked(summarizer, records, str(label))
    return draw(summarizer, records_by_file, target, fmt)
