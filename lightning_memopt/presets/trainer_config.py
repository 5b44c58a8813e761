"""How a :class:`~lightning_memopt.MemoryPreset` becomes Trainer arguments: its callbacks, its precision plugin or
string, the accumulation and world size it pins, merged with the user's own arguments or LightningCLI's config.

The dataclass and its table live in ``preset.py``, the LightningCLI integration in ``cli.py``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from lightning_memopt.callbacks import (
    AllocatorSettings,
    AutoMicroBatch,
    CacheCleaner,
    GarbageCollector,
    GradientCheckpointing,
    MemoryMonitor,
)
from lightning_memopt.functional.precision import choose_precision, has_own_precision
from lightning_memopt.utilities.namespaces import classes, is_instance, rank_zero_info

if TYPE_CHECKING:
    from lightning_memopt.presets.preset import MemoryPreset

__all__ = [
    "PRESET_TRAINER_KEYS",
    "build_trainer_kwargs",
    "device_count",
    "merge_trainer_config",
    "precision_string",
    "preset_callbacks",
]

#: Trainer arguments that ``MemoryPreset.trainer_kwargs`` decides.
PRESET_TRAINER_KEYS = (
    "precision",
    "plugins",
    "accumulate_grad_batches",
    "gradient_clip_val",
    "devices",
    "num_nodes",
    "callbacks",
)


def device_count(accelerator: Any, devices: Any) -> int | None:
    """How many devices per node ``Trainer(accelerator=..., devices=...)`` trains on; ``None`` if it cannot tell.

    Counts as Lightning does: a list (or ``"0,1"``) by its length, a positive int (or its string) as is, ``"auto"``
    and ``-1`` as every CUDA GPU for a CUDA accelerator, one device for the CPU and others.

    Examples:
        >>> device_count("cpu", "auto"), device_count("gpu", [0, 3]), device_count("auto", "2"), device_count("cpu", 0)
        (1, 2, 2, None)
    """
    if isinstance(devices, (list, tuple)):
        return len(devices) or None
    if isinstance(devices, str):
        text = devices.strip()
        if "," in text:
            return len([d for d in text.split(",") if d.strip()]) or None
        if text.lstrip("-").isdigit():
            devices = int(text)
    if isinstance(devices, bool):
        return None
    if isinstance(devices, int) and devices > 0:
        return devices
    if devices in ("auto", -1):
        name = (accelerator if isinstance(accelerator, str) else type(accelerator).__name__).lower()
        if any(word in name for word in ("auto", "gpu", "cuda")) and torch.cuda.is_available():
            return torch.cuda.device_count()
        return 1
    return None


def _trainer_defaults() -> dict[str, Any]:
    """Defaults of the Trainer's arguments (the first installed namespace's), read from its signature."""
    Trainer = classes("Trainer")[0]
    params = inspect.signature(Trainer).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def _same(value: Any, default: Any) -> bool:
    """``value == default`` for plain values only (plugin or callback objects are never "at the default")."""
    if default is None:
        return value is None
    return type(value) is type(default) and value == default


def preset_callbacks(preset: MemoryPreset) -> list[tuple[type, Any]]:
    """``(type, build)`` for each callback the preset implies, in order; nothing is built yet (``AllocatorSettings``
    sets the allocator's environment when it is made)."""
    out: list[tuple[type, Any]] = []
    if preset.monitor:
        out.append((MemoryMonitor, MemoryMonitor))
    if preset.cache_clean_on_phase_end:
        out.append(
            (
                CacheCleaner,
                lambda: CacheCleaner(every_n_train_steps=None, every_n_val_batches=None, on_phase_end=True),
            )
        )
    if preset.gc_every_n_train_steps:
        out.append((GarbageCollector, lambda: GarbageCollector(every_n_train_steps=preset.gc_every_n_train_steps)))
    if preset.gradient_checkpointing:
        modules = list(preset.checkpoint_modules) if preset.checkpoint_modules else None
        out.append((GradientCheckpointing, lambda: GradientCheckpointing(checkpoint_modules=modules)))
    if preset.auto_micro_batch:
        out.append((AutoMicroBatch, lambda: AutoMicroBatch(micro_batch_size=preset.micro_batch_size or "auto")))
    if preset.allocator_conf or preset.memory_fraction is not None:
        conf, fraction = preset.allocator_conf or None, preset.memory_fraction
        out.append((AllocatorSettings, lambda: AllocatorSettings(conf, fraction)))
    return out


def precision_string(preset: MemoryPreset) -> str:
    """A Lightning precision string for strategies with their own precision classes, resolved on this machine."""
    mode = str(preset.precision)  # normalized by the preset
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        name = torch.cuda.get_device_name(index)
        return choose_precision(mode, "cuda", (major, minor), name, preset.allow_emulated_bf16).precision
    return choose_precision(mode, "cpu").precision


def _precision_kwargs(preset: MemoryPreset, given: Mapping[str, Any]) -> dict[str, Any]:
    """``precision`` (strategies with their own precision classes) or ``plugins`` with the preset's MemoryPrecision."""
    if has_own_precision(given.get("strategy")):
        return {} if "precision" in given else {"precision": precision_string(preset)}  # or the user chose for it
    plugins = given.get("plugins") or []
    plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    if given.get("precision") is not None:
        raise ValueError(
            f"Both `precision={given['precision']!r}` and the preset's MemoryPrecision plugin were"
            f" given. Drop `precision=` from the Trainer arguments and set"
            f" `MemoryPreset(precision={given['precision']!r})` instead."
        )
    theirs = [p for p in plugins if is_instance(p, "plugins.precision.Precision")]
    if theirs:
        raise ValueError(
            f"Both `plugins=[{type(theirs[0]).__name__}(...)]` and the preset's MemoryPrecision plugin were"
            " given. Drop that precision plugin from `plugins` (set `MemoryPreset(precision=...)` instead)."
        )
    return {"plugins": [*plugins, preset.precision_plugin()]}


def _pinned_kwargs(preset: MemoryPreset, given: Mapping[str, Any]) -> dict[str, Any]:
    """``accumulate_grad_batches`` and ``gradient_clip_val``: the preset's, unless yours agrees (or the preset has no
    effective batch to keep, for the accumulation)."""
    out = {}
    for key, value in (
        ("accumulate_grad_batches", preset.accumulate_grad_batches),
        ("gradient_clip_val", preset.gradient_clip_val),
    ):
        yours = given.get(key)
        if yours is None:
            out[key] = value
        elif value is not None and yours != value and not (key == "accumulate_grad_batches" and preset.plan is None):
            why = (
                "with `auto_micro_batch=True` the DataLoader yields the whole per-device batch and"
                " AutoMicroBatch splits it"
                if preset.auto_micro_batch
                else "the preset computes it from `effective_batch_size`"
            )
            raise ValueError(
                f"`{key}={yours!r}` contradicts the preset's {key}={value!r}. Drop `{key}=` from the Trainer"
                f" arguments ({why}) or change the preset."
            )
    return out


def _world_kwargs(preset: MemoryPreset, given: Mapping[str, Any]) -> dict[str, Any]:
    """``devices`` and ``num_nodes`` of a preset with an effective batch; yours when it is the same number."""
    if preset.plan is None:
        return {}
    out = {}
    for key in ("devices", "num_nodes"):
        value = getattr(preset, key)
        yours = given.get(key)
        count = device_count(given.get("accelerator", "auto"), yours) if key == "devices" else yours
        if yours is not None and count == value:
            continue  # the same number, written your way (e.g. devices=[0, 1] or "2")
        if yours is not None and yours != value:
            raise ValueError(
                f"`{key}={yours!r}` differs from the preset's `{key}={value}`, so the effective batch would"
                f" not be {preset.effective_batch_size}. Drop `{key}=` from the Trainer arguments or build the"
                f" preset with `{key}={yours!r}`."
            )
        out[key] = value
    return out


def _callbacks(preset: MemoryPreset, given: Mapping[str, Any]) -> list[Any]:
    """Yours first, then the preset's; one of yours of a type the preset adds replaces the preset's."""
    yours = given.get("callbacks") or []
    yours = list(yours) if isinstance(yours, (list, tuple)) else [yours]
    kinds = [kind for kind, _ in preset_callbacks(preset)]
    replaced = tuple(kind for kind in kinds if any(isinstance(c, kind) for c in yours))
    for kind in replaced:
        if kind.__name__ not in preset._said:
            preset._said.add(kind.__name__)
            rank_zero_info(f"MemoryPreset {preset.name!r}: your {kind.__name__} is used instead of the preset's.")
    return [*yours, *preset.callbacks(exclude=replaced)]


def build_trainer_kwargs(preset: MemoryPreset, trainer_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``preset.trainer_kwargs(**trainer_kwargs)``: see :meth:`MemoryPreset.trainer_kwargs`."""
    out: dict[str, Any] = dict(trainer_kwargs)
    precision = _precision_kwargs(preset, trainer_kwargs)
    if "plugins" in precision:
        out.pop("precision", None)  # MemoryPrecision decides (a `precision=None` of yours said nothing)
    out.update(precision)
    out.update(_pinned_kwargs(preset, trainer_kwargs))
    out.update(_world_kwargs(preset, trainer_kwargs))
    out["callbacks"] = _callbacks(preset, trainer_kwargs)
    return out


def merge_trainer_config(preset: MemoryPreset, trainer_config: Mapping[str, Any]) -> dict[str, Any]:
    """``preset.merge_trainer_config(trainer_config)``: see :meth:`MemoryPreset.merge_trainer_config`."""
    if not isinstance(trainer_config, Mapping):
        raise ValueError(
            f"`trainer_config` must be a mapping of Trainer arguments (such as LightningCLI's `trainer` section),"
            f" got {trainer_config!r} ({type(trainer_config).__name__}). For keyword arguments use"
            " `trainer_kwargs(**kwargs)`."
        )
    defaults = _trainer_defaults()
    given = dict(trainer_config)
    at_default = {
        key: given.pop(key)
        for key in PRESET_TRAINER_KEYS
        if key in given and key in defaults and _same(given[key], defaults[key])
    }
    out = build_trainer_kwargs(preset, given)
    for key, value in at_default.items():
        out.setdefault(key, value)
    return out
