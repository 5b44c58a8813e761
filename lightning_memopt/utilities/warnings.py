"""Warn-once helpers: a hook never crashes training because monitoring failed."""

from __future__ import annotations

import logging
import warnings

__all__ = ["WarnOnce", "log"]

#: The package logger; callbacks log through it so users can silence or redirect them in one place.
log = logging.getLogger("lightning_memopt")


class WarnOnce:
    """Emits each keyed warning at most once per instance.

    Example:
        >>> w = WarnOnce()
        >>> import warnings as _w
        >>> with _w.catch_warnings(record=True) as caught:
        ...     _w.simplefilter("always")
        ...     first, second = w.warn("read", "reading failed"), w.warn("read", "reading failed again")
        >>> first, second, len(caught)
        (True, False, 1)
    """

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def warn(self, key: str, message: str, category: type[Warning] = UserWarning) -> bool:
        """Warn with ``message`` unless ``key`` was warned before. Returns whether it warned."""
        if key in self._seen:
            return False
        self._seen.add(key)
        warnings.warn(message, category, stacklevel=3)
        return True

    def reset(self) -> None:
        self._seen.clear()

