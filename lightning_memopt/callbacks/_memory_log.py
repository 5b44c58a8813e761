"""What the writers share: ``dirpath`` (all of them), the per-rank log writer, positions and guarded readings.

:class:`ArtifactCallback` is the base of every callback that writes files (``MemoryMonitor``, ``MemoryAudit``,
``OOMReporter``): one way to store ``dirpath`` and one default. :class:`RankLogCallback` adds the JSONL log that
``MemoryMonitor`` and ``MemoryAudit`` share.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from typing_extensions import override

from lightning_memopt.analysis import MemoryLogError, iter_memory_records
from lightning_memopt.functional.readings.memory import MemoryReading
from lightning_memopt.functional.readings.monitoring import MemoryReader, Position
from lightning_memopt.utilities.jsonl import JsonlWriter, rank_log_writer
from lightning_memopt.utilities.run_id import RunIdCallback, ensure_run_id, run_id
from lightning_memopt.utilities.trainer import default_artifact_dir, host_name
from lightning_memopt.utilities.warnings import WarnOnce

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "ArtifactCallback",
    "GuardedReader",
    "RankLogCallback",
    "last_train_epoch",
    "last_train_step",
    "position",
]


class ArtifactCallback(RunIdCallback):
    """Base of the callbacks that write files under ``dirpath``.

    ``dirpath`` is stored as a ``str`` (``os.fspath`` of what was given, as Lightning's ``ModelCheckpoint``) or
    ``None``; ``None`` resolves in ``setup`` (:meth:`_resolve_dirpath`, where every rank is present) to
    :func:`~lightning_memopt.utilities.trainer.default_artifact_dir`:
    ``<trainer.log_dir or default_root_dir>/memopt``, one directory for the JSONL logs and the OOM reports.

    Examples:
        >>> from pathlib import Path
        >>> writer = ArtifactCallback()
        >>> writer.dirpath = Path("logs") / "memory"
        >>> writer.dirpath
        'logs/memory'
    """

    _dirpath: str | None = None

    @property
    def dirpath(self) -> str | None:
        """The directory given by the user, as a ``str``; ``None``: the default, resolved in ``setup``."""
        return self._dirpath

    @dirpath.setter
    def dirpath(self, value: str | os.PathLike[str] | None) -> None:
        if value is None:
            self._dirpath = None
        else:
            self._dirpath = os.fspath(value)

    def _resolve_dirpath(self, trainer: pl.Trainer) -> Path:
        """``dirpath``, or the default directory when it is ``None``. Call from ``setup``: it may communicate."""
        if self.dirpath is not None:
            return Path(self.dirpath)
        return Path(default_artifact_dir(trainer))


class RankLogCallback(ArtifactCallback):
    """Base of the callbacks that write ``<dirpath>/memory_rank{rank}.jsonl``: one writer, opened in ``setup``
    (:meth:`_open_log`), closed at teardown and when training stops with an exception."""

    _writer: JsonlWriter | None = None

    @property
    def path(self) -> Path | None:
        """The JSONL file of this rank, known after ``setup``."""
        return None if self._writer is None else self._writer.path

    def _open_log(self, trainer: pl.Trainer, owner: str) -> None:
        self._writer = rank_log_writer(
            trainer, self._resolve_dirpath(trainer), trainer.global_rank, self._writer, owner
        )
        ensure_run_id(trainer)

    def _write(self, records: Iterable[dict[str, Any]]) -> None:
        for record in records:
            if self._writer is not None:
                self._writer.write(record)  # never raises: warns once and carries on

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._writer is not None:
            self._writer.close()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._writer is not None:
            self._writer.close()


class GuardedReader:
    """Reads through ``memory``; a failed reading warns once (as ``owner``) and gives ``None``: training goes on."""

    def __init__(self, memory: MemoryReader, warn: WarnOnce, owner: str) -> None:
        self.memory, self.warn, self.owner = memory, warn, owner

    def read(self) -> MemoryReading | None:
        try:
            return self.memory.read()
        except Exception as err:
            self.warn.warn("read", f"{self.owner}: reading memory failed ({err!r}); training goes on.")
            return None

    def reset_peaks(self) -> bool:
        return self.memory.reset_peaks()


def position(trainer: pl.Trainer, batch_idx: int | None, epoch: int | None = None) -> Position:
    """Where training is now (``epoch`` defaults to ``current_epoch``), on which node and host, for a record."""
    return Position(
        trainer.current_epoch if epoch is None else epoch,
        trainer.global_step,
        batch_idx,
        run_id(trainer),
        node_rank=trainer.node_rank,
        host=host_name(),
    )


def last_train_epoch(trainer: pl.Trainer) -> int:
    """The epoch of the last training batch: after the last epoch, ``current_epoch`` already counts one more."""
    try:
        started = int(cast(Any, trainer.fit_loop.epoch_progress.current).started)
    except (AttributeError, TypeError, ValueError):  # a trainer without a fit loop's progress: the current epoch
        return trainer.current_epoch
    return max(min(started - 1, trainer.current_epoch), 0)


def last_train_step(path: str | os.PathLike[str], run_id: str | None) -> int:
    """The highest train ``global_step`` that run ``run_id`` already recorded in ``path``; -1 if none or unreadable.

    A resumed run skips the steps up to this one, so no step of a run is written twice; records of another run that
    shares the file never count. The log is read by the one reader of its format,
    :func:`lightning_memopt.analysis.iter_memory_records`.

    Examples:
        >>> import tempfile
        >>> path = Path(tempfile.mkdtemp()) / "memory_rank0.jsonl"
        >>> _ = path.write_text(
        ...     '{"time": 1, "rank": 0, "run_id": "a", "phase": "train", "event": "step", "global_step": 4}\\n'
        ...     '{"time": 2, "rank": 0, "run_id": "b", "phase": "train", "event": "step", "global_step": 9}\\n'
        ... )
        >>> last_train_step(path, "a"), last_train_step(path, "c"), last_train_step(path.with_name("none"), "a")
        (4, -1, -1)
    """
    try:
        return max(
            (
                record["global_step"]
                for record in iter_memory_records(path)
                if record.get("run_id") == run_id
                and record["phase"] == "train"
                and record["event"] == "step"
                and isinstance(record.get("global_step"), int)
            ),
            default=-1,
        )
    except MemoryLogError:
        return -1
