"""The preset table as :class:`~lightning_memopt.MemoryPreset` reads it: names, knobs and the Trainer keys it decides.

The knob values of each preset (``PRESETS``) and the GPU-size tiers (``TIERS``) are plain data in
:mod:`lightning_memopt.functional.presets`; ``docs/presets.md`` explains them.
"""

from __future__ import annotations

from typing import Any, Literal

from torch import nn

__all__ = ["DEFAULT_BATCH_SIZE", "KNOBS", "PRESET_TRAINER_KEYS", "PresetName", "checkpoint_modules"]

#: The DataLoader batch per device when a preset has neither ``effective_batch_size`` nor ``micro_batch_size``.
DEFAULT_BATCH_SIZE = 32

#: The preset names (a ``Literal``, so LightningCLI lists them in ``--help`` and refuses a typo while parsing).
PresetName = Literal["max-savings", "balanced", "max-speed"]

#: The fields a preset fills from its table entry when they are left ``None``.
KNOBS = (
    "precision",
    "float32_matmul_precision",
    "gradient_checkpointing",
    "allocator_conf",
    "cache_clean_on_phase_end",
    "gc_every_n_steps",
    "monitor",
)
#: Trainer arguments that ``trainer_kwargs`` decides.
PRESET_TRAINER_KEYS = (
    "precision",
    "plugins",
    "accumulate_grad_batches",
    "gradient_clip_val",
    "devices",
    "num_nodes",
    "callbacks",
)


def checkpoint_modules(value: Any) -> tuple[Any, ...] | None:
    """``checkpoint_modules`` as a tuple: one entry or a list/tuple of class names, name patterns or module classes."""
    if value is None:
        return None
    entries = (value,) if isinstance(value, (str, type)) else value
    if not isinstance(entries, (list, tuple)) or not entries:
        raise ValueError(
            f"`checkpoint_modules` must be a non-empty list of class names or name patterns, or None, got {value!r}"
            f" ({type(value).__name__}). Example: ['TransformerEncoderLayer', 'encoder.layers.*']; None checkpoints"
            " the default blocks."
        )
    for entry in entries:
        if not (isinstance(entry, str) and entry) and not (isinstance(entry, type) and issubclass(entry, nn.Module)):
            raise ValueError(
                f"`checkpoint_modules` entries must be non-empty class names, name patterns or nn.Module classes, got"
                f" {entry!r} in {value!r}. Example: ['TransformerEncoderLayer', 'encoder.layers.*']."
            )
    return tuple(entries)
