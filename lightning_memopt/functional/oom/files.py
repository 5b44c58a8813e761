"""The report's files: their names, the JSON text, moving an earlier report aside, reading a report back."""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_memopt.functional.oom.schema import OOMReport
from lightning_memopt.functional.oom.sections import json_default
from lightning_memopt.utilities.files import digit_limit_problem, line_with_long_integer, regular_file_problem

__all__ = ["load_report", "move_aside", "report_json", "report_paths"]


def report_paths(dirpath: Path, rank: int) -> dict[str, Path]:
    """The files of rank ``rank``'s report: ``json``, ``md`` and the allocator snapshot (``pickle``).

    Example:
        >>> sorted(p.name for p in report_paths(Path("oom"), 1).values())
        ['oom_report_rank1.json', 'oom_report_rank1.md', 'oom_snapshot_rank1.pickle']
    """
    return {
        "json": dirpath / f"oom_report_rank{rank}.json",
        "md": dirpath / f"oom_report_rank{rank}.md",
        "pickle": dirpath / f"oom_snapshot_rank{rank}.pickle",
    }


def report_json(report: OOMReport | Mapping[str, Any]) -> str:
    """The text of ``oom_report_rank{r}.json``: indented JSON, values JSON cannot hold as their ``str``."""
    return json.dumps(report, indent=2, default=json_default) + "\n"


def _earlier_time(anchor: Path) -> float:
    """The earlier report's own time if it can be read, else the file's modification time."""
    try:
        return float(json.loads(anchor.read_text(encoding="utf-8"))["when"]["time"])
    except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError):  # not a report: file time
        return anchor.stat().st_mtime


def move_aside(paths: Mapping[str, Path]) -> None:
    """Rename an earlier report's files with its UTC time as suffix, so a new report never destroys it.

    ``oom_report_rank0.json`` becomes ``oom_report_rank0-20250101T120000Z.json`` (``-1``, ``-2``, ... appended
    while that name is taken); the files of one report keep one suffix.
    """
    existing = [p for p in paths.values() if p.exists()]
    if not existing:
        return
    anchor = paths["json"] if paths["json"].exists() else existing[0]
    stamp_time = _earlier_time(anchor)
    stamp = datetime.datetime.fromtimestamp(stamp_time, tz=datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    for attempt in range(1000):
        suffix = stamp if attempt == 0 else f"{stamp}-{attempt}"
        targets = {p: p.with_name(f"{p.stem}-{suffix}{p.suffix}") for p in existing}
        if not any(t.exists() for t in targets.values()):
            break
    for source, target in targets.items():
        os.replace(source, target)


def load_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read an ``oom_report_rank{r}.json`` file written by ``OOMReporter``.

    Raises:
        ValueError: naming the file and what is wrong with it (missing, not JSON, not an OOM report).

    Example:
        >>> load_report("missing.json")
        Traceback (most recent call last):
        ...
        ValueError: missing.json: no such file. Pass the oom_report_rank{r}.json written by OOMReporter.
    """
    hint = "Pass the oom_report_rank{r}.json written by OOMReporter."
    name = os.fspath(path)
    problem = regular_file_problem(name)  # a named pipe or a device is refused without opening it
    if problem is not None:
        raise ValueError(f"{name}: {problem}. {hint}")
    try:
        with open(name, encoding="utf-8") as f:
            report = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{name}: no such file. {hint}") from None
    except IsADirectoryError:
        raise ValueError(f"{name}: is a directory. {hint}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{name}: cannot be read ({err}). {hint}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{name}: not valid JSON ({err.msg} at line {err.lineno}). {hint}") from None
    except RecursionError:
        raise ValueError(f"{name}: not valid JSON (nested too deeply to read). {hint}") from None
    except ValueError as err:  # Python's refusal of a too long integer names no file: this says which, and where
        too_long = digit_limit_problem(err)
        if too_long is None:
            raise ValueError(f"{name}: cannot be read ({err}). {hint}") from None
        line = line_with_long_integer(name)
        where = f" at line {line}" if line is not None else ""
        raise ValueError(f"{name}: not an out-of-memory report: it {too_long}{where}. {hint}") from None
    if not isinstance(report, dict) or not str(report.get("format", "")).startswith("lightning-memopt/oom-report/"):
        raise ValueError(f"{name}: not an out-of-memory report (no 'format' field of OOMReporter). {hint}")
    return report
