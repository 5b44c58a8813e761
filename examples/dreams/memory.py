"""How ``examples/dreams/train.py`` wires lightning-memopt: a ``MemoryPreset`` merged into the Trainer's arguments.

The preset keeps the effective batch and decides the micro-batch, the accumulation, the precision and its callbacks;
the script's own memory callbacks (:func:`memory_callbacks`) go in as the user's callbacks and replace the preset's
of the same type, as the preset documents.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from examples.dreams.args import DEFAULT_BATCH_SIZE

__all__ = ["memory_callbacks", "preset_trainer_kwargs"]


def _precision_mode(train_precision: str | int | None) -> str | None:
    from lightning_memopt.functional.precision import normalize_precision

    if train_precision is None:
        return None
    try:  # Lightning's names: 16 -> 16-mixed, bf16 -> bf16-mixed, 32 -> 32-true, 64 -> 64-true
        return normalize_precision(train_precision, "--train_precision")
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None


def preset_trainer_kwargs(
    preset: str = "auto",
    batch_size: int | None = None,
    num_devices: int = 1,
    effective_batch_size: int | None = None,
    accumulate_grad_batches: int | None = None,
    train_precision: str | int | None = None,
    gradient_checkpointing: bool = False,
    accelerator: str = "auto",
    auto_micro_batch: bool = False,
    trainer_config: Mapping[str, Any] | None = None,
    monitoring: bool = True,
) -> tuple[dict[str, Any], int, str]:
    """Wiring point of ``MemoryPreset``: ``preset.merge_trainer_config(trainer_config)`` for the command line.

    The preset keeps the effective batch (``effective_batch_size``; without it, ``batch_size`` x ``num_devices`` x
    ``accumulate_grad_batches`` as DreaMS users give it) and splits it into ``batch_size``-sample micro-batches and
    accumulation steps; without ``batch_size`` it picks the micro-batch itself (``max-savings`` aims at 4
    accumulation steps, ``balanced`` at 2). It picks the precision (``MemoryPrecision``: bf16/fp16 AMP on GPUs, fp32
    on CPU), TF32, allocator settings and gradient checkpointing. An explicit ``train_precision`` wins over the
    preset's choice. Callbacks in ``trainer_config`` of a type the preset adds replace the preset's;
    ``monitoring=False`` turns the preset's monitoring callbacks off. ``preset="none"``: every memory knob off, plain
    Lightning precision; only the batch split remains.

    With ``auto_micro_batch`` the effective batch is the same, but the DataLoader yields the whole per-device batch,
    ``accumulate_grad_batches`` is 1 and the preset's ``AutoMicroBatch`` splits each batch into micro-batches,
    starting at ``batch_size`` (the whole batch without it) and halving on out-of-memory.

    Returns:
        The Trainer kwargs (``trainer_config`` merged with the preset's ``plugins`` or ``precision``,
        ``accumulate_grad_batches``, ``callbacks`` and ``gradient_clip_val``), the DataLoader's batch size per device
        (the micro-batch, or the whole per-device batch with ``auto_micro_batch``), and the preset's name.
    """
    from lightning_memopt import MemoryPreset

    precision = _precision_mode(train_precision)
    config = dict(trainer_config or {})
    effective_batch_size, batch_size = _batch_split(
        effective_batch_size, batch_size, num_devices, accumulate_grad_batches, config
    )
    overrides: dict[str, Any] = {
        "effective_batch_size": effective_batch_size,
        "micro_batch_size": batch_size,
        "devices": num_devices,
        "auto_micro_batch": auto_micro_batch,
        **_knobs(preset, precision, gradient_checkpointing, monitoring),
    }
    on_gpu = accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
    try:  # a split of the effective batch that does not divide: the message names valid sizes
        if preset == "auto" and on_gpu:
            memory_preset = MemoryPreset.for_device(**overrides)  # by the GPU's size
        else:
            name = {"auto": "balanced", "none": "max-speed"}.get(preset, preset)
            memory_preset = MemoryPreset.from_name(name, **overrides)
        kwargs = memory_preset.merge_trainer_config(config)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from err
    if preset == "none" or precision == "64-true":  # Lightning's own precision instead of MemoryPrecision
        kwargs["plugins"] = [p for p in kwargs.get("plugins", []) if not isinstance(p, pl.plugins.Precision)]
        kwargs["precision"] = precision or "32-true"
    name = "none" if preset == "none" else memory_preset.name
    name += f" (tier {memory_preset.tier})" if memory_preset.tier else ""
    return kwargs, memory_preset.batch_size, name


def _batch_split(
    effective_batch_size: int | None,
    batch_size: int | None,
    num_devices: int,
    accumulate_grad_batches: int | None,
    config: dict[str, Any],
) -> tuple[int, int | None]:
    """The effective batch and the micro-batch from either flag style; an explicit accumulation with an effective
    batch goes into ``config``, where the preset checks it against its split."""
    from lightning_memopt.functional.presets import plan_accumulation

    if effective_batch_size is None:  # DreaMS-style flags: the micro-batch per device and the accumulation
        batch_size = batch_size or DEFAULT_BATCH_SIZE
        effective_batch_size = batch_size * num_devices * (accumulate_grad_batches or 1)
    elif accumulate_grad_batches is not None:  # checked against the preset's split
        config["accumulate_grad_batches"] = accumulate_grad_batches
    if batch_size is None and accumulate_grad_batches is not None:  # the micro-batch that gives that accumulation
        try:
            plan = plan_accumulation(
                effective_batch_size, None, num_devices, target_accumulation=accumulate_grad_batches
            )
        except ValueError as err:
            raise SystemExit(f"error: {err}") from err
        batch_size = plan.micro_batch_size
    return effective_batch_size, batch_size


def _knobs(preset: str, precision: str | None, gradient_checkpointing: bool, monitoring: bool) -> dict[str, Any]:
    """The preset fields the flags set: checkpointing, the monitoring callbacks, precision; all off for ``none``."""
    knobs: dict[str, Any] = {}
    if gradient_checkpointing:
        knobs["gradient_checkpointing"] = True
    if not monitoring or preset == "none":
        knobs.update(monitor=False, cache_clean_on_phase_end=False, gc_every_n_train_steps=0)
    if preset == "none":
        knobs.update(gradient_checkpointing=gradient_checkpointing, allocator_conf="", float32_matmul_precision="")
    elif precision is not None and precision != "64-true":
        knobs["precision"] = precision
    return knobs


def memory_callbacks(args: argparse.Namespace) -> list[Callback]:
    """Wiring point of the package's callbacks (all on by default; ``--no_memory_callbacks`` removes them).

    They write to ``<run directory>/memopt`` (``memory_rank<r>.jsonl``; OOM reports too, if one happens). Those of
    a type the preset also adds (``MemoryMonitor``, ``CacheCleaner``, ``GarbageCollector``) replace the preset's.
    """
    if args.no_memory_callbacks:
        return []
    import lightning_memopt as lm

    return [
        lm.MemoryMonitor(log_every_n_steps=args.memory_log_every_n_steps),
        lm.CacheCleaner(every_n_train_steps=50),
        lm.GarbageCollector(every_n_train_steps=25, generation=1),
        lm.OOMReporter(),
        lm.MemoryAudit(),
    ]
