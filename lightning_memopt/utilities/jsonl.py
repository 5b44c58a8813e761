"""The per-rank JSON Lines memory log: the one place that opens, appends to and reads back ``memory_rank{r}.jsonl``.

* :class:`JsonlWriter` appends records and never raises into training. Every writer of one path (``MemoryMonitor``
  and ``MemoryAudit`` of a run write the same file) shares one open file, reference counted: the file is opened by
  the first writer that writes and closed when the last one closes.
* :func:`rank_log_writer` resolves a callback's writer in ``setup``.

The records themselves are described in ``docs/memory-log.md``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_memopt.utilities.checks import check_writable_dir
from lightning_memopt.utilities.files import (
    check_regular_file,
    hard_link_message,
    is_runtime_failure,
    symlink_message,
)
from lightning_memopt.utilities.trainer import default_artifact_dir
from lightning_memopt.utilities.warnings import WarnOnce

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["JsonlWriter", "rank_log_writer"]

#: Opening a path that is a symbolic link with ``O_NOFOLLOW`` fails (where the system has the flag).
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_LINK_ERRNOS = frozenset({errno.ELOOP, errno.EMLINK})


class _SharedFile:
    """One open descriptor of one JSONL path, shared by every :class:`JsonlWriter` of that path."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.users = 0
        self.fd: int | None = None
        self.identity: tuple[int, int] | None = None

    def open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            check_regular_file("dirpath", self.path)
        except OSError as err:
            if err.errno is None:  # our own refusal (a link, a pipe, a hard link): its message says the fix
                raise _Refused(str(err)) from None
            raise
        try:
            # O_NOFOLLOW: a link planted at the path since the check is refused, never followed to its target.
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o644)
        except OSError as err:
            if err.errno in _LINK_ERRNOS and os.path.islink(self.path):
                raise _Refused(symlink_message("dirpath", self.path)) from err
            raise
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                what = f"{str(self.path)!r} is not a regular file"
                raise _Refused(f"`dirpath`: {what}. Remove it or pass another `dirpath`.")
            if info.st_nlink > 1:
                raise _Refused(hard_link_message("dirpath", self.path, info.st_nlink))
            if info.st_size > 0 and os.pread(fd, 1, info.st_size - 1) != b"\n":
                os.write(fd, b"\n")  # a torn last line from a killed run: start on a fresh line
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.identity = (info.st_dev, info.st_ino)

    def at_path(self) -> bool:
        """Whether the open file is still the one at :attr:`path`."""
        with contextlib.suppress(OSError):
            info = os.stat(self.path)
            return (info.st_dev, info.st_ino) == self.identity
        return False

    def close(self) -> None:
        fd, self.fd, self.identity = self.fd, None, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


#: The open JSONL files, by absolute path: one descriptor per file, whoever writes to it.
_OPEN: dict[Path, _SharedFile] = {}


def _acquire(path: Path) -> _SharedFile:
    """The shared open file of ``path``, opened now if no writer has it open (raises ``OSError`` if it cannot be)."""
    key = Path(os.path.abspath(path))
    shared = _OPEN.get(key)
    if shared is None or not shared.at_path():  # a file replaced since: its writers stop, a new one opens afresh
        shared = _SharedFile(path)
        shared.open()
        _OPEN[key] = shared
    shared.users += 1
    return shared


def _release(shared: _SharedFile) -> None:
    shared.users -= 1
    if shared.users > 0:
        return
    key = Path(os.path.abspath(shared.path))
    if _OPEN.get(key) is shared:
        del _OPEN[key]
    shared.close()


class JsonlWriter:
    """Appends one JSON object per line to ``path``; each line reaches the file before ``write`` returns.

    * The file is opened lazily in append mode, so a resumed run adds to what is already there. A run killed
      mid-write can leave a torn last line: the next writer starts on a fresh line, so its first record is
      never glued to the torn one.
    * Writers of the same path share one open file (reference counted), so two callbacks of a run append their
      lines, each whole, to one descriptor; each writer keeps its own ``owner``, warnings and stopped state.
    * ``write`` never raises. When the file cannot be written (a full disk, the directory removed or replaced
      by a file mid-run), it warns once that records from that step on are not stored, and drops later records;
      a record that cannot be serialised is skipped with one warning.
    * The path is never written through a symbolic link, nor appended to when it has other hard links (the link
      could point at any file outside the folder): ``rank_log_writer`` refuses such a path in ``setup``, and one
      planted later is refused when the file is opened (``O_NOFOLLOW``), with the one warning above, naming the
      path and the fix. The directory itself may be a link: it is the user's choice.
    * ``close`` never raises, so it is safe in ``on_exception``.
    * Not picklable state (the open file) is dropped on pickling.

    Args:
        path: The JSONL file.
        owner: Who writes, for the warnings (a callback's name).

    Examples:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "log.jsonl")
        >>> w = JsonlWriter(path); w.write({"a": 1}); w.close()
        True
        >>> open(path).read()
        '{"a": 1}\\n'
    """

    def __init__(self, path: str | os.PathLike[str], owner: str = "lightning-memopt") -> None:
        self.path = Path(path)
        self.owner = owner
        self._file: _SharedFile | None = None
        self.stopped_at: Any = None
        self._stopped = False
        self._warn = WarnOnce()

    @property
    def stopped(self) -> bool:
        """Whether writing stopped for good after a failure (see the warning for the step)."""
        return self._stopped

    def write(self, record: dict[str, Any]) -> bool:
        """Append ``record`` as one line. Returns whether it was stored."""
        if self._stopped:
            return False
        try:
            line = (_ENCODER.encode(record) + "\n").encode("utf-8")
        except (TypeError, ValueError) as err:
            self._warn.warn(
                "serialise", f"{self.owner}: a record could not be written as JSON ({err}); it was skipped."
            )
            return False
        view = memoryview(line)
        try:
            if self._file is None:
                self._file = _acquire(self.path)
            else:
                self._check_same_file()
            fd = self._file.fd
            if fd is None:
                raise _Replaced(f"{self.path} was closed")
            while view:
                view = view[os.write(fd, view) :]
            return True
        except Exception as err:  # the documented contract: a write never raises into training
            self._drop_partial_line(len(line) - len(view))
            self._stop(record, err)
            return False

    def close(self) -> None:
        """Let go of the file (closed once no writer of the path holds it); never raises."""
        shared, self._file = self._file, None
        if shared is not None:
            _release(shared)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_file=None)
        return state

    # ---------------------------------------------------------------- internals
    def _drop_partial_line(self, written: int) -> None:
        """After a failed write, cut off the part of the line that did reach the file: it ends on a whole line."""
        fd = None if self._file is None else self._file.fd
        if written <= 0 or fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(fd, max(os.fstat(fd).st_size - written, 0))

    def _check_same_file(self) -> None:
        """Refuse to write on into a file that is no longer at ``path`` (deleted, or its directory replaced)."""
        try:
            info = os.stat(self.path)
        except OSError as err:
            raise _Replaced(f"{self.path} no longer exists ({err.strerror or err})") from err
        if self._file is None or (info.st_dev, info.st_ino) != self._file.identity:
            raise _Replaced(f"{self.path} was replaced by another file")

    def _stop(self, record: dict[str, Any], err: Exception) -> None:
        self._stopped = True
        self.close()
        step = record.get("global_step")
        phase = record.get("phase")
        where = f"{phase} step {step}" if step is not None else "this point"
        if isinstance(err, _Replaced):
            reason = f"{err} while the run was writing it"
        elif isinstance(err, _Refused):
            reason = str(err).rstrip(".")
        elif is_runtime_failure(err):
            reason = f"the file system refused the write ({err})"
        else:
            reason = f"writing failed ({err!r})"
        self.stopped_at = step
        self._warn.warn(
            "stopped",
            f"{self.owner}: records from {where} on are not stored: {reason}. Training goes on; the records"
            f" written before are in {self.path}.",
        )


class _Replaced(OSError):
    """The file being appended to is no longer the one at the path."""


class _Refused(OSError):
    """The path is not a file of its own (a symbolic link, another file's hard link): its message says the fix."""


def _default(obj: Any) -> Any:
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


#: One encoder for every record (``json.dumps`` with arguments builds a new one per call).
_ENCODER = json.JSONEncoder(allow_nan=False, default=_default)


def rank_log_writer(
    trainer: pl.Trainer,
    dirpath: str | os.PathLike[str] | None,
    rank: int,
    current: JsonlWriter | None,
    owner: str,
) -> JsonlWriter:
    """The writer of ``<dirpath>/memory_rank{rank}.jsonl``, resolved in ``setup`` where every rank is present.

    A bad ``dirpath`` (a file, under a file, not writable, a log path that is a pipe, a directory, a symbolic link
    or another file's hard link) raises ``OSError`` naming it; a full disk only warns later, at the first record
    that cannot be stored.
    ``current`` is kept when it already writes that file, so fitting twice appends to one open file.
    """
    if dirpath is None:
        dirpath = default_artifact_dir(trainer)
    directory = Path(dirpath)
    try:
        directory = check_writable_dir("dirpath", directory)
    except OSError as err:
        if not is_runtime_failure(err.__cause__ or err):
            raise
    path = directory / f"memory_rank{rank}.jsonl"
    check_regular_file("dirpath", path)
    if current is not None and current.path == path and not current.stopped:
        return current
    if current is not None:
        current.close()
    return JsonlWriter(path, owner=owner)
