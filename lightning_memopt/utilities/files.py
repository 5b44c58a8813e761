"""Files the callbacks write: directories checked in ``setup``, writes that never raise into training.

Two kinds of failure are told apart:

* a **configuration** error (the directory is a file, lies under a file, is not writable, the log path is a named
  pipe, a symbolic link or another file's hard link): raised in ``setup`` with the argument, the value and the fix,
  before any step has run;
* a **runtime** failure (the disk is full, the directory was removed or replaced mid-run): the caller warns once
  and training goes on without that file.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import sys
from pathlib import Path

__all__ = [
    "RUNTIME_ERRNOS",
    "check_dir_creatable",
    "check_regular_file",
    "digit_limit_problem",
    "file_kind",
    "hard_link_message",
    "is_runtime_failure",
    "line_with_long_integer",
    "regular_file_problem",
    "symlink_message",
    "write_text_atomic",
]

#: ``errno`` values that mean "the machine cannot store this now", not "the argument is wrong".
RUNTIME_ERRNOS = frozenset(
    code for code in (errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EIO, errno.EFBIG) if code is not None
)


def is_runtime_failure(err: BaseException) -> bool:
    """Whether ``err`` is a storage failure of the moment (full disk, quota, I/O error) rather than a bad path.

    Examples:
        >>> is_runtime_failure(OSError(errno.ENOSPC, "No space left on device"))
        True
        >>> is_runtime_failure(OSError(errno.ENOTDIR, "Not a directory"))
        False
    """
    return isinstance(err, OSError) and err.errno in RUNTIME_ERRNOS


def _fix(name: str) -> str:
    return f"Pass a `{name}` that is a directory this process can create and write to."


def check_dir_creatable(name: str, path: str | os.PathLike[str]) -> Path:
    """Check that ``path`` is, or can be created as, a writable directory, without creating anything.

    The nearest existing ancestor must be a writable directory and nothing on the way may be a file. Use this
    in ``setup`` for directories that are only written when something happens (an out-of-memory report), so a
    run that never fails leaves no empty directory behind and a bad path is refused before the first step.

    Raises:
        OSError: naming the argument, the path, the component that is in the way and the fix.

    Examples:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> check_dir_creatable("dirpath", root / "a" / "b") == root / "a" / "b"
        True
        >>> _ = (root / "file").write_text("x")
        >>> check_dir_creatable("dirpath", root / "file" / "oom")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        OSError: `dirpath` must be a writable directory, got '.../file/oom': '.../file' is a file. Pass a `dirpath` ...
    """
    path = Path(path)
    probe = path
    while True:
        try:
            info = probe.stat()
        except (FileNotFoundError, NotADirectoryError):  # missing, or under a file: look at the parent
            if probe.parent == probe:
                break
            probe = probe.parent
            continue
        except OSError as err:
            raise OSError(
                f"`{name}` must be a writable directory, got {str(path)!r}: {str(probe)!r} cannot be read"
                f" ({err.strerror or err}). {_fix(name)}"
            ) from err
        if not stat.S_ISDIR(info.st_mode):
            what = "a file" if stat.S_ISREG(info.st_mode) else "not a directory"
            raise OSError(
                f"`{name}` must be a writable directory, got {str(path)!r}: {str(probe)!r} is {what}. {_fix(name)}"
            )
        if not os.access(probe, os.W_OK | os.X_OK):
            raise OSError(
                f"`{name}` must be a writable directory, got {str(path)!r}: {str(probe)!r} is not writable by this"
                f" process. {_fix(name)}"
            )
        return path
    return path  # pragma: no cover - even the root does not exist


def file_kind(mode: int) -> str:
    """What a ``st_mode`` is, in words: ``"a regular file"``, ``"a directory"``, ``"a named pipe"``, ...

    Examples:
        >>> file_kind(stat.S_IFIFO), file_kind(stat.S_IFDIR | 0o755)
        ('a named pipe', 'a directory')
    """
    kinds = (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "a special file")


def regular_file_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be read as a regular file, in a few words, without opening it; ``None`` if it can.

    A named pipe or a device would block the reader or never end, so they are refused by their ``stat`` alone.

    Examples:
        >>> import tempfile
        >>> regular_file_problem(tempfile.mkdtemp()), regular_file_problem("/no/such/file")
        ('is a directory', 'no such file')
    """
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "no such file"
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    if stat.S_ISREG(mode):
        return None
    kind = file_kind(mode)
    return f"is {kind}" if kind == "a directory" else f"is {kind}, not a regular file"


def symlink_message(name: str, path: Path) -> str:
    """The refusal of a log path that is a symbolic link: the path, where it points and the fix.

    Examples:
        >>> symlink_message("dirpath", Path("/no/such/link"))  # doctest: +ELLIPSIS
        "`dirpath`: '/no/such/link' is a symbolic link; a log is never written through a link ... another `dirpath`."
    """
    try:
        target = f" to {os.readlink(path)!r}"
    except OSError:
        target = ""
    return (
        f"`{name}`: {str(path)!r} is a symbolic link{target}; a log is never written through a link (it could point"
        f" at any file). Remove the link or pass another `{name}`."
    )


def check_regular_file(name: str, path: Path) -> None:
    """Refuse a log path that exists but is not a regular file of its own.

    A named pipe would block the reader forever; a symbolic link (followed by an append) would write into whatever
    file it points at, outside the directory; a file with other hard links is another file's name.

    Raises:
        OSError: naming the argument, the path, what it is and the fix.

    Examples:
        >>> import tempfile
        >>> check_regular_file("dirpath", Path(tempfile.mkdtemp()))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        OSError: `dirpath`: ... exists and is a directory, not a regular file. Remove it or pass another `dirpath`.
    """
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise OSError(symlink_message(name, path))
    if stat.S_ISREG(info.st_mode):
        if info.st_nlink > 1:
            raise OSError(hard_link_message(name, path, info.st_nlink))
        return
    what = file_kind(info.st_mode)
    raise OSError(
        f"`{name}`: {str(path)!r} exists and is {what}, not a regular file. Remove it or pass another `{name}`."
    )


def hard_link_message(name: str, path: Path, links: int) -> str:
    """The refusal of a log path that has other hard links (the same file under other names, maybe elsewhere)."""
    return (
        f"`{name}`: {str(path)!r} has {links - 1} other hard link(s): appending to it would change that file under"
        f" its other names. Remove it or pass another `{name}`."
    )


def _int_digit_limit() -> int:
    """Python's limit on the digits of an integer it reads from text (``sys.set_int_max_str_digits``; 0: none)."""
    return int(getattr(sys, "get_int_max_str_digits", lambda: 0)())


def digit_limit_problem(err: BaseException) -> str | None:
    """Why reading JSON failed, in a few words, when the cause is an integer longer than Python reads; else ``None``.

    Python refuses to convert an integer of more than ``sys.get_int_max_str_digits()`` digits (4300 by default) and
    says so in a ``ValueError`` that names neither the file nor the line: readers use this to name both.

    Examples:
        >>> try:
        ...     json.loads("1" * 5000)
        ... except ValueError as err:
        ...     print(digit_limit_problem(err))
        holds an integer of more than 4300 digits (Python reads at most 4300)
        >>> digit_limit_problem(ValueError("something else")) is None
        True
    """
    if isinstance(err, json.JSONDecodeError) or not isinstance(err, ValueError):
        return None
    if "integer string conversion" not in str(err):
        return None
    limit = _int_digit_limit()
    return f"holds an integer of more than {limit} digits (Python reads at most {limit})"


def line_with_long_integer(path: str | os.PathLike[str]) -> int | None:
    """The 1-based number of the first line of ``path`` with a run of digits longer than Python reads; ``None`` if
    there is none or the file cannot be read. Reads 1 MiB at a time, however long the lines.

    Examples:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "report.json"
        >>> _ = path.write_text('{\\n"a": 1,\\n"b": ' + "7" * 5000 + "}")
        >>> line_with_long_integer(path)
        3
    """
    limit = _int_digit_limit()
    if limit <= 0:
        return None
    number, run = 1, 0
    with contextlib.suppress(OSError), open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            last = 0
            for match in _DIGITS_OR_NEWLINE.finditer(chunk):
                if match.start() != last:
                    run = 0  # something else came between: a new run
                last = match.end()
                if match.group() == b"\n":
                    number, run = number + 1, 0
                    continue
                run += last - match.start()
                if run > limit:
                    return number
            if last != len(chunk):
                run = 0
    return None


_DIGITS_OR_NEWLINE = re.compile(rb"[0-9]+|\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it over ``path``.

    A reader never sees half a file; when the write fails (a full disk) the temporary file is removed and the
    error is raised to the caller, who decides whether to warn. The temporary file is created afresh
    (``O_EXCL | O_NOFOLLOW``): a link planted at its name is removed, never written through.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # a stale temporary file, or a link planted at its name
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
        with os.fdopen(os.open(tmp, flags, 0o644), "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
