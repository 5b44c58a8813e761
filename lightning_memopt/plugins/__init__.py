"""Lightning plugins and the memory presets."""

from lightning_memopt.plugins.precision import MemoryPrecision
from lightning_memopt.plugins.preset_cli import MemoryPresetCLI
from lightning_memopt.plugins.presets import MemoryPreset

__all__ = [
    "MemoryPrecision",
    "MemoryPreset",
    "MemoryPresetCLI",
]
