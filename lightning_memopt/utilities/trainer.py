"""Small facts about a running Trainer, resolved once in ``setup``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["default_artifact_dir", "log_to_loggers", "phase_of_stage", "trainer_device"]

_STAGE_TO_PHASE = {"fit": "train", "validate": "validate", "test": "test", "predict": "predict"}


def phase_of_stage(stage: str) -> str:
    """Map a Lightning stage (``fit``, ``validate``, ...) to the phase word used in records."""
    return _STAGE_TO_PHASE.get(stage, stage)


def default_artifact_dir(trainer: pl.Trainer, subdir: str) -> Path:
    """``<trainer.log_dir or default_root_dir>/<subdir>``: where callbacks put their files by default."""
    base = None
    try:
        base = trainer.log_dir
    except Exception:  # some loggers raise while being set up
        base = None
    return Path(base or trainer.default_root_dir) / subdir


def trainer_device(trainer: pl.Trainer) -> torch.device:
    """The device this rank trains on (``trainer.strategy.root_device``)."""
    try:
        return torch.device(trainer.strategy.root_device)
    except Exception:
        return torch.device("cpu")


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def log_to_loggers(trainer: pl.Trainer, metrics: dict[str, float], warn: Any, who: str) -> None:
    """Send ``metrics`` to every logger of ``trainer`` from rank zero, at ``trainer.global_step``.

    A logger that fails gets one warning through ``warn`` (a :class:`~lightning_memopt.utilities.warnings.WarnOnce`)
    and training goes on.
    """
    if not metrics or trainer.global_rank != 0:
        return
    for logger in trainer.loggers:
        try:
            logger.log_metrics(metrics, step=trainer.global_step)
        except Exception as err:
            warn.warn(f"logger-{type(logger).__name__}", f"{who}: logging to {type(logger).__name__} failed ({err!r}).")
