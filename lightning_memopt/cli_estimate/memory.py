"""The ``memory:`` section of a ``MemoryPresetCLI`` config: the preset the estimate models, and the snippet to paste
back into the config once the plan has chosen."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from lightning_memopt.cli_estimate.common import EstimateInputError, squash

__all__ = ["MEMORY_SECTION", "is_preset_section", "memory_preset", "memory_snippet", "preset_checkpointing"]

#: The config section of ``MemoryPresetCLI`` (its ``memory_key``).
MEMORY_SECTION = "memory"
#: ``memory.devices`` / ``memory.num_nodes`` follow ``trainer.devices`` / ``trainer.num_nodes`` in MemoryPresetCLI.
_WORLD = ("devices", "num_nodes")


def is_preset_section(section: Mapping[str, Any]) -> bool:
    """Whether a ``memory:`` section is MemoryPresetCLI's: it names at least one MemoryPreset field (a section of
    another LightningCLI subclass that happens to be called ``memory`` names none)."""
    from lightning_memopt.presets import MemoryPreset

    return any(f.name in section for f in dataclasses.fields(MemoryPreset) if f.init)


def memory_preset(section: Any, devices: int, num_nodes: int, where: str) -> Any:
    """The :class:`~lightning_memopt.MemoryPreset` of a config's ``memory:`` section, on ``devices x num_nodes``.

    Errors are one line naming the config keys (`` `memory.effective_batch_size` ``).
    """
    from lightning_memopt.presets import MemoryPreset
    from lightning_memopt.presets.cli import yaml_keys

    if not isinstance(section, Mapping):
        raise EstimateInputError(
            f"{where}: must be a mapping of MemoryPreset fields (e.g. {{name: max-savings, effective_batch_size:"
            f" 256, micro_batch_size: 16}}), got {type(section).__name__} {section!r}."
        )
    fields = {f.name for f in dataclasses.fields(MemoryPreset) if f.init}
    unknown = sorted(set(section) - fields)
    if unknown:
        raise EstimateInputError(
            f"{where}: unknown key(s) {', '.join(map(str, unknown))}; MemoryPreset's fields are"
            f" {', '.join(sorted(fields))}."
        )
    kwargs = {k: v for k, v in section.items() if k not in _WORLD}
    try:
        return MemoryPreset(**kwargs, devices=devices, num_nodes=num_nodes)
    except (TypeError, ValueError) as err:
        named = frozenset(fields) - frozenset(_WORLD)  # the world comes from --devices or trainer:, not from memory:
        raise EstimateInputError(f"{where}: {yaml_keys(squash(err), MEMORY_SECTION, named)}") from None


def preset_checkpointing(preset: Any) -> Any:
    """The estimate's ``checkpointing`` for what the preset's ``GradientCheckpointing`` wraps: its blocks, ``True``
    (the model's switch or the default layers) or ``False``."""
    if not preset.gradient_checkpointing:
        return False
    return list(preset.checkpoint_modules) if preset.checkpoint_modules else True


def _strategy_keys(plan: Any) -> dict[str, Any]:
    """The preset's strategy fields of a plan over several ranks (none on one device)."""
    keys: dict[str, Any] = {"strategy": plan.preset_strategy} if plan.preset_strategy else {}
    if plan.sharded:
        keys["reshard_after_forward"] = bool(plan.reshard_after_forward)
        if plan.cpu_offload:
            keys["cpu_offload"] = True
        if plan.shard_blocks is not None:
            keys.update(shard_blocks=list(plan.shard_blocks), shard_roots=list(plan.shard_roots))
    return keys


def memory_snippet(section: Mapping[str, Any] | None, plan: Any) -> str:
    """The ``memory:`` section to paste back into the config: yours, with what the plan chose.

    Keeps the keys you wrote (the preset's name, its other knobs; not those left null) and sets
    ``effective_batch_size``, ``micro_batch_size``, ``precision`` and ``gradient_checkpointing`` (and
    ``checkpoint_modules`` for blocks given by name), the planned ``eval_batch_size`` and, over several ranks, the
    strategy (``ddp``, or ``fsdp2`` with its options, blocks and roots) as planned; ``devices`` and ``num_nodes``
    stay under ``trainer:``, where MemoryPresetCLI reads them.
    """
    import yaml

    yours = dict(section or {})
    memory: dict[str, Any] = {
        "name": yours.get("name", plan.preset_name),
        "effective_batch_size": plan.effective_batch_size,
        "micro_batch_size": plan.micro_batch_size,
        "precision": plan.precision,
        "gradient_checkpointing": bool(plan.gradient_checkpointing),
    }
    if plan.gradient_checkpointing and plan.checkpoint_modules:
        memory["checkpoint_modules"] = [m if isinstance(m, str) else m.__name__ for m in plan.checkpoint_modules]
    if getattr(plan, "eval_batch_size", None) is not None:
        memory["eval_batch_size"] = plan.eval_batch_size
    memory.update(_strategy_keys(plan))
    # null is the preset's value, as if not written (a config LightningCLI saved lists every field)
    memory.update({k: v for k, v in yours.items() if k not in memory and k not in _WORLD and v is not None})
    text = yaml.safe_dump({MEMORY_SECTION: memory}, sort_keys=False, default_flow_style=None)
    return text.rstrip("\n")
