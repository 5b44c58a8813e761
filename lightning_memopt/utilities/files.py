"""Files the callbacks write: directories checked in ``setup``, writes that never raise into training.

Two kinds of failure are told apart:

* a **configuration** error (the directory is a file, lies under a file, is not writable, the log path is a named
  pipe): raised in ``setup`` with the argument, the value and the fix, before any step has run;
* a **runtime** failure (the disk is full, the directory was removed or replaced mid-run): the caller warns once
  and training goes on without that file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

__all__ = [
    "RUNTIME_ERRNOS",
    "check_dir_creatable",
    "check_regular_file",
    "file_kind",
    "hard_link_message",
    "is_runtime_failure",
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

    Example:
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

    Example:
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

    Example:
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

    Example:
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

    Example:
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

    Example:
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


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it over ``path``.

    A reader never sees half a file; when the write fails (a full disk) the temporary file is removed and the
    error is raised to the caller, who decides whether to warn.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
