"""MemoryMonitor: per-phase memory readings to Lightning loggers and to a per-rank JSONL file."""

from __future__ import annotations

import os
from functools import cached_property
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightning_memopt.callbacks._memory_log import (
    GuardedReader,
    RankLogCallback,
    last_train_epoch,
    last_train_step,
    position,
)
from lightning_memopt.callbacks._states import restore_state
from lightning_memopt.functional.readings.memory import DeviceMemory, MemoryReading
from lightning_memopt.functional.readings.monitoring import MonitorRecords, cross_rank_metrics, cross_rank_values
from lightning_memopt.utilities.checks import check_bool, check_fraction, check_path, check_positive_int
from lightning_memopt.utilities.formatting import format_bytes, wrap_to_width
from lightning_memopt.utilities.namespaces import rank_zero_only
from lightning_memopt.utilities.quiet import note_inactive, report_inactive
from lightning_memopt.utilities.run_id import run_id
from lightning_memopt.utilities.trainer import log_to_loggers, trainer_device
from lightning_memopt.utilities.warnings import WarnOnce, log

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["MemoryMonitor"]
_INTERVAL_HINT = "Pass None to use the trainer's `log_every_n_steps`."
_CROSS_HINT = "Pass None to never exchange readings between ranks."


def _phase_hooks(phase: str) -> tuple[Any, Any, Any]:
    """``on_<phase>_start``, ``on_<phase>_end`` and ``on_<phase>_batch_end`` of an evaluation phase."""

    def start(self: MemoryMonitor, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._phase_start(trainer, phase)

    def end(self: MemoryMonitor, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._phase_end(trainer, phase)

    def batch_end(
        self: MemoryMonitor, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int, idx: int = 0
    ) -> None:
        if (batch_idx + 1) % self._interval == 0:
            self._log_step(trainer, phase, batch_idx)

    return start, end, batch_end


class MemoryMonitor(RankLogCallback):
    """Reads device and host memory on an interval in every phase and writes it to loggers and JSONL.

    In each phase (``train``, ``validate``, ``test``, ``predict``) a reading is taken every ``log_every_n_steps``
    optimizer steps (train) or batches (other phases) and goes to every Lightning logger (from rank zero) and to
    ``<dirpath>/memory_rank{rank}.jsonl``, one file per rank (shared with ``MemoryAudit``). Peaks are per phase: a
    nested phase (validation inside fit) has its own. A warning (once per crossing, on the rank that crosses, also
    written as a record) says when allocated or reserved memory goes above ``warn_threshold`` of the device total.
    It never calls ``torch.cuda.synchronize()`` and runs no collective on steps it does not log. The records,
    resuming, file failures and cost: ``docs/memory-log.md``.

    Args:
        dirpath: Directory of the JSONL files. Default: ``<trainer.log_dir or default_root_dir>/memopt``,
            resolved in ``setup`` (the same directory as ``MemoryAudit``'s records and ``OOMReporter``'s reports).
        log_every_n_steps: Reading interval: optimizer steps (``trainer.global_step``) in training, batches in the
            other phases. Default: the trainer's ``log_every_n_steps``.
        warn_threshold: Fraction of the device total in (0, 1] above which a warning is emitted.
        log_to_loggers: Whether to send readings to the trainer's loggers.
        cross_rank_every_n_train_steps: With several ranks, on the logged optimizer steps that are also a multiple
            of this (with 5 and 2: steps 10, 20, 30...) the ranks exchange their readings (one ``all_gather`` of
            three numbers) and rank zero logs their min, max and mean. ``None`` (default) never communicates.
        verbose: Also print each phase's peak memory at its end (rank zero, through the ``lightning_memopt``
            logger).

    Logged metrics (bytes unless the name says otherwise; ``<phase>`` is train/validate/test/predict):
        * ``memory/<phase>/allocated_bytes``, ``reserved_bytes``, ``active_bytes``, ``device_free_bytes``,
          ``host_rss_bytes``, ``num_alloc_retries`` (count), ``num_ooms`` (count): every logged step.
        * ``memory/<phase>/peak_allocated_bytes``, ``memory/<phase>/peak_reserved_bytes``: once, at the phase end.
        * ``memory/train/{allocated,reserved,host_rss}_bytes_{min,max,mean}``: with ``cross_rank_every_n_train_steps``.

    Device requirements: CUDA (and XPU) give every field; MPS gives allocated/reserved bytes and the recommended
    maximum; on CPU only ``host_rss_bytes`` is known and the rest is ``null`` (the fit's one line about
    inactive callbacks says so).

    Examples:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[MemoryMonitor(log_every_n_steps=10)], logger=False)
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        log_every_n_steps: int | None = None,
        warn_threshold: float = 0.9,
        log_to_loggers: bool = True,
        cross_rank_every_n_train_steps: int | None = None,
        verbose: bool = False,
    ) -> None:
        check_path("dirpath", dirpath)
        check_positive_int("log_every_n_steps", log_every_n_steps, allow_none=True, hint=_INTERVAL_HINT)
        check_fraction("warn_threshold", warn_threshold)
        check_bool("log_to_loggers", log_to_loggers)
        check_bool("verbose", verbose)
        check_positive_int(
            "cross_rank_every_n_train_steps", cross_rank_every_n_train_steps, allow_none=True, hint=_CROSS_HINT
        )
        self.dirpath = dirpath
        self.log_every_n_steps = log_every_n_steps
        self.warn_threshold = float(warn_threshold)
        self.log_to_loggers = log_to_loggers
        self.cross_rank_every_n_train_steps = cross_rank_every_n_train_steps
        self.verbose = verbose

        self._warn = WarnOnce()
        self._reader = GuardedReader(DeviceMemory("cpu"), self._warn, "MemoryMonitor")
        self._core = MonitorRecords(self._reader, rank=0, warn_threshold=self.warn_threshold)
        self._interval = 1
        self._world_size = 1
        self._last_logged_train_step = -1
        self._skip_until_step = -1

    @cached_property
    def state_key(self) -> str:  # read by Lightning on every hook call: built once
        return self._generate_state_key(dirpath=self.dirpath)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        device = trainer_device(trainer)
        self._reader.memory = memory = DeviceMemory(device)
        self._interval = self.log_every_n_steps or max(1, int(getattr(trainer, "log_every_n_steps", 1) or 1))
        self._core.rank = trainer.global_rank
        self._world_size = trainer.world_size
        self._open_log(trainer, "MemoryMonitor")
        if not memory.has_device_memory:
            note_inactive(trainer, "MemoryMonitor", f"no allocator readings on {device.type}, host RSS only")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        report_inactive(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        self._core.phases.clear()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A resumed run starts at global_step > 0: steps this run already wrote are not written again.
        self._skip_until_step = -1
        if trainer.global_step > 0 and self._writer is not None:
            self._skip_until_step = last_train_step(self._writer.path, run_id(trainer))
        self._phase_start(trainer, "train")

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._phase_end(trainer, "train")

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_logged_train_step or step % self._interval != 0 or step == 0:
            return  # not an optimizer step boundary on the interval (or already logged: gradient accumulation)
        self._last_logged_train_step = step
        if step > self._skip_until_step:
            self._log_step(trainer, "train", batch_idx)
        if (
            self.cross_rank_every_n_train_steps
            and self._world_size > 1
            and step % self.cross_rank_every_n_train_steps == 0
        ):
            self._cross_rank(trainer)

    # The other phases: a reading at their start and end, and every `_interval` batches.
    on_validation_start, on_validation_end, on_validation_batch_end = _phase_hooks("validate")
    on_test_start, on_test_end, on_test_batch_end = _phase_hooks("test")
    on_predict_start, on_predict_end, on_predict_batch_end = _phase_hooks("predict")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_logged_train_step": self._last_logged_train_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_logged_train_step = restore_state("MemoryMonitor", state_dict)["last_logged_train_step"]

    def record_event(
        self, trainer: pl.Trainer, event: str, batch_idx: int | None = None, phase: str = "train", **fields: Any
    ) -> None:
        """Write a record of another callback's event (``AutoMicroBatch``'s ``micro_batch``) to this rank's log.

        The record holds a memory reading taken now, where in the run (``phase``) it happened and ``fields``. Runs on
        the calling rank only and never communicates; never raises (a failure warns once and training goes on).
        Does nothing before ``setup`` or after ``teardown``.
        """
        if self._writer is None or self._writer.stopped:
            return
        try:
            reading = self._reader.read()
            if reading is not None:
                self._write([self._record(trainer, reading, phase, event, batch_idx, **fields)])
        except Exception as err:
            self._warn.warn("event", f"MemoryMonitor: writing a {event!r} record failed ({err!r}); training goes on.")

    # ---------------------------------------------------------------- internals
    def _record(
        self, trainer: pl.Trainer, reading: MemoryReading, phase: str, event: str, batch_idx: int | None, **extra: Any
    ) -> dict[str, Any]:
        return self._core.record(reading, phase, event, position(trainer, batch_idx), **extra)

    def _log_metrics(self, trainer: pl.Trainer, metrics: dict[str, float]) -> None:
        if self.log_to_loggers:
            log_to_loggers(trainer, metrics, self._warn, "MemoryMonitor")

    def _log_step(self, trainer: pl.Trainer, phase: str, batch_idx: int) -> None:
        records, metrics, warnings = self._core.step(phase, position(trainer, batch_idx))
        if not records:
            return  # the reading failed (warned once)
        self._write(records[:1])
        self._log_metrics(trainer, metrics)
        for message in warnings:  # the record keeps the message on one line; the console gets 100 columns
            log.warning(wrap_to_width(message))
        self._write(records[1:])  # one `warning` record per threshold crossing

    def _phase_start(self, trainer: pl.Trainer, phase: str) -> None:
        try:
            self._write(self._core.phase_start(phase, position(trainer, None)))
        except Exception as err:
            self._warn.warn("phase", f"MemoryMonitor: phase bookkeeping failed ({err!r}); training goes on.")

    def _phase_end(self, trainer: pl.Trainer, phase: str) -> None:
        try:
            epoch: int | None = None
            if phase == "train":
                epoch = last_train_epoch(trainer)
            at = position(trainer, None, epoch)
            records, metrics, reading, peaks = self._core.phase_end(phase, at)
            if reading is None:
                return
            self._write(records)
            self._log_metrics(trainer, metrics)
            if self.verbose and peaks.get("peak_allocated_bytes") is not None:
                rank_zero_only(log.info)(
                    f"MemoryMonitor: {phase} peak allocated {format_bytes(peaks['peak_allocated_bytes'])},"
                    f" peak reserved {format_bytes(peaks.get('peak_reserved_bytes'))} on {reading.device}."
                )
        except Exception as err:
            self._warn.warn("phase", f"MemoryMonitor: phase bookkeeping failed ({err!r}); training goes on.")

    def _cross_rank(self, trainer: pl.Trainer) -> None:
        if (reading := self._reader.read()) is None:
            return
        try:
            local = cross_rank_values(reading).to(trainer.strategy.root_device)
            metrics = cross_rank_metrics(trainer.strategy.all_gather(local))
        except Exception as err:
            self._warn.warn("cross-rank", f"MemoryMonitor: cross-rank exchange failed ({err!r}); training goes on.")
            return
        self._log_metrics(trainer, metrics)
