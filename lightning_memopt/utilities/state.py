"""Checks of a stateful object's state read back from a checkpoint: a clear error, or a warning and a fresh value.

A checkpoint can come from an older version of the package, another run or a hand edit. Each owner (a callback, a
plugin) describes its state once as a small schema, ``key -> StateField``, and loads through :func:`load_state`:

* a value that fits is converted (``numpy.int64(3)`` becomes ``3``) and returned;
* a missing, mistyped or out-of-range value of a *harmless* key (a counter, a sample window: losing it costs a
  statistic, never a result) is replaced by the field's default, with one warning naming the owner and the keys;
* the same for a key that is not harmless raises ``ValueError`` naming the owner, the key, the value and the fix;
* keys the schema does not know (written by a newer version) are ignored with the same warning.
"""

from __future__ import annotations

import math
import numbers
import reprlib
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["StateField", "as_bool", "as_float", "as_int", "as_list", "as_optional", "load_state", "state_error"]

_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxlist, _repr.maxdict, _repr.maxstring, _repr.maxother = 2, 4, 4, 40, 40

#: What an error and a warning tell the user to do.
FIX = (
    "Resume from a checkpoint written by this version of lightning-memopt, or delete the entry from the"
    " checkpoint's 'callbacks' (or the plugin's state) to start it fresh."
)


@dataclass(frozen=True)
class StateField:
    """What one key of a saved state must hold.

    Args:
        convert: Returns the checked value; raises ``TypeError`` or ``ValueError`` when the value does not fit.
        expected: The allowed values in words, for messages ("a non-negative int").
        default: The fresh value (a missing or bad harmless key gets it; a list default is copied).
        harmless: Whether losing the value only costs a statistic (warn and start fresh) rather than changing what
            the run computes (raise).
    """

    convert: Callable[[Any], Any]
    expected: str
    default: Any = None
    harmless: bool = True

    def fresh(self) -> Any:
        return list(self.default) if isinstance(self.default, list) else self.default


def _describe(value: Any) -> str:
    return f"{_repr.repr(value)} ({type(value).__name__})"


def as_int(minimum: int | None = None) -> Callable[[Any], int]:
    """A converter accepting any integral number (not a bool, not a float) ``>= minimum``; returns an ``int``.

    Examples:
        >>> as_int(0)(3)
        3
        >>> as_int(0)(True)
        Traceback (most recent call last):
        ...
        TypeError: not an int
    """

    def convert(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError("not an int")
        if minimum is not None and value < minimum:
            raise ValueError(f"below {minimum}")
        return int(value)

    return convert


def as_float(minimum: float | None = None) -> Callable[[Any], float]:
    """A converter accepting any finite real number (not a bool) ``>= minimum``; returns a ``float``.

    Examples:
        >>> as_float(0.0)(2)
        2.0
    """

    def convert(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError("not a number")
        number = float(value)
        if not math.isfinite(number) or (minimum is not None and number < minimum):
            raise ValueError("out of range")
        return number

    return convert


def as_bool(value: Any) -> bool:
    """A converter accepting only ``True`` and ``False`` (and NumPy's bools)."""
    if type(value).__name__ not in ("bool", "bool_"):
        raise TypeError("not a bool")
    return bool(value)


def as_list(item: Callable[[Any], Any], max_len: int | None = None) -> Callable[[Any], list[Any]]:
    """A converter accepting a list or tuple whose items ``item`` accepts; keeps the last ``max_len`` items."""

    def convert(value: Any) -> list[Any]:
        if not isinstance(value, (list, tuple)):
            raise TypeError("not a list")
        items = [item(v) for v in value]
        return items[-max_len:] if max_len is not None else items

    return convert


def as_optional(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A converter that also accepts ``None``."""

    def convert_or_none(value: Any) -> Any:
        if value is None:
            return None
        return convert(value)

    return convert_or_none


def state_error(owner: str, key: str, expected: str, value: Any) -> ValueError:
    """The error for a saved ``key`` of ``owner`` that does not hold ``expected``: names all three and the fix.

    Examples:
        >>> print(state_error("Metric", "ids", "a list of tensors", "x"))  # doctest: +ELLIPSIS
        Metric: the checkpoint's state key 'ids' must be a list of tensors, got 'x' (str). Resume from ...
    """
    return ValueError(f"{owner}: the checkpoint's state key {key!r} must be {expected}, got {_describe(value)}. {FIX}")


def load_state(owner: str, state: Any, schema: Mapping[str, StateField]) -> dict[str, Any]:
    """Check ``state`` against ``schema``: every key of ``schema`` with a checked (or fresh) value.

    Args:
        owner: The name the messages give (``"GarbageCollector"``).
        state: What the checkpoint holds for the owner.
        schema: ``key -> StateField``.

    Raises:
        ValueError: a key that is not harmless is missing or holds a value it does not allow (or the state is not a
            dict and such a key exists), naming the owner, the key, the value received and the fix.

    Examples:
        >>> schema = {"calls": StateField(as_int(0), "a non-negative int", default=0)}
        >>> load_state("Counter", {"calls": 3}, schema)
        {'calls': 3}
        >>> import warnings as _w
        >>> with _w.catch_warnings(record=True) as caught:
        ...     _w.simplefilter("always")
        ...     load_state("Counter", {"calls": -1}, schema)
        {'calls': 0}
        >>> print(caught[0].message)  # doctest: +ELLIPSIS
        Counter: the checkpoint's state key 'calls' must be a non-negative int, got -1 (int); it starts fresh ...
    """
    if not isinstance(state, Mapping):
        needed = [key for key, field in schema.items() if not field.harmless]
        message = f"{owner}: the checkpoint's state must be a dict with keys {list(schema)}, got {_describe(state)}"
        if needed:
            raise ValueError(f"{message}; {needed} cannot start fresh. {FIX}")
        warnings.warn(f"{message}; it starts fresh (losing it only costs statistics). {FIX}", UserWarning, stacklevel=3)
        return {key: field.fresh() for key, field in schema.items()}
    result: dict[str, Any] = {}
    problems: list[str] = []
    for key, field in schema.items():
        if key not in state:
            problem = f"{owner}: the checkpoint's state has no key {key!r} (an older version's checkpoint?)"
        else:
            try:
                result[key] = field.convert(state[key])
                continue
            except (TypeError, ValueError, OverflowError) as err:
                if not field.harmless:
                    raise state_error(owner, key, field.expected, state[key]) from err
                problem = f"{owner}: the checkpoint's state key {key!r} must be {field.expected}, got "
                problem += _describe(state[key])
        if not field.harmless:
            raise ValueError(f"{problem}; it cannot start fresh. {FIX}")
        result[key] = field.fresh()
        problems.append(f"{problem}; it starts fresh" + ("" if field.default is None else f" at {field.default!r}"))
    extra = [key for key in state if key not in schema]
    if extra:
        problems.append(f"{owner}: the checkpoint's state has keys this version does not know: {_repr.repr(extra)}")
    if problems:
        warnings.warn(". ".join(problems) + f". {FIX}", UserWarning, stacklevel=3)
    return result
