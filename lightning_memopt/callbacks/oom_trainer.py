"""What ``OOMReporter`` reads from the Trainer at a failure, as the plain values ``functional.oom`` takes.

Attribute reads only: nothing here communicates with other ranks (``on_exception`` runs on the failing rank
alone). A read that fails raises; ``build_oom_report``'s guard lists it in the report's ``report_errors``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_memopt.functional.oom.report import TrainerPosition, TrainerSettings

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["trainer_optimizers", "trainer_position", "trainer_settings"]


def trainer_position(trainer: pl.Trainer) -> TrainerPosition:
    """Rank, world size, trainer function and stage, epoch and global step."""
    state = trainer.state
    return {
        "rank": trainer.global_rank,
        "local_rank": trainer.local_rank,
        "node_rank": trainer.node_rank,
        "world_size": trainer.world_size,
        "fn": None if state.fn is None else str(state.fn.value),
        "stage": None if state.stage is None else str(state.stage.value),
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
    }


def trainer_settings(trainer: pl.Trainer) -> TrainerSettings:
    """Precision, accumulation, world size, strategy and accelerator (class names), devices and nodes."""
    return {
        "accumulate_grad_batches": int(trainer.accumulate_grad_batches),
        "world_size": int(trainer.world_size),
        "precision": str(trainer.precision),
        "strategy": type(trainer.strategy).__name__,
        "accelerator": type(trainer.accelerator).__name__,
        "num_devices": trainer.num_devices,
        "num_nodes": trainer.num_nodes,
        "device_ids": str(list(trainer.device_ids)),
    }


def trainer_optimizers(trainer: pl.Trainer) -> list[Any]:
    """The trainer's optimizers (none before they are configured)."""
    return list(getattr(trainer, "optimizers", []) or [])
