"""Memory presets: :class:`MemoryPreset` and the LightningCLI mixin :class:`MemoryPresetCLI` (``docs/presets.md``)."""

from lightning_memopt.presets.cli import MemoryPresetCLI
from lightning_memopt.presets.preset import MemoryPreset
from lightning_memopt.presets.table import DEFAULT_BATCH_SIZE, PresetName
from lightning_memopt.presets.trainer_config import device_count

__all__ = ["DEFAULT_BATCH_SIZE", "MemoryPreset", "MemoryPresetCLI", "PresetName", "device_count"]
