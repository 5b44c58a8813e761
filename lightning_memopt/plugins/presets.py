"""Old home of ``MemoryPreset``, kept importable: the presets live in :mod:`lightning_memopt.presets`.

The names are looked up on first use, so that importing :mod:`lightning_memopt.plugins` never imports the presets
(which sit above the plugins).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_memopt.presets import DEFAULT_BATCH_SIZE, MemoryPreset, PresetName, device_count

__all__ = ["DEFAULT_BATCH_SIZE", "MemoryPreset", "PresetName", "device_count"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module("lightning_memopt.presets"), name)
