"""Lightning plugins. ``MemoryPreset`` and ``MemoryPresetCLI`` live in :mod:`lightning_memopt.presets`."""

from lightning_memopt.plugins.precision import MemoryPrecision

__all__ = ["MemoryPrecision"]
