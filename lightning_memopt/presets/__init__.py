"""Memory presets: :class:`MemoryPreset` and the LightningCLI mixin :class:`MemoryPresetCLI` (``docs/presets.md``).

``preset.py`` holds the dataclass, its table and how a preset turns into Trainer arguments and callbacks;
``cli.py`` is the LightningCLI integration. A preset is built from a name, a GPU size or a
:func:`~lightning_memopt.plan_memory` plan (:meth:`MemoryPreset.from_plan`); the planner never imports this package.
"""

from lightning_memopt.presets.cli import MemoryPresetCLI
from lightning_memopt.presets.preset import DEFAULT_BATCH_SIZE, MemoryPreset, PresetName, device_count

__all__ = ["DEFAULT_BATCH_SIZE", "MemoryPreset", "MemoryPresetCLI", "PresetName", "device_count"]
