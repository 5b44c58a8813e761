"""Where the example plugs lightning-memopt in: ``MemoryPreset`` for the Trainer kwargs, and the callbacks."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

__all__ = ["CHECKPOINT_MODULES", "memory_callbacks", "memory_trainer_kwargs"]

#: Blocks recomputed in backward when the preset turns gradient checkpointing on (``max-savings``): the per-frame
#: MLP holds the largest activations (batch x frames x hidden).
CHECKPOINT_MODULES = ("video_tower.frame_mlp", "text_tower.mlp")
_PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}


def _accumulation(args: argparse.Namespace) -> int:
    per_step = args.batch_size * args.num_devices
    if args.effective_batch_size is None:
        return 1
    if args.effective_batch_size % per_step:
        raise SystemExit(
            f"error: `--effective_batch_size` {args.effective_batch_size} is not a multiple of --batch_size x "
            f"--num_devices = {per_step}. Pick an effective batch that is, or change --batch_size."
        )
    return args.effective_batch_size // per_step


def memory_trainer_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Wiring point of ``MemoryPreset``: the Trainer kwargs that decide precision and gradient accumulation.

    The preset keeps the effective batch (``--effective_batch_size``) while the micro-batch is ``--batch_size`` and
    picks the precision (``MemoryPrecision``: bf16/fp16 AMP on GPUs, fp32 on CPU) and, with ``max-savings``,
    checkpoints ``CHECKPOINT_MODULES``. ``--precision`` wins over the preset's choice. The preset's own monitoring
    callbacks are left out: ``memory_callbacks`` adds them with this script's settings.
    """
    from lightning_memopt import MemoryPreset

    accumulate = _accumulation(args)
    precision = None if args.precision is None else _PRECISION_ALIASES.get(str(args.precision), str(args.precision))
    if args.preset == "none":
        return {"accumulate_grad_batches": accumulate, "precision": precision or "32-true"}
    overrides: dict[str, Any] = {
        "monitor": False,
        "cache_clean_on_phase_end": False,
        "gc_every_n_train_steps": 0,
        "checkpoint_modules": CHECKPOINT_MODULES,
    }
    if precision is not None:
        overrides["precision"] = precision
    try:
        effective = args.batch_size * args.num_devices * accumulate
        preset = MemoryPreset.from_name(
            args.preset,
            effective_batch_size=effective,
            micro_batch_size=args.batch_size,
            devices=args.num_devices,
            **overrides,
        )
    except ValueError as err:
        raise SystemExit(f"error: {err}") from err
    kwargs = preset.trainer_kwargs()
    for key in ("devices", "num_nodes"):  # the script passes these itself (same values)
        kwargs.pop(key, None)
    return kwargs


def memory_callbacks(args: argparse.Namespace, memory_dir: Path) -> list[Callback]:
    """Wiring point of the package's callbacks (all on by default; ``--no_memory_callbacks`` removes them)."""
    if args.no_memory_callbacks:
        return []
    import lightning_memopt as lm

    return [
        lm.MemoryMonitor(dirpath=memory_dir, log_every_n_steps=args.memory_log_every_n_steps),
        lm.CacheCleaner(every_n_train_steps=50),
        lm.GarbageCollector(every_n_train_steps=25, generation=1),
        lm.OOMReporter(dirpath=memory_dir),
        lm.MemoryAudit(dirpath=memory_dir),
    ]
