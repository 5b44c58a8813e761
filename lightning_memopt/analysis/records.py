"""The one reader of the memory log (``memory_rank*.jsonl``): lines, checked records, and what is wrong with the rest.

Torch-free and streaming: a log is read one line at a time (at most 1 MiB per line), each line decoded and its
record checked against the format (the format itself is described in ``docs/memory-log.md``).

* :func:`iter_memory_records` yields the usable records and skips the rest silently: for code that only needs
  what the log holds (e.g. the last step recorded before a resume).
* :func:`iter_memory_lines` yields every non-blank line with its record or the reason it has none: for readers
  that report what they skipped (:func:`~lightning_memopt.analysis.analyze_memory_logs`).
* :func:`load_memory_log` reads a whole log into a list and refuses a log with a bad line.

All three refuse a path that is not a regular file (a named pipe would block forever) with
:class:`MemoryLogError`.
"""

from __future__ import annotations

import json
import os
import stat
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

from lightning_memopt.utilities.checks import check_path, is_finite_number
from lightning_memopt.utilities.files import digit_limit_problem, regular_file_problem

__all__ = [
    "MemoryLogError",
    "MemoryLogLine",
    "check_log_path",
    "iter_memory_lines",
    "iter_memory_records",
    "load_memory_log",
    "record_problem",
]

#: Keys every record has.
REQUIRED_KEYS = ("time", "rank", "phase", "event")
#: Where the peak allocated figure of a reading can be (the first record that shows the highest one wins).
ALLOC_KEYS = ("phase_peak_allocated_bytes", "peak_allocated_bytes", "allocated_bytes")
RESERVED_KEYS = ("peak_reserved_bytes", "reserved_bytes", "phase_peak_reserved_bytes")
#: Every byte figure the summary or the plot reads: null, or a finite number >= 0.
BYTE_KEYS = (*ALLOC_KEYS, *RESERVED_KEYS, "host_rss_bytes", "device_total_bytes")
OPTIONAL_INT_KEYS = ("epoch", "global_step", "batch_idx")
OPTIONAL_STR_KEYS = ("device", "run_id", "host")
#: Where the rank ran: the node's rank (with ``host``; optional: logs of 0.1.0 have neither).
NODE_KEYS = ("node_rank",)
#: Events that carry a memory reading.
READING_EVENTS = frozenset({"step", "phase_start", "phase_end"})
#: AutoMicroBatch's record of a micro-batch change.
MICRO_BATCH_EVENT = "micro_batch"
MAX_LINE_BYTES = 1 << 20


class MemoryLogError(ValueError):
    """A memory log that cannot be read: missing, unreadable or not a JSONL memory log."""


class MemoryLogLine(NamedTuple):
    """One non-blank line of a log: its 1-based ``number``, and its checked ``record`` or the ``problem`` (a short
    phrase such as ``is not JSON``) why it has none; ``truncated`` marks a line cut off mid-write."""

    number: int
    record: dict[str, Any] | None
    problem: str | None = None
    truncated: bool = False


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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_rank(value: Any) -> bool:
    return _is_int(value) and value >= 0


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_int64(value: Any) -> bool:
    return _is_int(value) and abs(value) < 2**63


def _is_byte_count(value: Any) -> bool:
    return is_finite_number(value) and value >= 0


#: ``(keys, check, what a value must be)``, in the order a record is checked: required keys first (checked whatever
#: their value), then optional ones (checked unless null).
_FieldRule = tuple[tuple[str, ...], Callable[[Any], bool], str]
_REQUIRED_FIELDS: tuple[_FieldRule, ...] = (
    (("time",), is_finite_number, "a number of seconds"),
    (("rank",), _is_rank, "an int >= 0"),
    (("phase", "event"), _is_str, "a string"),
)
_OPTIONAL_FIELDS: tuple[_FieldRule, ...] = (
    (OPTIONAL_STR_KEYS, _is_str, "a string"),
    (NODE_KEYS, _is_rank, "an int >= 0"),
    (OPTIONAL_INT_KEYS, _is_int64, "an int"),
    (BYTE_KEYS, _is_byte_count, "a number of bytes"),
)


def record_problem(record: Any) -> str | None:
    """Why ``record`` cannot be used (one short phrase), or ``None`` when it can.

    Examples:
        >>> record_problem({"time": 1.0, "rank": 0, "phase": "train", "event": "step"}) is None
        True
        >>> record_problem({"time": 1.0, "rank": -1, "phase": "train", "event": "step"})
        '`rank` is -1, not an int >= 0'
    """
    if not isinstance(record, Mapping):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(record), "a number")
        return f"is not a memory record (a JSON value that is {kind}, not an object)"
    if any(key not in record for key in REQUIRED_KEYS):
        return f"is not a memory record (needs keys {', '.join(REQUIRED_KEYS)})"
    for keys, check, expected in _REQUIRED_FIELDS:
        for key in keys:
            if not check(record[key]):
                return f"`{key}` is {_show(record[key])}, not {expected}"
    for keys, check, expected in _OPTIONAL_FIELDS:
        for key in keys:
            value = record.get(key)
            if value is not None and not check(value):
                return f"`{key}` is {_show(value)}, not {expected}"
    return None


def check_log_path(path: Path) -> None:
    """Refuse what is not a regular file before opening it: a named pipe would block forever.

    Raises:
        MemoryLogError: ``path`` is missing, a directory, a pipe or device, or cannot be read.
    """
    problem = regular_file_problem(path)
    if problem == "is a directory":
        raise MemoryLogError(f"{path}: is a directory; pass the memory_rank*.jsonl files inside it")
    if problem is not None:
        hint = "; pass a memory_rank*.jsonl file (save a stream to a file first)" if "regular" in problem else ""
        raise MemoryLogError(f"{path}: {problem}{hint}")


def _open_log(path: Path) -> BinaryIO:
    check_log_path(path)
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


def iter_memory_lines(path: str | os.PathLike[str]) -> Iterator[MemoryLogLine]:
    """The non-blank lines of a log, one at a time, each with its checked record or the reason it has none.

    A UTF-8 byte-order mark on the first line is ignored; a line longer than 1 MiB is skipped whole.

    Raises:
        MemoryLogError: (when iteration starts or while reading) the file is missing, not a regular file or
            cannot be read.

    Examples:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "m.jsonl")
        >>> _ = open(p, "w").write('{"time": 1, "rank": 0, "phase": "train", "event": "step"}\\n\\nhello\\n')
        >>> [(line.number, line.problem) for line in iter_memory_lines(p)]
        [(1, None), (3, 'is not JSON')]
    """
    path = Path(path)
    with _open_log(path) as f:

        def read() -> bytes:
            try:
                return f.readline(MAX_LINE_BYTES)
            except OSError as err:
                raise MemoryLogError(f"{path}: cannot be read ({err.strerror or err})") from None

        number = 0
        while raw := read():
            number += 1
            ends = raw.endswith(b"\n")
            if not ends and len(raw) == MAX_LINE_BYTES:
                while raw and not raw.endswith(b"\n"):  # skip the rest of an overlong line
                    raw = read()
                yield MemoryLogLine(number, None, f"is longer than {MAX_LINE_BYTES // 2**20} MiB")
                continue
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark
                raw = raw[3:]
            if not raw.strip():
                continue
            try:
                record = _DECODER.decode(raw.decode("utf-8"))
            except _NonFinite as err:
                yield MemoryLogLine(number, None, f"holds {err}, which is not JSON")
                continue
            except (ValueError, RecursionError) as err:
                too_long = digit_limit_problem(err)  # said as such: Python's own message names no file or line
                truncated = too_long is None and not ends
                reason = too_long or ("is truncated (the run stopped mid-write)" if truncated else "is not JSON")
                yield MemoryLogLine(number, None, reason, truncated)
                continue
            problem = record_problem(record)
            yield MemoryLogLine(number, None if problem else record, problem)


def iter_memory_records(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The usable records of a log, one at a time; lines that are not (torn, not JSON, a field of the wrong
    type) are skipped without a word.

    Raises:
        MemoryLogError: (when iteration starts or while reading) the file is missing, not a regular file or
            cannot be read.

    Examples:
        >>> import tempfile, os
        >>> p = os.path.join(tempfile.mkdtemp(), "m.jsonl")
        >>> _ = open(p, "w").write('{"time": 1, "rank": 0, "phase": "train", "event": "step"}\\n{"time": 2, "ra')
        >>> [r["time"] for r in iter_memory_records(p)]
        [1]
    """
    for line in iter_memory_lines(path):
        if line.record is not None:
            yield line.record


def load_memory_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read one JSONL memory log written by :class:`~lightning_memopt.MemoryMonitor`, all records in memory.

    A truncated last line (a run killed mid-write) is skipped with a warning that names the line. Any
    other line that is not a JSON object with ``time``, ``rank``, ``phase`` and ``event`` of the right types
    makes the file invalid. :func:`~lightning_memopt.analysis.analyze_memory_logs` does not use this: it streams
    the file and skips bad lines instead.

    Raises:
        MemoryLogError: the file is missing, not a regular file, unreadable, empty or not a memory log.
        ValueError: ``path`` is not a path.

    Examples:
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
    for line in iter_memory_lines(path):
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
