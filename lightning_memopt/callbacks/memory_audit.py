"""MemoryAudit: where the memory goes before the first step, duplicate model copies, and step-over-step leaks."""

from __future__ import annotations

import os
from functools import cached_property
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightning_memopt.callbacks._memory_log import RankLogCallback, position
from lightning_memopt.functional.audit.leaks import Growth, LeakSampler
from lightning_memopt.functional.audit.loaders import LoaderMemory, fit_loaders, named_loaders
from lightning_memopt.functional.audit.session import AuditSession
from lightning_memopt.functional.readings.memory import DeviceMemory, MemoryReading
from lightning_memopt.functional.readings.monitoring import position_record
from lightning_memopt.utilities.checks import check_bool, check_fraction, check_path, check_positive_int
from lightning_memopt.utilities.formatting import wrap_to_width
from lightning_memopt.utilities.namespaces import rank_zero_info
from lightning_memopt.utilities.quiet import note_inactive, report_inactive
from lightning_memopt.utilities.trainer import log_to_loggers, trainer_device
from lightning_memopt.utilities.warnings import WarnOnce, log

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["MemoryAudit"]

_FLAGS = ("audit_fit_start", "detect_leaks", "check_grad_tracking", "collect_garbage", "audit_dataloaders", "verbose")
_OVERHEAD_HINT = "Use e.g. 0.01 for 1 % of the training time, or None for a fixed interval."
_DUPLICATE_HINT = "Use e.g. 0.5 to warn at half a copy."


class MemoryAudit(RankLogCallback):
    """Audits what is in memory: the model's footprint, stray copies of its weights, leaks and wasteful loaders.

    * **Footprint** at fit start and after the first optimizer step: parameters, buffers, gradients and optimizer
      states by dtype and device, allocated bytes they do not explain, and live tensors nothing in the model owns.
    * **Duplicate copies**: unowned live tensors on the training device that mirror the parameters (shape and
      values up to bf16 rounding); one warning, saying where they are held, when they add up to at least
      ``duplicate_fraction`` of the parameters' elements.
    * **Leaks**: every ``leak_every_n_train_steps`` optimizer steps, the module's attributes holding more tensors
      with autograd history at every sample, then allocated bytes (on CPU: live tensor bytes, within
      ``leak_max_overhead``); one warning when ``leak_window`` samples rise steadily.
    * **Grad tracking**: ``validation_step`` outputs with autograd history or grad left on; metric states that
      require grad. **DataLoaders**: their host memory and wasteful settings, each with its fix.

    What it finds warns (from this package's modules, so ``filterwarnings(module="lightning_memopt")`` reaches it);
    a clean audit prints nothing unless ``verbose``. A failing check warns once; training goes on. Records go to
    ``<dirpath>/memory_rank{rank}.jsonl`` (shared with ``MemoryMonitor``); each check, its records and cost in
    detail: ``docs/memory-log.md``. The work is done by a Trainer-free
    :class:`~lightning_memopt.functional.audit.session.AuditSession`; this callback picks the steps and writes the
    records.

    Args:
        dirpath: Directory of the JSONL files, kept as a ``str``. Default (resolved in ``setup``): the directory
            shared by the package's writers under ``trainer.log_dir`` (or ``default_root_dir``).
        duplicate_fraction: Fraction in (0, 1] of the parameters' elements that unowned copies must mirror before
            a duplicate warning.
        leak_every_n_train_steps: Optimizer steps (``trainer.global_step``, as ``ModelCheckpoint`` counts them)
            between leak samples; also the interval of the metric-state check and, in validation batches, of the
            output check.
        leak_window: Samples judged together (at least 3): growth must last ``leak_window`` samples.
        leak_min_bytes_per_step: Growth per optimizer step below which nothing is reported (1: any sustained growth).
        audit_fit_start: Whether to audit the footprint and duplicates at fit start and after the first step.
        detect_leaks: Whether to sample for leaks.
        check_grad_tracking: Whether to run the grad-tracking checks.
        max_listed: How many of the largest unowned tensors / duplicate copies each record lists.
        collect_garbage: Whether to free unreachable objects before each of the two audits: one full
            ``gc.collect()``, run when the audit sees a tensor on the device that neither the model, its optimizers
            nor the current batch and step outputs hold (only such a tensor can be garbage that changes a finding).
        leak_max_overhead: Fraction of training time the CPU leak samples' object walks may take; ``None``: sample
            every ``leak_every_n_train_steps`` whatever it costs.
        audit_dataloaders: Whether to report the DataLoaders' host memory and wasteful settings, how much of the
            first training and validation batch is padding (from its padding masks), and a ``max_length`` far above
            the length 99 % of the first 16 training batches' samples fit in.
        verbose: Whether to print the footprint table at fit start and after the first step, and each DataLoader's
            host memory; otherwise they go to the ``lightning_memopt`` logger at INFO (its records, in the log file,
            are written either way).

    Logged metrics (rank zero, once at fit start, bytes):
        ``memory/audit/{parameters,buffers,gradients,optimizer_states}_bytes``,
        ``memory/audit/unexplained_bytes`` (devices with allocator readings), ``memory/audit/duplicate_bytes``.

    Device: every check runs on CPU too (leak samples then count live tensor bytes); allocated bytes the model does
    not explain need allocator readings (CUDA). With every check off it notes itself inactive in the one line per
    fit (:mod:`lightning_memopt.utilities.quiet`).

    Examples:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[MemoryAudit(leak_every_n_train_steps=50)], logger=False)
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        duplicate_fraction: float = 0.5,
        leak_every_n_train_steps: int = 10,
        leak_window: int = 10,
        leak_min_bytes_per_step: int = 1,
        audit_fit_start: bool = True,
        detect_leaks: bool = True,
        check_grad_tracking: bool = True,
        max_listed: int = 5,
        collect_garbage: bool = True,
        leak_max_overhead: float | None = 0.01,
        audit_dataloaders: bool = True,
        verbose: bool = False,
    ) -> None:
        check_path("dirpath", dirpath)
        check_positive_int("leak_every_n_train_steps", leak_every_n_train_steps)
        check_positive_int("leak_window", leak_window)
        leak_max_overhead = check_fraction("leak_max_overhead", leak_max_overhead, allow_none=True, hint=_OVERHEAD_HINT)
        sampler = LeakSampler(leak_window, leak_min_bytes_per_step, leak_max_overhead)  # checks window and bytes
        check_positive_int("max_listed", max_listed)
        flags = (audit_fit_start, detect_leaks, check_grad_tracking, collect_garbage, audit_dataloaders, verbose)
        for name, flag in zip(_FLAGS, flags):
            check_bool(name, flag)
        self.dirpath = dirpath  # stored as a str (the shared base), as ModelCheckpoint keeps it
        self.duplicate_fraction = check_fraction("duplicate_fraction", duplicate_fraction, hint=_DUPLICATE_HINT)
        self.leak_every_n_train_steps, self.leak_window = leak_every_n_train_steps, leak_window
        self.leak_min_bytes_per_step, self.leak_max_overhead = leak_min_bytes_per_step, leak_max_overhead
        self.audit_fit_start, self.detect_leaks, self.check_grad_tracking = flags[:3]
        self.max_listed, self.collect_garbage, self.audit_dataloaders = max_listed, collect_garbage, audit_dataloaders
        self.verbose = verbose
        self._warn = WarnOnce()  # failures of the audit itself: once per instance
        self._session = AuditSession(DeviceMemory("cpu"), sampler, self.duplicate_fraction, max_listed, collect_garbage)
        self._active = any(flags[:3]) or audit_dataloaders
        self._last_sampled_step = -1
        self._first_step_audited = False
        self._next_sample_step = leak_every_n_train_steps

    @cached_property
    def state_key(self) -> str:  # read by Lightning on every hook call: built once
        return self._generate_state_key(dirpath=self.dirpath)

    @property
    def loaders(self) -> list[LoaderMemory]:
        """The DataLoader audit of the last fit: one :class:`~lightning_memopt.functional.audit.loaders.LoaderMemory`
        each."""
        return self._session.loaders

    @property
    def last_audit(self) -> dict[str, Any] | None:
        """The last audit record written (``fit_start`` or ``first_step``), for inspection."""
        return self._session.last_audit

    @property
    def leak(self) -> Growth | None:
        """The leak verdict that was warned about, if any."""
        return self._session.leak

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not self._active:
            note_inactive(trainer, "MemoryAudit", "every check is off")
            return
        self._session.memory = DeviceMemory(trainer_device(trainer))
        self._session.rank = trainer.global_rank
        self._open_log(trainer, "MemoryAudit")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        report_inactive(trainer)  # the one line about every inactive callback, whichever reaches here first
        # every fit reports its own findings; a resumed run keeps its leak window (see `state_dict`)
        self._session.new_fit(resumed=trainer.global_step > 0)
        self._last_sampled_step = -1
        self._first_step_audited = False
        every = self.leak_every_n_train_steps
        self._next_sample_step = (trainer.global_step // every + 1) * every
        if self.audit_fit_start:
            self._guarded("audit", self._audit, trainer, pl_module, "fit_start")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.audit_dataloaders:
            limit_val = getattr(trainer, "limit_val_batches", 1)
            named = fit_loaders(trainer.train_dataloader, trainer.val_dataloaders, limit_val)
            self._guarded("dataloaders", self._session.start_loaders, named, self._emitter(trainer))

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if "train" in self._session.unmeasured:  # the first batch: how big the batches prepared ahead are
            self._guarded("dataloaders", self._measure_loader, trainer, "train", batch)
        if self.audit_dataloaders and not self._session.length_sample.done:  # the first batches' lengths
            self._guarded("dataloaders", self._session.sample_lengths, batch, self._emitter(trainer))

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._session.unmeasured and trainer.state.fn == "fit":
            val = named_loaders("val", trainer.val_dataloaders)
            if dataloader_idx < len(val):
                self._guarded("dataloaders", self._measure_loader, trainer, val[dataloader_idx][0], batch)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step, session = trainer.global_step, self._session
        if step == self._last_sampled_step or step == 0:
            return  # no optimizer step since the last look (gradient accumulation), or none yet
        self._last_sampled_step = step
        if self.audit_fit_start and not self._first_step_audited:
            self._first_step_audited = True
            self._guarded("audit", self._audit, trainer, pl_module, "first_step", (batch, outputs))
        if self.detect_leaks and not session.leak_reported and step >= self._next_sample_step:
            self._next_sample_step = step + self.leak_every_n_train_steps
            # The common cause first, on every device and cheaply: attributes of the module that keep tensors
            # with autograd history, more of them every step. The full walk (CPU) waits for its time budget.
            self._guarded("leak", session.holder_sample, pl_module, step, batch_idx, self._emitter(trainer))
            if not session.leak_reported and session.sampler.due(session.memory.has_device_memory):
                self._guarded("leak", session.leak_sample, pl_module, step, batch_idx, self._emitter(trainer))
        if step % self.leak_every_n_train_steps == 0 and self.check_grad_tracking:
            self._guarded("metric-states", session.check_metric_states, pl_module)

    @override
    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.check_grad_tracking and batch_idx % self.leak_every_n_train_steps == 0:
            self._guarded("validation-grad", self._session.check_validation_outputs, outputs, batch_idx)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.check_grad_tracking:
            self._guarded("metric-states", self._session.check_metric_states, pl_module)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._session.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the leak samples; a bad or missing value (harmless: the window fills again) warns, starts fresh."""
        self._session.load_state_dict(state_dict, "MemoryAudit")

    # ---------------------------------------------------------------- internals
    def _guarded(self, key: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as err:
            self._warn.warn(f"failed-{key}", f"MemoryAudit: the {key} check failed ({err!r}); training goes on.")

    def _say(self, text: str) -> None:
        """A routine report: printed (rank zero, each line within the width) when ``verbose``, else logged at INFO."""
        if not self.verbose:
            log.info(text)
            return
        rank_zero_info(wrap_to_width(text))

    def _emitter(self, trainer: pl.Trainer) -> Any:
        """``emit(reading, event, batch_idx, **keys)`` for the session: writes one record of this rank, returns it."""

        def emit(reading: MemoryReading, event: str, batch_idx: int | None, **keys: Any) -> dict[str, Any]:
            at = position(trainer, batch_idx)
            record = position_record(reading, self._session.rank, "train", event, at, **keys)
            self._write([record])
            return record

        return emit

    def _audit(self, trainer: pl.Trainer, pl_module: pl.LightningModule, when: str, alive: Any = None) -> None:
        optimizers = list(getattr(trainer, "optimizers", []) or [])
        precision = getattr(trainer, "precision", None)
        precision = None if precision is None else str(precision)
        emit = self._emitter(trainer)
        result = self._session.audit(pl_module, optimizers, when, emit, precision=precision, alive=alive)
        self._say(result.text(when))
        if when == "fit_start" and trainer.global_rank == 0 and trainer.loggers:
            log_to_loggers(trainer, result.metrics(self._session.warn_duplicates), self._warn, "MemoryAudit")

    def _measure_loader(self, trainer: pl.Trainer, name: str, batch: Any) -> None:
        info = self._session.measure_loader(name, batch, self._emitter(trainer))
        if info is not None and trainer.global_rank == 0:
            self._say(f"MemoryAudit: DataLoader {info.summary()}")
