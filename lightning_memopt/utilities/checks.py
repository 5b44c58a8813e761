"""Argument checks that raise errors which name the argument, the value received and the fix."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = [
    "check_bool",
    "check_choice",
    "check_fraction",
    "check_non_negative_int",
    "check_path",
    "check_positive_int",
    "check_writable_dir",
]


def _suffix(hint: str | None) -> str:
    return f" {hint}" if hint else ""


def check_positive_int(name: str, value: Any, hint: str | None = None, allow_none: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is an int >= 1 (or ``None`` when ``allow_none``).

    Example:
        >>> check_positive_int("every_n_steps", 0)
        Traceback (most recent call last):
        ...
        ValueError: `every_n_steps` must be a positive int, got 0.
    """
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be a positive int, got {value!r}.{_suffix(hint)}")


def check_non_negative_int(name: str, value: Any, hint: str | None = None) -> None:
    """Raise ``ValueError`` unless ``value`` is an int >= 0.

    Example:
        >>> check_non_negative_int("generation", -1, hint="Use 0, 1 or 2.")
        Traceback (most recent call last):
        ...
        ValueError: `generation` must be a non-negative int, got -1. Use 0, 1 or 2.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{name}` must be a non-negative int, got {value!r}.{_suffix(hint)}")


def check_fraction(name: str, value: Any, hint: str | None = None, allow_none: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a number in (0, 1].

    Example:
        >>> check_fraction("warn_threshold", 90)
        Traceback (most recent call last):
        ...
        ValueError: `warn_threshold` must be a fraction in (0, 1], got 90. Did you mean 0.9 (90 %)?
    """
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        if hint is None and isinstance(value, (int, float)) and 1 < value <= 100:
            hint = f"Did you mean {value / 100:g} ({value:g} %)?"
        raise ValueError(f"`{name}` must be a fraction in (0, 1], got {value!r}.{_suffix(hint)}")


def check_bool(name: str, value: Any, hint: str | None = None) -> None:
    """Raise ``ValueError`` unless ``value`` is ``True`` or ``False`` (strings such as ``"no"`` and ints are refused).

    Example:
        >>> check_bool("log_to_loggers", "no")
        Traceback (most recent call last):
        ...
        ValueError: `log_to_loggers` must be a bool (True or False), got 'no'.
    """
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be a bool (True or False), got {value!r}.{_suffix(hint)}")


def check_path(name: str, value: Any, allow_none: bool = True) -> None:
    """Raise ``ValueError`` unless ``value`` is a non-empty ``str`` or ``os.PathLike`` (or ``None`` when allowed).

    Example:
        >>> check_path("dirpath", 123)
        Traceback (most recent call last):
        ...
        ValueError: `dirpath` must be a path (str or os.PathLike) or None, got 123 (int).
    """
    if value is None and allow_none:
        return
    if isinstance(value, (str, os.PathLike)) and os.fspath(value) != "":
        return
    allowed = "a path (str or os.PathLike)" + (" or None" if allow_none else "")
    raise ValueError(f"`{name}` must be {allowed}, got {value!r} ({type(value).__name__}).")


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``.

    Example:
        >>> check_choice("mode", "max", ("min", "mean"))
        Traceback (most recent call last):
        ...
        ValueError: `mode` must be one of 'min', 'mean', got 'max'.
    """
    choices = tuple(choices)
    if value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"`{name}` must be one of {allowed}, got {value!r}.")


def check_writable_dir(name: str, path: str | os.PathLike[str]) -> Path:
    """Create ``path`` if needed and check that files can be written there.

    Raises:
        OSError: naming the argument, the path and the fix when the directory cannot be created or written.
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OSError(
            f"`{name}` must be a writable directory, got {str(path)!r}: it cannot be created ({err.strerror or err})."
            " Pass a `dirpath` you can write to."
        ) from err
    if not path.is_dir() or not os.access(path, os.W_OK | os.X_OK):
        raise OSError(
            f"`{name}` must be a writable directory, got {str(path)!r}: it is not writable by this process."
            " Pass a `dirpath` you can write to."
        )
    return path
