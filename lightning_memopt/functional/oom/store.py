"""Where reports are kept: a name of its own for every report, and the documented names pointing at the newest.

Any number of writers (the ranks of a job, two jobs sharing a ``dirpath``, threads) may write into one directory at
the same instant, and nothing is ever overwritten:

1. :func:`reserve_report` claims a name unique to this report, ``oom_report_rank0-20250101T120000.123456Z-4242-0``
   (the failure's UTC time, the process id and a counter), by creating a hidden claim file with ``O_EXCL`` that
   names its owner (host and process id); the report's ``.json``, ``.md`` and ``oom_snapshot_rank0-...pickle`` are
   written under that name only, and the claim is removed when they are. A writer killed meanwhile leaves its claim:
   the next reservation in the directory removes it (:func:`clear_stale_claims`).
2. :func:`publish_newest` then points the documented names (``oom_report_rank{r}.json``, ``.md``,
   ``oom_snapshot_rank{r}.pickle``) at the newest kept report of the rank, by failure time: a hard link made under a
   temporary name and renamed over the documented one (``os.replace``), so a reader sees the old report or the new
   one, never half of one. Where the filesystem has no hard links, a complete copy is renamed in instead. Each writer
   checks after its rename that nothing newer appeared meanwhile and links again if it did.
3. A documented file that is no link to a kept report (written by an older version, or edited by hand) is first
   kept under a name of its own, with its ``when.time`` as stamp.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import filecmp
import itertools
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lightning_memopt.functional.oom.files import report_json, report_paths
from lightning_memopt.utilities.files import write_text_atomic
from lightning_memopt.utilities.json_capped import JSONLimits, load_json_capped
from lightning_memopt.utilities.trainer import host_name

__all__ = [
    "STALE_CLAIM_S",
    "ReportSlot",
    "clear_stale_claims",
    "kept_reports",
    "newest_reports",
    "publish_newest",
    "reserve_report",
    "save_report",
]

#: Names of kept reports: ``oom_report_rank{r}-{stamp}Z[-anything].json``, the stamp in UTC with optional microseconds.
_KEPT = re.compile(r"^oom_report_rank(\d+)-(\d{8}T\d{6})(?:\.(\d{1,6}))?Z(?:-[0-9A-Za-z_.-]*)?\.json$")
_DOCUMENTED = re.compile(r"^oom_report_rank(\d+)\.json$")
_COUNTER = itertools.count()  # next() is atomic: threads of one process never share a name
_CLAIM = re.compile(r"^\.(oom_report_rank\d+-.+)\.claim$")
#: A claim older than this is taken for one whose writer died, on whatever machine shares the directory.
STALE_CLAIM_S = 3600.0
#: An empty claim older than this: its writer died between creating it and writing its owner into it.
_EMPTY_CLAIM_S = 60.0
_NO_LINKS = (errno.EPERM, errno.EXDEV, errno.ENOSYS, errno.EMLINK, getattr(errno, "ENOTSUP", errno.EPERM))


def _stamp(when_time: float) -> str:
    moment = datetime.datetime.fromtimestamp(when_time, tz=datetime.timezone.utc)
    return moment.strftime("%Y%m%dT%H%M%S") + f".{moment.microsecond:06d}Z"


class ReportSlot:
    """The files of one report under a name nobody else uses (:func:`reserve_report`); :meth:`release` when done.

    Attributes:
        paths: ``json``, ``md`` and ``pickle``, each under this report's own name.
    """

    def __init__(self, paths: dict[str, Path], claim: Path | None) -> None:
        self.paths = paths
        self._claim = claim

    def release(self) -> None:
        """Remove the claim file (the report's own files stay)."""
        if self._claim is not None:
            with contextlib.suppress(OSError):
                self._claim.unlink()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (one of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # not ours to signal (EPERM), or not to be told: alive
        return True
    return True


def _claim_is_stale(path: Path, stem: str, now: float) -> bool:
    """Whether the claim ``path`` (of the report named ``stem``) is left by a writer that is gone or done: its report
    exists, its owner is a process of this host that ended, it is empty past a minute, or older than an hour."""
    if (path.parent / f"{stem}.json").exists():
        return True
    age = now - path.stat().st_mtime
    if age > STALE_CLAIM_S:
        return True
    owner = path.read_text(encoding="utf-8", errors="replace").splitlines()
    if len(owner) != 2 or not owner[1].isdigit():
        return age > _EMPTY_CLAIM_S
    return owner[0] == host_name() and not _alive(int(owner[1]))


def clear_stale_claims(dirpath: Path) -> list[Path]:
    """Remove the claim files in ``dirpath`` that writers killed mid-report left (see :func:`_claim_is_stale`);
    the removed paths. A claim of a writer still at work is kept; what cannot be read or removed is left."""
    removed: list[Path] = []
    now = time.time()
    try:
        with os.scandir(dirpath) as entries:
            names = [entry.name for entry in entries]
    except OSError:
        return removed
    for name in names:
        match = _CLAIM.match(name)
        if match is None:
            continue
        path = dirpath / name
        try:
            if _claim_is_stale(path, match.group(1), now):
                path.unlink()
                removed.append(path)
        except OSError:  # removed meanwhile by another writer, or unreadable: left
            continue
    return removed


def _claim(claim: Path) -> None:
    """Create ``claim`` with ``O_EXCL`` (``FileExistsError`` when taken) and write its owner into it."""
    fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, f"{host_name()}\n{os.getpid()}\n".encode("utf-8", errors="replace"))
    except OSError:  # a full disk: the empty claim still claims; after a minute it counts as left behind
        pass
    finally:
        os.close(fd)


def reserve_report(dirpath: Path, rank: int, when_time: float) -> ReportSlot:
    """Claim a name for a report of rank ``rank`` that failed at ``when_time`` (seconds since the epoch).

    The name is the UTC time to the microsecond, the process id and a per-process counter; a hidden claim file
    created with ``O_EXCL`` makes it this writer's even across machines sharing the directory (a taken name moves
    on to the next counter). Claims that killed writers left in ``dirpath`` are removed first
    (:func:`clear_stale_claims`).

    Examples:
        >>> import tempfile
        >>> slot = reserve_report(Path(tempfile.mkdtemp()), 0, 1735732800.5)
        >>> slot.paths["json"].name.startswith("oom_report_rank0-20250101T120000.500000Z-")
        True
        >>> slot.release()
    """
    clear_stale_claims(dirpath)
    stamp = _stamp(when_time)
    while True:
        suffix = f"-{stamp}-{os.getpid()}-{next(_COUNTER)}"
        paths = report_paths(dirpath, rank, suffix)
        claim = dirpath / f".{paths['json'].stem}.claim"
        try:
            _claim(claim)
        except FileExistsError:
            continue
        except OSError:  # no claim possible (a full disk): time, pid and counter alone; writing reports the failure
            return ReportSlot(paths, None)
        if any(p.exists() for p in paths.values()):  # a report kept under this name without a claim: skip it
            with contextlib.suppress(OSError):
                claim.unlink()
            continue
        return ReportSlot(paths, claim)


def _name_time(path: Path) -> float | None:
    match = _KEPT.match(path.name)
    if match is None:
        return None
    moment = datetime.datetime.strptime(match.group(2), "%Y%m%dT%H%M%S").replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp() + int((match.group(3) or "0").ljust(6, "0")) / 1e6


def kept_reports(dirpath: Path, rank: int | None = None) -> list[tuple[float, Path]]:
    """The reports kept under their own names in ``dirpath`` (of ``rank``, or every rank), oldest first.

    Each as ``(failure time from the name, path)``; ties are ordered by name.
    """
    found = []
    with os.scandir(dirpath) as entries:
        for entry in entries:
            match = _KEPT.match(entry.name)
            if match is None or (rank is not None and int(match.group(1)) != rank):
                continue
            moment = _name_time(Path(entry.name))
            if moment is not None:
                found.append((moment, dirpath / entry.name))
    return sorted(found)


def newest_reports(dirpath: Path) -> list[Path]:
    """The newest report of each rank in ``dirpath``, by rank: what ``lightning-memopt report DIR`` prints.

    A kept report is dated by its name; a documented ``oom_report_rank{r}.json`` that is no link to a kept one
    (an older version's report) by its modification time.
    """
    best: dict[int, tuple[float, str, Path]] = {}
    kept = kept_reports(dirpath)
    for moment, path in kept:
        rank = int(_KEPT.match(path.name).group(1))  # type: ignore[union-attr]
        best[rank] = max(best.get(rank, (moment, "", path)), (moment, path.name, path))
    with os.scandir(dirpath) as entries:
        documented = [(int(m.group(1)), dirpath / e.name) for e in entries if (m := _DOCUMENTED.match(e.name))]
    for rank, path in documented:
        if rank in best and _same_file(path, best[rank][2]):
            continue
        with contextlib.suppress(OSError):
            candidate = (path.stat().st_mtime, path.name, path)
            best[rank] = max(best.get(rank, candidate), candidate)
    return [best[rank][2] for rank in sorted(best)]


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _is_kept(documented: Path, rank: int) -> bool:
    """Whether ``documented`` is a link to (or, without hard links, a copy of) a report kept under its own name."""
    info = documented.stat()
    if info.st_nlink > 1:
        return True
    for _, path in reversed(kept_reports(documented.parent, rank)):
        with contextlib.suppress(OSError):
            if path.stat().st_size == info.st_size and filecmp.cmp(path, documented, shallow=False):
                return True
    return False


def _earlier_time(path: Path) -> float:
    """An earlier report's own time if it can be read, else the file's modification time."""
    try:
        with open(path, encoding="utf-8") as f:  # streamed, nearly nothing kept: any size, during an OOM
            return float(load_json_capped(f, JSONLimits(max_items=50, max_chars=100, max_depth=3))["when"]["time"])
    except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError):  # not a report: file time
        return path.stat().st_mtime


def _link_or_copy(source: Path, target: Path) -> None:
    """Make ``target`` a new name of ``source`` (a copy where hard links are refused); fails if ``target`` exists."""
    try:
        os.link(source, target)
    except OSError as err:
        if err.errno not in _NO_LINKS:
            raise
        with open(source, "rb") as src, open(target, "xb") as dst:
            shutil.copyfileobj(src, dst)


def _keep_unlinked(dirpath: Path, rank: int) -> None:
    """Keep a documented report that is no link to a kept one under a name of its own (never lose it)."""
    documented = report_paths(dirpath, rank)
    try:
        if _is_kept(documented["json"], rank):
            return
        moment = _earlier_time(documented["json"])
    except FileNotFoundError:
        return
    slot = reserve_report(dirpath, rank, moment)
    try:
        for key, path in documented.items():
            with contextlib.suppress(FileNotFoundError):
                if key == "json" or path.stat().st_nlink == 1:
                    _link_or_copy(path, slot.paths[key])
    finally:
        slot.release()


def _point(documented: Path, source: Path) -> None:
    """Replace ``documented`` by a name of ``source`` in one rename; remove it if ``source`` does not exist."""
    tmp = documented.with_name(f".{documented.name}.{os.getpid()}-{next(_COUNTER)}.tmp")
    try:
        _link_or_copy(source, tmp)
    except FileNotFoundError:  # the newest report has no such file (no snapshot): drop a stale link to an older one
        with contextlib.suppress(OSError):
            if documented.stat().st_nlink > 1:
                documented.unlink()
        return
    try:
        os.replace(tmp, documented)
    finally:  # rename(2) does nothing when both names are links to one file already: the temporary name stays
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def publish_newest(dirpath: Path, rank: int, tries: int = 10) -> Path | None:
    """Point rank ``rank``'s documented names at its newest kept report; returns that report's JSON path.

    A documented report that is not kept elsewhere is kept first. After its renames a writer looks again and
    links again while a newer report appeared meanwhile (at most ``tries`` times), so the last writer to finish
    leaves the documented names on the newest report.
    """
    _keep_unlinked(dirpath, rank)
    documented = report_paths(dirpath, rank)
    newest: Path | None = None
    for _ in range(tries):
        kept = kept_reports(dirpath, rank)
        if not kept:
            return None
        if newest == kept[-1][1] and _same_file(documented["json"], newest):
            break
        newest = kept[-1][1]
        suffix = newest.name[len(documented["json"].stem) : -len(".json")]
        for key, source in report_paths(dirpath, rank, suffix).items():
            _point(documented[key], source)
    return newest


def save_report(slot: ReportSlot, report: Mapping[str, Any], markdown: Callable[[Any], str]) -> list[str]:
    """Write ``report`` (JSON) and ``markdown(report)`` under ``slot``'s names, then :func:`publish_newest`.

    Returns what could not be written (``"<path>: <error>"``), empty on success; storage failures and values JSON
    refuses are returned, not raised.
    """
    failed: list[str] = []
    for key, text in (("json", lambda: report_json(report)), ("md", lambda: markdown(report))):
        try:
            write_text_atomic(slot.paths[key], text())
        except (OSError, ValueError, TypeError, RecursionError) as err:  # a full disk, a value JSON refuses
            failed.append(f"{slot.paths[key]}: {err!r}")
    if not failed:
        dirpath = slot.paths["json"].parent
        rank = int(_KEPT.match(slot.paths["json"].name).group(1))  # type: ignore[union-attr]
        try:
            publish_newest(dirpath, rank)
        except OSError as err:  # the report is kept under its own name: only the documented names lag
            failed.append(f"{report_paths(dirpath, rank)['json']}: {err!r}")
    return failed
