"""One id per training run, shared by every callback and every rank, kept across a resume from a checkpoint.

Two runs that write to the same directory append to the same ``memory_rank{r}.jsonl``; the ``run_id`` field
of each record tells them apart, so a resumed run skips only the steps that *it* already wrote and a reader
can show the runs separately.

* :func:`ensure_run_id` is called from ``setup``, where every rank is present: rank zero's id is broadcast.
* :func:`run_id` only looks the id up; it never communicates, so it is safe on paths that run on one rank
  (``on_exception``).
* :func:`save_run_id` / :func:`adopt_run_id` put the id into a checkpoint and take it back when the run
  resumes (``on_save_checkpoint`` / ``on_load_checkpoint``, which run before any training hook);
  :class:`RunIdCallback` is the base of the callbacks that write records and does both.
"""

from __future__ import annotations

import uuid
import weakref
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightning_memopt.utilities.namespaces import Callback

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["CHECKPOINT_KEY", "RunIdCallback", "adopt_run_id", "ensure_run_id", "run_id", "save_run_id"]

#: Where a checkpoint keeps the run id.
CHECKPOINT_KEY = "lightning_memopt_run_id"

_RUN_IDS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def ensure_run_id(trainer: pl.Trainer) -> str:
    """The run id of ``trainer``, made on first use and broadcast from rank zero. Call only where all ranks are."""
    current = _RUN_IDS.get(trainer)
    if current is not None:
        return current
    new = uuid.uuid4().hex[:12]
    if int(getattr(trainer, "world_size", 1) or 1) > 1:
        new = str(trainer.strategy.broadcast(new))
    _RUN_IDS[trainer] = new
    return new


def run_id(trainer: pl.Trainer) -> str | None:
    """The run id of ``trainer`` if one was made; never communicates.

    Examples:
        >>> class T: world_size = 1
        >>> t = T()
        >>> run_id(t) is None, ensure_run_id(t) == run_id(t), len(run_id(t))
        (True, True, 12)
    """
    return _RUN_IDS.get(trainer)


def save_run_id(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
    """Store the run id in ``checkpoint`` (from ``on_save_checkpoint``)."""
    current = _RUN_IDS.get(trainer)
    if current is not None:
        checkpoint[CHECKPOINT_KEY] = current


def adopt_run_id(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
    """Continue the run whose checkpoint is being loaded (from ``on_load_checkpoint``): take its id."""
    stored = checkpoint.get(CHECKPOINT_KEY)
    if isinstance(stored, str) and stored:
        _RUN_IDS[trainer] = stored


class RunIdCallback(Callback):
    """Base of the callbacks that write records: keeps the run id in checkpoints and takes it back on resume."""

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        save_run_id(trainer, checkpoint)

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        adopt_run_id(trainer, checkpoint)
