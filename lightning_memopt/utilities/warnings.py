"""Warn-once helpers: a hook never crashes training because monitoring failed."""

from __future__ import annotations

import logging
import os
import sys
import warnings
from types import FrameType
from typing import Any

from lightning_memopt.utilities.formatting import printable

__all__ = ["WarnOnce", "log", "warn_every_time"]


def _printable_arg(arg: Any) -> Any:
    """A text or path argument of a log record as one printable line; any other argument as it is."""
    if isinstance(arg, (str, os.PathLike)):
        return printable(os.fspath(arg))
    return arg


class _PrintableRecords(logging.Filter):
    """Escapes what a record would print (:func:`~lightning_memopt.utilities.formatting.printable`).

    Text and path arguments become one line each (a newline in a ``dirpath`` cannot pose as another log line);
    then the whole message keeps its own newlines and loses every other control or bidi character.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            args = record.args
            if isinstance(args, tuple) and args:
                record.args = tuple(_printable_arg(a) for a in args)
            record.msg, record.args = printable(record.getMessage(), keep_newlines=True), ()
        except Exception:  # a record that cannot be formatted: let logging report it as it always does
            pass
        return True


#: The package logger; callbacks log through it so users can silence or redirect them in one place. What it
#: prints is escaped: no terminal control sequence from a path or a value reaches the console.
log = logging.getLogger("lightning_memopt")
log.addFilter(_PrintableRecords())


def _warning_registry(module_globals: dict[str, Any], every_time: bool) -> dict[Any, Any]:
    """The module's once-per-place registry of warnings; a fresh, empty one when ``every_time``."""
    if every_time:
        return {}
    return module_globals.setdefault("__warningregistry__", {})


def _warn_from(frame: FrameType, message: str, category: type[Warning], every_time: bool) -> None:
    """Warn with ``message`` as if ``frame``'s line had called ``warnings.warn`` (its file, line and module).

    The module is what ``warnings.filterwarnings(module=...)`` matches: the package module that raised the warning,
    never the Lightning loop that called the hook raising it. ``every_time`` skips the module's once-per-place
    registry; otherwise a repeated warning is shown as Python's default filter shows it.
    """
    module_globals = frame.f_globals
    registry = _warning_registry(module_globals, every_time)
    warnings.warn_explicit(
        printable(message),
        category,
        frame.f_code.co_filename,
        frame.f_lineno,
        module=module_globals.get("__name__", "<string>"),
        registry=registry,
        module_globals=module_globals,
    )


def warn_every_time(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn with ``message`` from the caller's line, even if the same text was warned from there before.

    ``warnings.warn`` keeps a registry per calling module that hides a repeated message under the default filter,
    so a finding of a second fit in the same process (a notebook, a sweep) would print nothing. This skips that
    registry; the user's filters (``ignore``, ``error``, ``once``) still apply, and the warning belongs to the
    calling module (``filterwarnings("ignore", module="lightning_memopt")`` silences the package's).

    Examples:
        >>> import warnings as _w
        >>> with _w.catch_warnings(record=True) as caught:
        ...     _w.simplefilter("default")
        ...     for _ in range(2):
        ...         warn_every_time("the same finding")
        >>> len(caught)
        2
    """
    _warn_from(sys._getframe(1), message, category, every_time=True)


class WarnOnce:
    """Emits each keyed warning at most once per instance (per :meth:`reset`, with ``every_time=True``).

    The warning is located at the line that called :meth:`warn`, in the package module that raised it (a hook's
    warning never points at Lightning's ``call.py``), so ``warnings.filterwarnings("ignore",
    module="lightning_memopt")`` silences the package's warnings and nothing else.

    Messages are escaped for the terminal (:func:`~lightning_memopt.utilities.formatting.printable`) and kept on one
    line: a newline in a path or a value (a ``dirpath``) cannot pose as another line.

    With ``every_time=True`` the warnings are findings rather than failures: they skip Python's once-per-place
    registry (see :func:`warn_every_time`), and the owner calls :meth:`reset` when a new run starts.

    Why not ``lightning_utilities``' ``WarningCache``: it keys by the message text and warns on rank zero only. A
    failing reading names its error in the text (a new text each step) and may fail on one rank alone, so this keys
    by the kind of failure and warns on the rank where it happened.

    Examples:
        >>> w = WarnOnce()
        >>> import warnings as _w
        >>> with _w.catch_warnings(record=True) as caught:
        ...     _w.simplefilter("always")
        ...     first, second = w.warn("read", "reading failed"), w.warn("read", "reading failed again")
        >>> first, second, len(caught)
        (True, False, 1)
    """

    def __init__(self, every_time: bool = False) -> None:
        self._seen: set[str] = set()
        self.every_time = every_time

    def warn(self, key: str, message: str, category: type[Warning] = UserWarning) -> bool:
        """Warn with ``message`` unless ``key`` was warned before. Returns whether it warned."""
        if key in self._seen:
            return False
        self._seen.add(key)
        _warn_from(sys._getframe(1), message, category, self.every_time)
        return True

    def reset(self) -> None:
        self._seen.clear()
