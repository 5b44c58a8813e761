"""Lightning plugins. ``MemoryPreset`` and ``MemoryPresetCLI`` live in :mod:`lightning_memopt.presets` and are
also found here, imported on first use (the presets sit above the plugins)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_memopt.plugins.precision import MemoryPrecision

if TYPE_CHECKING:
    from lightning_memopt.presets import MemoryPreset, MemoryPresetCLI

__all__ = [
    "MemoryPrecision",
    "MemoryPreset",
    "MemoryPresetCLI",
]

#: The names that live in :mod:`lightning_memopt.presets`.
_PRESETS = ("MemoryPreset", "MemoryPresetCLI")


def __getattr__(name: str) -> Any:
    if name not in _PRESETS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module("lightning_memopt.presets"), name)
