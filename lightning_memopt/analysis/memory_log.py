"""Reading memory JSONL logs back: what ``lightning-memopt analyze`` does, in :func:`analyze_memory_logs`.

:func:`analyze_memory_logs` streams the logs: it reads one line at a time and keeps, per rank and phase, only
the few numbers a summary or a plot needs (in compact ``array`` buffers), so its memory stays a fraction of
the logs' size however long the run was. A record it cannot use (not JSON, not an object, a field of the
wrong type, NaN) is skipped, and each file with skipped records gets one warning that names the lines.

Records may carry a ``run_id``: records of different runs (a log appended to by a second run, or logs of two
runs analysed together) get rows and plot panels of their own instead of sharing one time axis.

Several nodes: the logs of every node of a job are read together (directories stand for the ``memory_rank*.jsonl``
in them), one row per global rank with its node; the records' ``node_rank`` and ``host`` say where each rank ran.
A global rank of one run whose records come from two logs (or two hosts) over the same time is refused
(:class:`~lightning_memopt.analysis.ranks.RankSources`): two jobs that share a run id, or a log passed twice.

The parts live beside this module: :mod:`~lightning_memopt.analysis.records` reads and checks the lines,
:mod:`~lightning_memopt.analysis.summary` summarises per (run, rank, phase) with the growth fit of
:mod:`~lightning_memopt.analysis.growth`, :mod:`~lightning_memopt.analysis.text` formats the table and
:mod:`~lightning_memopt.analysis.plot` draws the timeline. The names this module has always offered
(:func:`load_memory_log`, :func:`summarize_memory_log`, :func:`format_summary`, :func:`plot_memory_timeline`,
...) are re-exported here.
"""

from __future__ import annotations

import glob
import os
import re
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lightning_memopt.analysis.findings import MemoryFinding
from lightning_memopt.analysis.plot import check_plot_path, draw, plot_memory_timeline
from lightning_memopt.analysis.ranks import RankSources
from lightning_memopt.analysis.records import MemoryLogError, check_log_path, iter_memory_lines, load_memory_log
from lightning_memopt.analysis.summary import LogSummarizer, PhaseSummary, listed, summarize_memory_log
from lightning_memopt.analysis.text import format_summary
from lightning_memopt.utilities.checks import check_path
from lightning_memopt.utilities.formatting import printable

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

#: Skipped lines named per file, and distinct problems described; the rest are counted.
_LISTED_LINES = 10
_LISTED_REASONS = 3


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
        listed_reasons = list(self.reasons.items())[:_LISTED_REASONS]
        text = "; ".join(f"line {number} {problem}" for problem, number in listed_reasons)
        return text + ("; ..." if len(self.reasons) > _LISTED_REASONS else "")

    def warning(self) -> str | None:
        if not self.skipped:
            return None
        if not self.usable:
            return f"{self.path}: holds no usable memory records ({self.why()}); left it out"
        lines = ("line " if self.skipped == 1 else "lines ") + listed(self.lines, self.skipped)
        return f"{self.path}: skipped {self.skipped} of {self.skipped + self.usable} records ({lines}): {self.why()}"

    def error(self) -> str:
        if not self.skipped:
            return f"{self.path}: holds no memory records"
        return f"{self.path}: holds no usable memory records ({self.why()}); is this a memory JSONL log?"


def _read_into(path: Path, summarizer: LogSummarizer, sources: RankSources) -> _FileReport:
    report = _FileReport(path)
    for line in iter_memory_lines(path):
        if line.record is None:
            report.skip(line.number, line.problem or "is not a memory record")
        else:
            summarizer.add(line.record)
            sources.add(line.record, str(path))
            report.usable += 1
    return report


#: The per-rank logs in a directory, and the rank in a log's name (to list them by rank).
_LOG_PATTERN = "memory_rank*.jsonl"
_RANK_IN_NAME = re.compile(r"memory_rank(\d+)\.jsonl$")


def _by_rank(path: Path) -> tuple[int, str]:
    found = _RANK_IN_NAME.search(path.name)
    if not found:
        return (-1, path.name)
    return (int(found.group(1)), path.name)


def _directory_logs(given: Path) -> list[Path]:
    """A directory's ``memory_rank*.jsonl``, by rank; any other path as it is (checked when read)."""
    if not given.is_dir():
        return [given]
    found = sorted(given.glob(_LOG_PATTERN), key=_by_rank)
    if not found:
        raise MemoryLogError(
            f"{given}: no {_LOG_PATTERN} in this directory; pass the directory MemoryMonitor wrote to"
            " (`dirpath`, by default <log_dir>/memopt) or the files themselves"
        )
    return found


def _expand(given: Path) -> list[Path]:
    """A glob pattern that names no file stands for its matches, a directory for its logs (by rank)."""
    text = os.fspath(given)
    if not glob.has_magic(text) or given.exists():
        return _directory_logs(given)
    matches = sorted(glob.glob(text))
    if not matches:
        raise MemoryLogError(f"{text}: matches no file")
    return [file for match in matches for file in _directory_logs(Path(match))]


def _identity(file: Path) -> tuple[int, int] | str:
    """What makes two names one file: its device and inode (links, other paths), else its real path."""
    try:
        st = file.stat()
    except OSError:  # missing or unreadable: refused by name when it is checked
        return os.path.realpath(file)
    return (st.st_dev, st.st_ino)


def _log_files(paths: Sequence[Path]) -> list[Path]:
    """The files to read: directories and glob patterns expanded (:func:`_expand`), each file once (one file named
    twice, through another path or a link, is read once, where it first appears).

    Raises:
        MemoryLogError: a directory without logs, or a pattern that matches nothing.
    """
    files: list[Path] = []
    seen: set[tuple[int, int] | str] = set()
    for given in paths:
        for file in _expand(given):
            identity = _identity(file)
            if identity not in seen:
                seen.add(identity)
                files.append(file)
    return files


def _labels(paths: Sequence[Path]) -> list[str]:
    """The plot's title names each log by its file name, by its path where two share a name."""
    names = [p.name for p in paths]
    return [p.name if names.count(p.name) == 1 else str(p) for p in paths]


def _checked_files(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The log files ``paths`` name (expanded by :func:`_log_files`), each checked to be a regular file."""
    if isinstance(paths, (str, os.PathLike)) or not isinstance(paths, Iterable):
        example = "memory_rank0.jsonl"
        if isinstance(paths, (str, os.PathLike)):
            example = os.fspath(paths)
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
    files = _log_files([Path(p) for p in paths])
    for file in files:
        check_log_path(file)
    return files


def analyze_memory_logs(
    paths: Sequence[str | os.PathLike[str]], plot: str | os.PathLike[str] | None = None
) -> tuple[list[PhaseSummary], str]:
    """Read logs, summarise them and optionally plot them: what ``lightning-memopt analyze`` does.

    The files are streamed (memory stays a fraction of their size). A directory stands for the
    ``memory_rank*.jsonl`` files in it (by rank) and a glob pattern (``"node*/memopt/memory_rank*.jsonl"``, quoted
    from the shell) for the files it matches, so the logs of several nodes are read together with one path per
    node; a file named twice is read once. Paths and the plot's path are checked before any file is read. Records
    that cannot be used are skipped with one ``UserWarning`` per file naming the lines; a file with nothing usable
    is left out with a warning.

    Returns:
        The summaries and the text table (with the plot's path appended when one was written).

    Raises:
        MemoryLogError: ``paths`` is empty, a file is missing or not a regular file, a directory holds no log, a
            pattern matches nothing, no file holds a usable record, or one run's global rank is in two logs (or
            from two hosts) over the same time.
        ValueError: ``paths`` is not a list of paths, or ``plot`` has an extension matplotlib cannot write, or its
            directory cannot be created.
        ImportError: ``plot`` is given and matplotlib is not installed.
    """
    files = _checked_files(paths)
    target: tuple[Path, str] | None = None
    if plot is not None:
        target = check_plot_path(plot)
    summarizer = LogSummarizer(plot=target is not None)
    sources = RankSources()
    reports = [_read_into(file, summarizer, sources) for file in files]
    if not summarizer.num_records:
        if len(reports) == 1:
            raise MemoryLogError(reports[0].error())
        raise MemoryLogError("no usable memory records: " + "; ".join(r.error() for r in reports))
    clash = sources.error()
    if clash is not None:
        raise MemoryLogError(clash)
    for report in reports:
        message = report.warning()
        if message:
            warnings.warn(printable(message, keep_newlines=True), stacklevel=2)
    summaries = summarizer.summaries()
    text = format_summary(summaries)
    if target is not None:
        used = [r.path for r in reports if r.usable]
        written = draw(summarizer, _labels(used), *target)
        text += f"\nplot: {written}"
    return summaries, text
