"""Keep credentials out of reports: secret names (:mod:`.secret_names`), secrets inside strings (:mod:`.secret_text`)
and secrets inside structured values (here).

:func:`redact_secrets` walks a value field by field before anything becomes a string: mappings, lists, tuples,
sets, dataclasses, named tuples, ``argparse.Namespace`` and other objects with a ``__dict__``. A value stored
under a secret name is replaced whole; every string goes through :func:`redact_text` and is capped in size.
"""

from __future__ import annotations

import dataclasses
import enum
import types
from collections.abc import Mapping
from typing import Any

from lightning_memopt.utilities.secret_names import REDACTED, SECRET_WORDS, is_secret_name, name_words
from lightning_memopt.utilities.secret_text import MAX_VALUE_CHARS, cap_text, redact_text

__all__ = [
    "MAX_VALUE_CHARS",
    "REDACTED",
    "SECRET_FRAGMENTS",
    "SECRET_WORDS",
    "cap_text",
    "is_secret_name",
    "name_words",
    "redact_secrets",
    "redact_text",
]

#: The words that make a name secret (kept under its former name; see :func:`is_secret_name` for the rules).
SECRET_FRAGMENTS = SECRET_WORDS
#: Containers nested deeper than this are replaced whole: cheaper than walking them and never leaks.
_MAX_DEPTH = 64
#: Items of one container kept; the rest is cut with a ``...[truncated N items]`` marker.
_MAX_ITEMS = 10_000
#: Values walked in one call; past it, what is left is replaced by a marker (a report must come back fast).
_MAX_VALUES = 200_000
#: Keys that name the secret whose value sits under a ``value`` key beside them (``{"name": ..., "value": ...}``).
_NAME_KEYS = frozenset({"name", "key", "id", "env", "variable", "var"})
_VALUE_KEYS = frozenset({"value", "val", "secret", "data"})
#: Objects whose ``__dict__`` is not their content: left as they are (their ``str`` is scanned as text).
_OPAQUE = (type, types.ModuleType, enum.Enum, BaseException)


class _Walk:
    """The state of one :func:`redact_secrets` call: containers being walked (cycles) and the values left."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self.active: set[int] = set()
        self.left = _MAX_VALUES


def _scalar_under_secret_name(value: Any) -> Any:
    # Numbers, flags and None are not credentials (``num_key_value_heads=8``, ``use_auth=True``); anything
    # else under a secret-looking name is.
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return REDACTED


def _fields(obj: Any) -> dict[str, Any] | None:
    """The fields of a dataclass, named tuple or object with a ``__dict__``; ``None`` for anything else.

    Reads attributes without calling ``__repr__``/``__str__``; a field that cannot be read is ``<redacted>``.
    """
    if isinstance(obj, _OPAQUE) or callable(obj):
        return None  # classes, modules, functions, nn.Modules, enums, exceptions: their str is what they show
    field_names = getattr(type(obj), "_fields", None)
    if isinstance(obj, tuple) and isinstance(field_names, tuple):  # a named tuple
        return dict(zip(field_names, obj))
    names: list[str]
    if dataclasses.is_dataclass(obj):
        names = [field.name for field in dataclasses.fields(obj)]
    else:
        try:
            attributes = vars(obj)
        except TypeError:  # no __dict__ (slots, C types): str(obj) is scanned as text later
            return None
        if not isinstance(attributes, dict) or not attributes:
            return None
        names = [name for name in attributes if isinstance(name, str)]
    fields: dict[str, Any] = {}
    for name in names:
        try:
            fields[name] = getattr(obj, name)
        except Exception:  # a property or descriptor of the user's that fails: show nothing of it
            fields[name] = REDACTED
    return fields


def _secret_value_keys(mapping: dict[Any, Any]) -> bool:
    """Whether ``mapping`` is a ``{"name": "<secret name>", "value": ...}`` entry (Kubernetes env, tags, ...)."""
    return any(
        isinstance(key, str) and key.lower() in _NAME_KEYS and is_secret_name(value) for key, value in mapping.items()
    )


def _mapping(obj: Mapping[Any, Any], depth: int, walk: _Walk) -> dict[Any, Any]:
    items = list(obj.items())
    named = _secret_value_keys(dict(items[:_MAX_ITEMS])) if len(items) <= 16 else False
    out: dict[Any, Any] = {}
    for key, value in items[:_MAX_ITEMS]:
        new_key = _redact(key, depth + 1, walk) if isinstance(key, str) else key
        secret = is_secret_name(key) or (named and isinstance(key, str) and key.lower() in _VALUE_KEYS)
        out[new_key] = _scalar_under_secret_name(value) if secret else _redact(value, depth + 1, walk)
    if len(items) > _MAX_ITEMS:
        out["..."] = f"[truncated {len(items) - _MAX_ITEMS} items]"
    return out


def _is_flag(item: Any) -> bool:
    return isinstance(item, str) and item.startswith("-") and "=" not in item and is_secret_name(item)


def _sequence(items: list[Any], depth: int, walk: _Walk) -> list[Any]:
    """The items redacted; the item after a secret flag (``["--db-password", x]``) or a secret name in a pair
    (``("token", x)``) is replaced whole."""
    kept = items[:_MAX_ITEMS]
    out = [_redact(item, depth + 1, walk) for item in kept]
    pair = len(kept) == 2 and isinstance(kept[0], str) and is_secret_name(kept[0])
    for i in range(1, len(kept)):
        after_flag = _is_flag(kept[i - 1]) and not (isinstance(kept[i], str) and kept[i].startswith("--"))
        if after_flag or (pair and i == 1):
            out[i] = _scalar_under_secret_name(kept[i])
    if len(items) > _MAX_ITEMS:
        out.append(f"...[truncated {len(items) - _MAX_ITEMS} items]")
    return out


def _redact(obj: Any, depth: int, walk: _Walk) -> Any:
    walk.left -= 1
    if walk.left < 0:
        return "...[truncated: too many values]"
    if isinstance(obj, str):
        return redact_text(obj, max_chars=walk.max_chars)
    if obj is None or isinstance(obj, (bool, int, float, complex, bytes)):
        return obj
    if depth >= _MAX_DEPTH or id(obj) in walk.active:
        return REDACTED
    walk.active.add(id(obj))
    try:
        if isinstance(obj, Mapping):
            return _mapping(obj, depth, walk)
        fields = _fields(obj)
        if fields is not None:
            return _mapping(fields, depth, walk)
        if isinstance(obj, (list, tuple)):
            items = _sequence(list(obj), depth, walk)
            return items if isinstance(obj, list) else tuple(items)
        if isinstance(obj, (set, frozenset)):
            redacted = _sequence(list(obj), depth, walk)
            return frozenset(redacted) if isinstance(obj, frozenset) else set(redacted)
        return obj
    except Exception:  # an odd container that cannot be walked: leak nothing, raise nothing
        return REDACTED
    finally:
        walk.active.discard(id(obj))


def redact_secrets(obj: Any, max_chars: int = MAX_VALUE_CHARS) -> Any:
    """A copy of ``obj`` with the secrets in it replaced by ``"<redacted>"``; ``obj`` is not changed.

    Walks mappings (returned as ``dict``), lists, tuples and sets, and turns the objects that show their fields
    in their ``repr`` into a ``dict`` of those fields before anything becomes a string: dataclasses, named
    tuples, ``argparse.Namespace``, ``SimpleNamespace`` and other objects with a ``__dict__`` (the object is read,
    never rebuilt). Replaced whole (numbers, booleans and ``None`` are kept: they are settings such as
    ``num_key_value_heads``): a value under a secret name (:func:`is_secret_name`), the value after a secret flag
    in an argument list (``["--db-password", x]``), the second item of a ``("token", x)`` pair and the ``value``
    of a ``{"name": "DB_PASSWORD", "value": x}`` entry. Every other string goes through :func:`redact_text`
    and is cut to ``max_chars`` characters with a ``...[truncated N chars]`` marker; containers keep 10,000
    items. Classes, functions, modules (``nn.Module`` included), enums, tensors and other objects are returned
    as they are. A container that contains itself, or that is nested more than 64 deep, is replaced whole.
    Never raises.

    Example:
        >>> redact_secrets({"lr": 0.1, "api_key": "sk-123", "logger": {"uri": "https://u:pw@host/x"}})
        {'lr': 0.1, 'api_key': '<redacted>', 'logger': {'uri': 'https://u:<redacted>@host/x'}}
        >>> import argparse
        >>> redact_secrets(argparse.Namespace(tokenizer="t5-small", db_password="hunter2"))
        {'tokenizer': 't5-small', 'db_password': '<redacted>'}
    """
    try:
        return _redact(obj, 0, _Walk(max_chars))
    except Exception:
        return REDACTED
