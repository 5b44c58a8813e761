"""Release what the ``AllocatorSettings`` a preset built holds, in tests that never fit (a no-op unless ``setup`` ran:
building one changes nothing)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lightning_memopt import AllocatorSettings


def give_back_allocator_settings(*built: Iterable[Any]) -> None:
    """Restore every ``AllocatorSettings`` among ``built`` (callback lists in the order they were built), the last one
    built first: each gives back what was there when it was built, so only that order ends where it started."""
    callbacks = [c for group in built for c in group if isinstance(c, AllocatorSettings)]
    for callback in reversed(callbacks):
        callback.restore()
