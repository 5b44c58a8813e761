"""Small facts about a running Trainer, resolved once in ``setup``."""

from __future__ import annotations

import functools
import os
import socket
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["ARTIFACT_SUBDIR", "default_artifact_dir", "host_name", "log_to_loggers", "trainer_device"]

#: The folder, under the trainer's log directory, of every file the package writes by default.
ARTIFACT_SUBDIR = "memopt"


def default_artifact_dir(trainer: pl.Trainer, communicate: bool = True) -> str:
    """``<trainer.log_dir or default_root_dir>/memopt``: the default ``dirpath`` of every writer.

    ``MemoryMonitor`` and ``MemoryAudit`` (``memory_rank{r}.jsonl``) and ``OOMReporter`` (``oom_report_rank{r}.*``)
    write there side by side. Resolve it in ``setup``: ``trainer.log_dir`` broadcasts under DDP. Where only one
    rank runs (``on_exception``) pass ``communicate=False``: ``trainer.log_dir`` is not read then.

    Examples:
        >>> from types import SimpleNamespace
        >>> default_artifact_dir(SimpleNamespace(log_dir="logs/version_0", default_root_dir="."))
        'logs/version_0/memopt'
        >>> default_artifact_dir(SimpleNamespace(log_dir=None, default_root_dir="root"))
        'root/memopt'
    """
    base = None
    if communicate:
        try:
            base = trainer.log_dir
        except Exception:  # some loggers raise while being set up
            base = None
    return os.path.join(base or trainer.default_root_dir, ARTIFACT_SUBDIR)


def trainer_device(trainer: pl.Trainer) -> torch.device:
    """The device this rank trains on (``trainer.strategy.root_device``)."""
    try:
        return torch.device(trainer.strategy.root_device)
    except Exception:
        return torch.device("cpu")


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


@functools.cache
def host_name() -> str:
    """This machine's name (``socket.gethostname()``, looked up once), written with the node rank into memory logs,
    OOM reports and errors so that the ranks of several nodes can be told apart."""
    return socket.gethostname()
