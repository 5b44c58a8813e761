"""The report's files: their names, the JSON text, reading a report back."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from lightning_memopt.functional.oom.schema import OOMReport
from lightning_memopt.functional.oom.sections import json_default
from lightning_memopt.utilities.files import digit_limit_problem, line_with_long_integer, regular_file_problem
from lightning_memopt.utilities.json_capped import JSONLimits, JSONReadError, load_json_capped

__all__ = ["load_report", "report_json", "report_paths"]


def report_paths(dirpath: Path, rank: int, suffix: str = "") -> dict[str, Path]:
    """The files of a report of rank ``rank``: ``json``, ``md`` and the allocator snapshot (``pickle``).

    Without ``suffix``: the documented names, which point at the rank's newest report; with one, the names a report
    is kept under (``functional.oom.store``).

    Examples:
        >>> sorted(p.name for p in report_paths(Path("oom"), 1).values())
        ['oom_report_rank1.json', 'oom_report_rank1.md', 'oom_snapshot_rank1.pickle']
        >>> report_paths(Path("oom"), 0, "-20250101T120000.000000Z-42-0")["md"].name
        'oom_report_rank0-20250101T120000.000000Z-42-0.md'
    """
    return {
        "json": dirpath / f"oom_report_rank{rank}{suffix}.json",
        "md": dirpath / f"oom_report_rank{rank}{suffix}.md",
        "pickle": dirpath / f"oom_snapshot_rank{rank}{suffix}.pickle",
    }


def report_json(report: OOMReport | Mapping[str, Any]) -> str:
    """The text of ``oom_report_rank{r}.json``: indented JSON, values JSON cannot hold as their ``str``."""
    return json.dumps(report, indent=2, default=json_default) + "\n"


def _read_json(file: IO[str], limits: JSONLimits | None) -> Any:
    """The JSON document in ``file``: read whole without ``limits``, streamed and capped with them."""
    if limits is None:
        return json.load(file)
    return load_json_capped(file, limits)


def load_report(path: str | os.PathLike[str], limits: JSONLimits | None = None) -> dict[str, Any]:
    """Read an ``oom_report_rank{r}.json`` file written by ``OOMReporter``.

    With ``limits`` (for display, as ``lightning-memopt report`` does) the file is streamed and long strings,
    lists and objects are cut with a marker (:func:`~lightning_memopt.utilities.json_capped.load_json_capped`):
    memory and time stay bounded whatever the file's size. Without, every value is read as it is.

    Raises:
        ValueError: naming the file and what is wrong with it (missing, not JSON, not an OOM report).

    Examples:
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
            report = _read_json(f, limits)
    except FileNotFoundError:
        raise ValueError(f"{name}: no such file. {hint}") from None
    except IsADirectoryError:
        raise ValueError(f"{name}: is a directory. {hint}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{name}: cannot be read ({err}). {hint}") from None
    except (json.JSONDecodeError, JSONReadError) as err:
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
