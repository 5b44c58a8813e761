"""Argument checks that raise errors which name the argument, the value received and the fix."""

from __future__ import annotations

import difflib
import math
import numbers
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, overload

__all__ = [
    "check_bool",
    "check_choice",
    "check_device",
    "check_device_usable",
    "check_fraction",
    "check_non_negative_int",
    "check_non_negative_number",
    "check_path",
    "check_positive_int",
    "check_positive_number",
    "check_str",
    "check_writable_dir",
    "is_finite_number",
]

#: Ints at or beyond this do not fit a float.
_FLOAT_INT_LIMIT = 2**1024


def is_finite_number(value: Any) -> bool:
    """Whether ``value`` is an int or float (not a bool) that is finite and fits a float.

    Fast for plain ints and floats: it runs for every field of every record a log reader checks.

    Examples:
        >>> is_finite_number(3), is_finite_number(float("nan")), is_finite_number(True), is_finite_number("3")
        (True, False, False, False)
    """
    kind = type(value)
    if kind is float:
        return math.isfinite(value)
    if kind is int:
        return abs(value) < _FLOAT_INT_LIMIT
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _suffix(hint: str | None) -> str:
    return f" {hint}" if hint else ""


def _real(value: Any) -> float | None:
    """``value`` as a Python float if it is a real number (``numbers.Real``: int, float, NumPy scalars, not a bool)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_" or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except (OverflowError, TypeError, ValueError):  # an int too large for a float
        return None


def _number_hint(value: Any, hint: str | None) -> str | None:
    """A hint for a tensor or array holding one number (refused: it may live on a device, or carry autograd)."""
    if hint is None and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return "Pass a Python number, e.g. `value.item()`."
    return hint


def check_positive_int(name: str, value: Any, hint: str | None = None, allow_none: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is an int >= 1 (or ``None`` when ``allow_none``).

    Examples:
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

    Examples:
        >>> check_non_negative_int("generation", -1, hint="Use 0, 1 or 2.")
        Traceback (most recent call last):
        ...
        ValueError: `generation` must be a non-negative int, got -1. Use 0, 1 or 2.
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"`{name}` must be a non-negative int, got {value!r}.{_suffix(hint)}")


@overload
def check_fraction(name: str, value: Any, hint: str | None = ..., allow_none: Literal[False] = ...) -> float: ...
@overload
def check_fraction(name: str, value: Any, hint: str | None = ..., allow_none: bool = ...) -> float | None: ...


def check_fraction(name: str, value: Any, hint: str | None = None, allow_none: bool = False) -> float | None:
    """``value`` as a Python float; ``ValueError`` unless it is a real number in (0, 1] (or ``None`` when allowed).

    Any real number type is accepted (``numbers.Real``: int, float, ``fractions.Fraction``, NumPy scalars such as
    ``numpy.float32(0.9)``); bools are refused, and so are tensors and arrays (with a hint to pass ``.item()``).

    Examples:
        >>> check_fraction("warn_threshold", 0.5)
        0.5
        >>> check_fraction("warn_threshold", 90)
        Traceback (most recent call last):
        ...
        ValueError: `warn_threshold` must be a fraction in (0, 1], got 90. Did you mean 0.9 (90 %)?
    """
    if value is None and allow_none:
        return None
    number = _real(value)
    if number is None or not 0 < number <= 1:
        if hint is None and number is not None and 1 < number <= 100:
            hint = f"Did you mean {number / 100:g} ({number:g} %)?"
        raise ValueError(f"`{name}` must be a fraction in (0, 1], got {value!r}.{_suffix(_number_hint(value, hint))}")
    return number


def check_bool(name: str, value: Any, hint: str | None = None) -> None:
    """Raise ``ValueError`` unless ``value`` is ``True`` or ``False`` (strings such as ``"no"`` and ints are refused).

    Examples:
        >>> check_bool("log_to_loggers", "no")
        Traceback (most recent call last):
        ...
        ValueError: `log_to_loggers` must be a bool (True or False), got 'no'.
    """
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be a bool (True or False), got {value!r}.{_suffix(hint)}")


def check_path(name: str, value: Any, allow_none: bool = True) -> None:
    """Raise ``ValueError`` unless ``value`` is a non-empty ``str`` or ``os.PathLike`` (or ``None`` when allowed).

    Examples:
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


def _same_choice(value: Any, choice: Any) -> bool:
    """``value == choice`` where a bool never stands for an int (``True == 1``) and a float never for an int."""
    if isinstance(value, bool) or isinstance(choice, bool):
        return isinstance(value, bool) and isinstance(choice, bool) and value is choice
    if isinstance(choice, int) and not isinstance(value, int):
        return False
    try:
        return bool(value == choice)
    except (RuntimeError, ValueError, TypeError):  # e.g. a tensor or an array: not a choice
        return False


def check_choice(name: str, value: Any, choices: Iterable[Any], hint: str | None = None) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices`` (``True`` and ``1.0`` do not count as ``1``).

    A string close to one of the choices gets a "Did you mean" hint.

    Examples:
        >>> check_choice("mode", "max", ("min", "mean"))
        Traceback (most recent call last):
        ...
        ValueError: `mode` must be one of 'min', 'mean', got 'max'.
        >>> check_choice("generation", True, (0, 1, 2))
        Traceback (most recent call last):
        ...
        ValueError: `generation` must be one of 0, 1, 2, got True.
        >>> check_choice("ties", "pesimistic", ("optimistic", "pessimistic"))
        Traceback (most recent call last):
        ...
        ValueError: `ties` must be one of 'optimistic', 'pessimistic', got 'pesimistic'. Did you mean 'pessimistic'?
    """
    choices = tuple(choices)
    if any(_same_choice(value, c) for c in choices):
        return
    if hint is None and isinstance(value, str):
        close = difflib.get_close_matches(value, [c for c in choices if isinstance(c, str)], n=1)
        hint = f"Did you mean {close[0]!r}?" if close else None
    allowed = ", ".join(repr(c) for c in choices)
    raise ValueError(f"`{name}` must be one of {allowed}, got {value!r}.{_suffix(hint)}")


def _check_finite_number(name: str, value: Any, positive: bool, hint: str | None, allow_none: bool) -> float | None:
    if value is None and allow_none:
        return None
    number = _real(value)
    if number is None or not math.isfinite(number) or not (number > 0 if positive else number >= 0):
        what = "a finite, positive number" if positive else "a finite, non-negative number"
        what += " or None" if allow_none else ""
        raise ValueError(f"`{name}` must be {what}, got {value!r}.{_suffix(_number_hint(value, hint))}")
    return number


@overload
def check_positive_number(name: str, value: Any, hint: str | None = ..., allow_none: Literal[False] = ...) -> float: ...
@overload
def check_positive_number(name: str, value: Any, hint: str | None = ..., allow_none: bool = ...) -> float | None: ...


def check_positive_number(name: str, value: Any, hint: str | None = None, allow_none: bool = False) -> float | None:
    """``value`` as a Python float; ``ValueError`` unless it is a finite real number > 0 (no NaN, inf or bool).

    Any real number type is accepted, as by :func:`check_fraction`.

    Examples:
        >>> check_positive_number("total_memory_gib", float("nan"))
        Traceback (most recent call last):
        ...
        ValueError: `total_memory_gib` must be a finite, positive number, got nan.
    """
    return _check_finite_number(name, value, True, hint, allow_none)


@overload
def check_non_negative_number(
    name: str, value: Any, hint: str | None = ..., allow_none: Literal[False] = ...
) -> float: ...
@overload
def check_non_negative_number(
    name: str, value: Any, hint: str | None = ..., allow_none: bool = ...
) -> float | None: ...


def check_non_negative_number(name: str, value: Any, hint: str | None = None, allow_none: bool = False) -> float | None:
    """``value`` as a Python float; ``ValueError`` unless it is a finite real number >= 0 (no NaN, inf or bool).

    Any real number type is accepted, as by :func:`check_fraction`.

    Examples:
        >>> check_non_negative_number("gradient_clip_val", float("inf"), allow_none=True)
        Traceback (most recent call last):
        ...
        ValueError: `gradient_clip_val` must be a finite, non-negative number or None, got inf.
    """
    return _check_finite_number(name, value, False, hint, allow_none)


def check_str(
    name: str, value: Any, hint: str | None = None, allow_none: bool = False, allow_empty: bool = True
) -> None:
    """Raise ``ValueError`` unless ``value`` is a ``str`` (non-empty unless ``allow_empty``; or ``None`` if allowed).

    Examples:
        >>> check_str("allocator_conf", 5, allow_none=True)
        Traceback (most recent call last):
        ...
        ValueError: `allocator_conf` must be a str or None, got 5 (int).
    """
    if value is None and allow_none:
        return
    if isinstance(value, str) and (allow_empty or value):
        return
    what = "a str" if allow_empty else "a non-empty str"
    what += " or None" if allow_none else ""
    raise ValueError(f"`{name}` must be {what}, got {value!r} ({type(value).__name__}).{_suffix(hint)}")


def check_device(name: str, value: Any, allow_none: bool = True) -> None:
    """Raise ``ValueError`` unless ``value`` names a device: a ``torch.device``, a device string, an index or None.

    An int is a CUDA device index (``0`` = ``"cuda:0"``); bools and floats are refused.

    Examples:
        >>> check_device("device", "cuda:0")
        >>> check_device("device", 3.5)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: `device` must be a torch.device, a device string such as 'cuda:0' or 'cpu', ... got 3.5 (float).
    """
    import torch

    if (value is None and allow_none) or isinstance(value, torch.device):
        return
    hint = None
    if isinstance(value, int) and not isinstance(value, bool):
        if value >= 0:
            return
        hint = "Device indices start at 0."
    elif isinstance(value, str):
        try:
            torch.device(value)
            return
        except (RuntimeError, ValueError, TypeError) as err:
            hint = f"torch says: {str(err).splitlines()[0]}"
    elif isinstance(value, bool):
        hint = "A bool is not a device index."
    allowed = "a torch.device, a device string such as 'cuda:0' or 'cpu', a CUDA device index (int >= 0)"
    allowed += " or None" if allow_none else ""
    raise ValueError(f"`{name}` must be {allowed}, got {value!r} ({type(value).__name__}).{_suffix(hint)}")


def check_device_usable(device: Any) -> None:
    """Raise ``ValueError`` when ``device`` is a CUDA or XPU device that this process cannot use.

    Raises:
        ValueError: the backend is not available (a CPU-only build of torch, no driver, ``CUDA_VISIBLE_DEVICES``
            hiding every GPU), or the index is not below the number of devices this process sees; the message names
            the device and the fix.

    Examples:
        >>> import torch
        >>> check_device_usable(torch.device("cpu"))  # other device types are not checked
    """
    import torch

    if device.type not in ("cuda", "xpu"):
        return
    kind = device.type.upper()
    module = getattr(torch, device.type, None)
    if module is None or not module.is_available():
        raise ValueError(
            f"`device` is {str(device)!r}, but {kind} is not available in this process (torch {torch.__version__},"
            f" {kind} devices visible: 0). Pass `'cpu'` (host memory only), or run where a GPU is visible"
            " (check the driver and `CUDA_VISIBLE_DEVICES`)."
        )
    count = int(module.device_count())
    if device.index is not None and device.index >= count:
        raise ValueError(
            f"`device` is {str(device)!r}, but this process sees {count} {kind} device(s) (indices 0 to {count - 1})."
            f" Pass an index below {count}; `CUDA_VISIBLE_DEVICES` renumbers the visible GPUs from 0."
        )


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
