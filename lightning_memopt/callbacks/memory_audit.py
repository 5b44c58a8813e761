"""MemoryAudit: where the memory goes before the first step, duplicate model copies, and step-over-step leaks."""

from __future__ import annotations

import gc
import os
import re
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from lightning_memopt.functional.footprint import (
    Duplicates,
    Footprint,
    LiveTensor,
    StorageKey,
    find_duplicates,
    find_storage_holders,
    live_tensors,
    model_footprint,
    tensor_names,
    unexplained_bytes,
)
from lightning_memopt.functional.leaks import (
    GradFnHolder,
    Growth,
    detect_growth,
    grad_fn_holders,
    metric_states_requiring_grad,
    tensors_with_grad_fn,
)
from lightning_memopt.functional.loaders import LoaderMemory, batch_bytes, loader_memory
from lightning_memopt.functional.memory import MemoryReading, memory_record, read_memory, supports_device_memory
from lightning_memopt.utilities.checks import check_bool, check_fraction, check_path, check_positive_int
from lightning_memopt.utilities.formatting import format_bytes
from lightning_memopt.utilities.jsonl import JsonlWriter, rank_log_writer
from lightning_memopt.utilities.namespaces import rank_zero_info
from lightning_memopt.utilities.run_id import RunIdCallback, ensure_run_id, run_id
from lightning_memopt.utilities.trainer import trainer_device
from lightning_memopt.utilities.warnings import WarnOnce, log

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["MemoryAudit"]

_LEAK_CAUSES = (
    "tensors with autograd history kept in a list or attribute (e.g. `self.losses.append(loss)`; append"
    " `loss.detach()`), an undetached loss or output logged or stored outside `self.log`, or outputs accumulated"
    " across steps (keep `.detach().cpu()` copies and clear them at epoch end)"
)


class MemoryAudit(RunIdCallback):
    """Audits what is in memory: the model's footprint, stray copies of its weights, and leaks.

    * **Footprint at fit start** (model on its device, optimizers built): parameters, buffers, gradients and
      optimizer states, in bytes by dtype and device (storages shared by views and tied weights counted
      once; parameters are counted at their real dtype, bf16 as 2 bytes). Printed by rank zero, written to
      the JSONL file as an ``event="audit"`` record (``audit="fit_start"``), and again after the first
      optimizer step (``audit="first_step"``), when gradients and lazily created optimizer states exist.
      The record also holds ``unexplained_bytes``: allocated device bytes minus the footprint on the device
      (``null`` on CPU), and the bytes and largest entries of the live tensors on the device that nothing
      in the model or optimizers owns.
    * **Duplicate copies**: live tensors on the training device that the model and optimizers do not own but
      that mirror its parameters: a parameter's shape and its values up to bf16 rounding (a leftover fp32 copy
      of bf16 weights, a state dict loaded onto the device, a ``deepcopy``); a batch that merely has a
      weight's shape does not count. When they add up to at least ``duplicate_fraction`` of the
      parameters' elements, one warning gives their bytes, count, dtypes and the likely cause.
    * **Leaks**: every ``leak_every_n_steps`` optimizer steps, right after the optimizer step, on every device,
      a scan of the attributes of the LightningModule and its submodules (lists, tuples, dicts, deques
      included) for tensors with autograd history: an attribute that holds more of them at each of the last
      ``leak_window`` samples (``self.history.append(loss * x)``, the most common leak) is reported by name.
      Then one memory sample: allocated bytes of the device (CUDA/XPU/MPS), or on CPU the bytes of the live
      CPU tensors (one ``gc.get_objects()`` walk, stretched to stay within ``leak_max_overhead``). When the
      last ``leak_window`` samples rise steadily by at least ``leak_min_bytes_per_step`` per step, one warning
      names the growth per step, the step it was first seen and the usual causes, and lists the attributes
      that hold tensors with a ``grad_fn``.
    * **Grad tracking**: one warning when ``validation_step`` returns tensors with autograd history or
      leaves grad enabled, and one when metric states (torchmetrics) hold tensors that require grad.
    * **DataLoaders** (their settings at train start, before workers start; their bytes at each loader's first
      batch): the host memory each holds or will hold, ``num_workers x prefetch_factor`` batches prepared ahead
      plus their page-locked copies with ``pin_memory`` on CUDA; printed by rank zero and written as one
      ``event="dataloaders"`` record per loader. The dataset itself is never read. Settings that waste memory get
      one warning each,
      with the fix: more workers than CPU cores, batches prepared ahead over a quarter of the host's memory,
      ``pin_memory`` without a CUDA device to copy to, ``persistent_workers`` on a validation loader, and a
      dataset holding a Python container of 100,000+ objects under workers (copied page by page per worker).

    Nothing here stops training: an audit that fails (an object that breaks the garbage-collector walk, a
    file that cannot be written) warns once and training goes on. Per-step cost is one integer comparison
    on the steps between samples.

    Measured cost (``python benchmarks/callback_overhead.py``: CPU, one thread, 1.36M objects tracked by the
    garbage collector, 1,000-step fits at a 13.6 ms step): 0.35 s for the fit-start audit and 0.37 s for the
    first-step audit (each one full ``gc.collect()`` and one ``gc.get_objects()`` walk, 0.13 s), then 0.021 ms per
    step at the defaults: an attribute scan every 10 steps (0.09 ms each) and object walks held to 1 % of the
    training time by ``leak_max_overhead``. Large containers held by the module are looked at by their ends first,
    so a LightningModule that keeps a million-element dataset as an attribute adds under 1 ms per scan.

    Args:
        dirpath: Directory of the JSONL files (``memory_rank{rank}.jsonl``, shared with ``MemoryMonitor``).
            Default: ``<trainer.log_dir or default_root_dir>/memory``.
        duplicate_fraction: Fraction in (0, 1] of the parameters' elements that unowned same-shape tensors
            must mirror before a duplicate warning.
        leak_every_n_steps: Optimizer steps between leak samples.
        leak_window: Samples judged together (at least 3): growth must be sustained over
            ``leak_window * leak_every_n_steps`` steps.
        leak_min_bytes_per_step: Growth per optimizer step below which nothing is reported. The default
            reports any sustained growth: at the same point of each step a clean run holds exactly the same
            tensors, and a graph kept alive after ``backward`` costs little more than its output (4 bytes for
            a float32 loss; 512 on CUDA, the allocator's smallest block) since backward frees what it saved.
            Raise it to ignore growth you expect (e.g. predictions gathered over an epoch).
        audit_fit_start: Whether to take the footprint and look for duplicates at fit start and after the
            first optimizer step.
        audit_dataloaders: Whether to report the DataLoaders' host memory and wasteful settings at train start.
        detect_leaks: Whether to sample for leaks.
        check_grad_tracking: Whether to run the grad-tracking checks.
        max_listed: How many of the largest unowned tensors / duplicate copies each record lists.
        collect_garbage: Whether to run one full ``gc.collect()`` before each of the two audits, so that
            unreachable objects waiting for the collector (an old model in a reference cycle) are not
            reported as copies. Leak samples never collect.
        leak_max_overhead: On devices without allocator readings (CPU) a leak sample walks every Python object
            (``gc.get_objects()``, about 0.3 s per million objects on a laptop-class core); a sample that is due
            waits until the training time since the last walk is at least the last walk's time divided by this
            fraction, so the walks cost at most this fraction of training. ``None`` samples every
            ``leak_every_n_steps`` whatever it costs. Allocator samples (CUDA) cost microseconds and never wait.

    Logged metrics (rank zero, once at fit start, bytes):
        ``memory/audit/{parameters,buffers,gradients,optimizer_states}_bytes``,
        ``memory/audit/unexplained_bytes`` (devices with allocator readings), ``memory/audit/duplicate_bytes``.

    Device requirements: none. On CUDA, unexplained bytes and leak samples come from the caching
    allocator; on CPU the same duplicate and leak logic runs over host tensors.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[MemoryAudit(leak_every_n_steps=50)], logger=False)
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        duplicate_fraction: float = 0.5,
        leak_every_n_steps: int = 10,
        leak_window: int = 10,
        leak_min_bytes_per_step: int = 1,
        audit_fit_start: bool = True,
        detect_leaks: bool = True,
        check_grad_tracking: bool = True,
        max_listed: int = 5,
        collect_garbage: bool = True,
        leak_max_overhead: float | None = 0.01,
        audit_dataloaders: bool = True,
    ) -> None:
        check_path("dirpath", dirpath)
        check_fraction("duplicate_fraction", duplicate_fraction, hint="Use e.g. 0.5 to warn at half a copy.")
        check_positive_int("leak_every_n_steps", leak_every_n_steps)
        check_positive_int("leak_window", leak_window)
        if leak_window < 3:
            raise ValueError(f"`leak_window` must be at least 3 samples, got {leak_window}: growth needs a trend.")
        if (
            isinstance(leak_min_bytes_per_step, bool)
            or not isinstance(leak_min_bytes_per_step, int)
            or (leak_min_bytes_per_step < 1)
        ):
            raise ValueError(
                f"`leak_min_bytes_per_step` must be a positive int (bytes per optimizer step), got"
                f" {leak_min_bytes_per_step!r}. Use 1 to report any sustained growth, 16384 to ignore less than"
                " 16 KiB per step."
            )
        check_positive_int("max_listed", max_listed)
        for name, flag in (
            ("audit_fit_start", audit_fit_start),
            ("detect_leaks", detect_leaks),
            ("check_grad_tracking", check_grad_tracking),
            ("collect_garbage", collect_garbage),
            ("audit_dataloaders", audit_dataloaders),
        ):
            check_bool(name, flag)
        check_fraction(
            "leak_max_overhead",
            leak_max_overhead,
            allow_none=True,
            hint="Use e.g. 0.01 for 1 % of the training time, or None for a fixed interval.",
        )
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.duplicate_fraction = float(duplicate_fraction)
        self.leak_every_n_steps = leak_every_n_steps
        self.leak_window = leak_window
        self.leak_min_bytes_per_step = leak_min_bytes_per_step
        self.audit_fit_start = audit_fit_start
        self.detect_leaks = detect_leaks
        self.check_grad_tracking = check_grad_tracking
        self.max_listed = max_listed
        self.collect_garbage = collect_garbage
        self.leak_max_overhead = leak_max_overhead
        self.audit_dataloaders = audit_dataloaders
        #: The DataLoader audit of the last fit (one :class:`~lightning_memopt.functional.loaders.LoaderMemory` each).
        self.loaders: list[LoaderMemory] = []
        self._unmeasured: dict[str, Any] = {}  # loaders whose first batch has not been seen yet
        self._host_total = 0

        self._warn = WarnOnce()  # failures of the audit itself: once per instance
        self._findings = WarnOnce(every_time=True)  # what the audit found: once per fit, every fit
        self._writer: JsonlWriter | None = None
        self._device = torch.device("cpu")
        self._has_device_memory = False
        self._rank = 0
        self._samples: deque[tuple[int, int]] = deque(maxlen=leak_window)
        # (step, {attribute path: (tensors with grad_fn, bytes)}): the cheap check, on every device
        self._holder_samples: deque[tuple[int, dict[str, tuple[int, int]]]] = deque(maxlen=leak_window)
        self._duplicates_seen: set[tuple[StorageKey, tuple[int, ...], str]] = set()
        self._last_sampled_step = -1
        self._leak_reported = False
        self._first_step_audited = False
        self._next_sample_step = leak_every_n_steps
        self._last_walk_end = 0.0
        self._walk_s: float | None = None
        #: The last audit record written (``fit_start`` or ``first_step``), for inspection.
        self.last_audit: dict[str, Any] | None = None
        #: The leak verdict that was warned about, if any.
        self.leak: Growth | None = None

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(dirpath=str(self.dirpath) if self.dirpath else None)

    @property
    def path(self) -> Path | None:
        """The JSONL file of this rank, known after ``setup``."""
        return None if self._writer is None else self._writer.path

    # ---------------------------------------------------------------- setup / teardown
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._device = trainer_device(trainer)
        self._has_device_memory = supports_device_memory(self._device)
        self._rank = trainer.global_rank
        self._writer = rank_log_writer(trainer, self.dirpath, self._rank, self._writer, "MemoryAudit")
        ensure_run_id(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._writer is not None:
            self._writer.close()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self._writer is not None:
            self._writer.close()

    # ---------------------------------------------------------------- fit start: footprint and duplicates
    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._findings.reset()  # every fit reports its own findings, also a second fit in the same process
        self._duplicates_seen = set()
        if trainer.global_step == 0:  # a new run; a resumed one keeps its leak window (see `state_dict`)
            self._samples.clear()
            self._leak_reported = False
            self.leak = None
        self._holder_samples.clear()
        self._last_sampled_step = -1
        self._first_step_audited = False
        self._next_sample_step = (trainer.global_step // self.leak_every_n_steps + 1) * self.leak_every_n_steps
        self._last_walk_end = time.perf_counter()
        self._walk_s = None
        if self.audit_fit_start:
            self._guarded("audit", self._audit, trainer, pl_module, "fit_start")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.loaders = []
        self._unmeasured = {}
        if self.audit_dataloaders:
            self._guarded("dataloaders", self._audit_loaders, trainer)

    def _audit_loaders(self, trainer: pl.Trainer) -> None:
        """The settings of every loader now (before its workers start); the bytes once a batch of it is seen."""
        import psutil

        self._host_total = int(psutil.virtual_memory().total)
        named = _named_loaders("train", trainer.train_dataloader)
        if trainer.val_dataloaders is not None and getattr(trainer, "limit_val_batches", 1) != 0:
            named += _named_loaders("val", trainer.val_dataloaders)
        self._unmeasured = dict(named)
        for name, loader in named:
            self._audit_loader(trainer, name, loader, None)

    def _audit_loader(self, trainer: pl.Trainer, name: str, loader: Any, nbytes: int | None) -> None:
        info = loader_memory(
            loader,
            name,
            self._device.type,
            host_total_bytes=self._host_total,
            evaluation=name.startswith("val"),
            batch_bytes=nbytes,
        )
        if info is None:
            return
        self.loaders = [*(i for i in self.loaders if i.name != name), info]
        reading = read_memory(self._device)
        if nbytes is not None:
            self._write(
                self._record(
                    trainer, reading, "dataloaders", None, loader=info.as_dict(), host_total_bytes=self._host_total
                )
            )
        if self._rank != 0:
            return  # the loaders are the same on every rank: rank zero speaks for them
        if nbytes is not None:
            rank_zero_info(f"MemoryAudit: DataLoader {info.summary()}")
        for finding in info.findings:
            message = f"MemoryAudit: {finding}"
            if self._findings.warn(f"loader-{finding}", message):
                self._write(
                    self._record(
                        trainer, reading, "warning", None, check="dataloaders", message=message, loader=info.name
                    )
                )

    def _measure_loader(self, trainer: pl.Trainer, name: str, batch: Any) -> None:
        loader = self._unmeasured.pop(name, None)
        if loader is not None:
            self._audit_loader(trainer, name, loader, batch_bytes(batch))

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if "train" in self._unmeasured:  # the first batch: how big the batches the workers prepare are
            self._guarded("dataloaders", self._measure_loader, trainer, "train", batch)

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._unmeasured and trainer.state.fn == "fit":
            val = _named_loaders("val", trainer.val_dataloaders)
            if dataloader_idx < len(val):
                self._guarded("dataloaders", self._measure_loader, trainer, val[dataloader_idx][0], batch)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_sampled_step or step == 0:
            return  # no optimizer step since the last look (gradient accumulation), or none yet
        self._last_sampled_step = step
        if self.audit_fit_start and not self._first_step_audited:
            self._first_step_audited = True
            self._guarded("audit", self._audit, trainer, pl_module, "first_step")
        if self.detect_leaks and not self._leak_reported and step >= self._next_sample_step:
            self._next_sample_step = step + self.leak_every_n_steps
            # The common cause first, on every device and cheaply: attributes of the module that keep tensors
            # with autograd history, more of them every step. The full walk (CPU) waits for its time budget.
            self._guarded("leak", self._holder_sample, trainer, pl_module, step, batch_idx)
            if not self._leak_reported and self._walk_within_budget():
                self._guarded("leak", self._leak_sample, trainer, pl_module, step, batch_idx)
        if step % self.leak_every_n_steps != 0:
            return
        if self.check_grad_tracking:
            self._guarded("metric-states", self._check_metric_states, trainer, pl_module)

    # ---------------------------------------------------------------- grad-tracking checks
    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not self.check_grad_tracking or batch_idx % self.leak_every_n_steps != 0:
            return
        self._guarded("validation-grad", self._check_validation_outputs, trainer, outputs, batch_idx)

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.check_grad_tracking:
            self._guarded("metric-states", self._check_metric_states, trainer, pl_module)

    # ---------------------------------------------------------------- state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"leak_samples": [list(sample) for sample in self._samples], "leak_reported": self._leak_reported}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._samples.clear()
        for step, value in state_dict.get("leak_samples", []):
            self._samples.append((int(step), int(value)))
        self._leak_reported = bool(state_dict.get("leak_reported", False))

    # ---------------------------------------------------------------- internals
    def _guarded(self, key: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as err:
            self._warn.warn(f"failed-{key}", f"MemoryAudit: the {key} check failed ({err!r}); training goes on.")

    def _write(self, record: dict[str, Any]) -> None:
        if self._writer is not None:
            self._writer.write(record)  # never raises: warns once and carries on

    def _record(
        self, trainer: pl.Trainer, reading: MemoryReading, event: str, batch_idx: int | None, **extra: Any
    ) -> dict[str, Any]:
        return memory_record(
            reading,
            rank=self._rank,
            phase="train",
            event=event,
            epoch=trainer.current_epoch,
            global_step=trainer.global_step,
            batch_idx=batch_idx,
            **extra,
            run_id=run_id(trainer),
        )

    def _audit(self, trainer: pl.Trainer, pl_module: pl.LightningModule, when: str) -> None:
        if self.collect_garbage:
            gc.collect()
        optimizers = list(getattr(trainer, "optimizers", []) or [])
        footprint = model_footprint(pl_module, optimizers)
        names = tensor_names(pl_module, optimizers)
        live = self._timed_walk(names)
        reading = read_memory(self._device)
        device = str(self._device)
        unexplained = unexplained_bytes(reading.allocated_bytes, footprint, device)
        unowned = [t for t in live if t.name is None]
        # Copies found at fit start still count after the first step moved the weights away from their values.
        duplicates = find_duplicates(pl_module, live, max_listed=self.max_listed, known=self._duplicates_seen)
        self._duplicates_seen = set(duplicates.signatures)
        warn_duplicates = duplicates.num_tensors > 0 and duplicates.fraction >= self.duplicate_fraction
        record = self._record(
            trainer,
            reading,
            "audit",
            None,
            audit=when,
            footprint=footprint.as_dict(),
            footprint_device_bytes=footprint.total_bytes(device),
            unexplained_bytes=unexplained,
            unowned_tensor_bytes=sum(t.bytes for t in unowned),
            num_unowned_tensors=len(unowned),
            largest_unowned=[_tensor_dict(t) for t in unowned[: self.max_listed]],
            duplicates=duplicates.as_dict() if duplicates.num_tensors else None,
        )
        self.last_audit = record
        self._write(record)
        if when == "fit_start":
            rank_zero_info(_footprint_text(footprint, device, unexplained, unowned, when))
            self._log_metrics(trainer, footprint, unexplained, duplicates if warn_duplicates else None)
        else:
            log.info(_footprint_text(footprint, device, unexplained, unowned, when))
        if warn_duplicates:
            self._warn_duplicates(trainer, pl_module, reading, duplicates, device, when)

    def _warn_duplicates(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        reading: MemoryReading,
        dup: Duplicates,
        device: str,
        when: str,
    ) -> None:
        largest = ", ".join(
            f"{tuple(t.shape)} {t.dtype.replace('torch.', '')} {format_bytes(t.bytes)}" for t in dup.largest
        )
        held = _where_held(pl_module, dup)
        message = (
            f"MemoryAudit [rank {self._rank}] ({when.replace('_', ' ')}): {dup.num_tensors} tensors on {device}"
            f" ({format_bytes(dup.bytes)} = {dup.bytes} bytes, dtypes {', '.join(dup.dtypes)}) are not owned by the"
            f" model or optimizer but have the shapes of its parameters: {dup.fraction:.2f}x the parameters'"
            f" elements. {held} Likely cause: {dup.cause}. Largest: {largest}."
        )
        if self._findings.warn("duplicates", message):
            self._write(
                self._record(
                    trainer,
                    reading,
                    "warning",
                    None,
                    check="duplicates",
                    message=message,
                    duplicate_bytes=dup.bytes,
                    num_duplicate_tensors=dup.num_tensors,
                )
            )

    def _log_metrics(
        self, trainer: pl.Trainer, footprint: Footprint, unexplained: int | None, dup: Duplicates | None
    ) -> None:
        if trainer.global_rank != 0 or not trainer.loggers:
            return
        metrics = {f"memory/audit/{k}_bytes": float(v) for k, v in footprint.bytes_by_category().items()}
        if unexplained is not None:
            metrics["memory/audit/unexplained_bytes"] = float(unexplained)
        metrics["memory/audit/duplicate_bytes"] = float(dup.bytes if dup is not None else 0)
        for logger in trainer.loggers:
            try:
                logger.log_metrics(metrics, step=trainer.global_step)
            except Exception as err:
                self._warn.warn(
                    f"logger-{type(logger).__name__}",
                    f"MemoryAudit: logging to {type(logger).__name__} failed ({err!r}).",
                )

    def _walk_within_budget(self) -> bool:
        """Whether a leak sample may walk the Python objects now (always, where the allocator gives readings).

        On CPU a sample walks every object (``gc.get_objects()``): it runs only once the training time since
        the last walk pays for it, ``walk time <= leak_max_overhead * time since``, with the walk time from the
        last walk (an audit's or a sample's). So the samples cost at most ``leak_max_overhead`` of training.
        """
        if self._has_device_memory or self.leak_max_overhead is None or self._walk_s is None:
            return True
        return self._walk_s <= self.leak_max_overhead * (time.perf_counter() - self._last_walk_end)

    def _timed_walk(self, names: Mapping[StorageKey, str] | None = None) -> list[LiveTensor]:
        start = time.perf_counter()
        try:
            return live_tensors(self._device, names=names)
        finally:
            self._last_walk_end = time.perf_counter()
            self._walk_s = self._last_walk_end - start

    def _sample_bytes(self) -> int | None:
        if self._has_device_memory:
            return read_memory(self._device).allocated_bytes
        return sum(t.bytes for t in self._timed_walk())

    def _holder_sample(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, batch_idx: int) -> None:
        """Attributes of the module holding more tensors with autograd history at every sample: a leak."""
        holders = grad_fn_holders(pl_module)
        self._holder_samples.append((step, {h.path: (h.num_tensors, h.bytes) for h in holders}))
        if len(self._holder_samples) < self.leak_window:
            return
        steps = [s for s, _ in self._holder_samples]
        for holder in holders:
            counts = [sample.get(holder.path, (0, 0))[0] for _, sample in self._holder_samples]
            if not detect_growth(steps, counts, min_bytes_per_step=1e-9).growing:
                continue
            sizes = [sample.get(holder.path, (0, 0))[1] for _, sample in self._holder_samples]
            growth = detect_growth(steps, sizes, min_bytes_per_step=0.0)
            per_step = (counts[-1] - counts[0]) / max(steps[-1] - steps[0], 1)
            self._report_leak(
                trainer,
                batch_idx,
                growth,
                steps,
                holders,
                f"{holder.path} holds more tensors with autograd history at every sample ({counts[0]} at step"
                f" {steps[0]}, {counts[-1]} at step {steps[-1]}: {per_step:.2g} per optimizer step,"
                f" {format_bytes(sizes[-1])} of tensors plus the graphs they keep alive).",
            )
            return

    def _leak_sample(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int, batch_idx: int) -> None:
        value = self._sample_bytes()
        if value is None:
            return
        self._samples.append((step, int(value)))
        if len(self._samples) < self.leak_window:
            return
        steps, values = zip(*self._samples)
        growth = detect_growth(steps, values, self.leak_min_bytes_per_step)
        if not growth.growing:
            return
        holders = grad_fn_holders(pl_module)
        kind = "allocated" if self._has_device_memory else "live tensor"
        self._report_leak(
            trainer,
            batch_idx,
            growth,
            list(steps),
            holders,
            f"{kind.capitalize()} memory on {self._device} grows by {format_bytes(growth.bytes_per_step)} per"
            f" optimizer step ({int(growth.bytes_per_step)} bytes/step, {format_bytes(growth.total_bytes)} over"
            f" steps {steps[0]}-{steps[-1]}), first seen at step {growth.first_step}.",
        )

    def _report_leak(
        self,
        trainer: pl.Trainer,
        batch_idx: int,
        growth: Growth,
        steps: list[int],
        holders: list[GradFnHolder],
        what: str,
    ) -> None:
        self._leak_reported = True
        self.leak = growth
        where = (
            "Attributes holding tensors with autograd history: "
            + "; ".join(f"{h.path} ({h.num_tensors} tensors with grad_fn)" for h in holders[:5])
            + "."
            if holders
            else "No attribute of the LightningModule holds tensors with autograd history."
        )
        message = f"MemoryAudit [rank {self._rank}]: {what} {where} Usual causes: {_LEAK_CAUSES}."
        self._findings.warn("leak", message)
        reading = read_memory(self._device)
        self._write(
            self._record(
                trainer,
                reading,
                "warning",
                batch_idx,
                check="leak",
                message=message,
                bytes_per_step=growth.bytes_per_step,
                first_step=growth.first_step,
                samples=list(self._samples),
                grad_fn_holders=[{"path": h.path, "num_tensors": h.num_tensors, "bytes": h.bytes} for h in holders],
            )
        )

    def _check_validation_outputs(self, trainer: pl.Trainer, outputs: Any, batch_idx: int) -> None:
        count, nbytes = tensors_with_grad_fn(outputs)
        if count:
            self._findings.warn(
                "validation-graph",
                f"MemoryAudit [rank {self._rank}]: validation_step (batch {batch_idx}) returned {count} tensors with"
                f" autograd history ({format_bytes(nbytes)} plus their graphs): validation code ran with grad"
                " enabled (`torch.enable_grad()`/`set_grad_enabled(True)`) and built graphs. Detach what you"
                " return, or compute under `torch.no_grad()`.",
            )
        if torch.is_grad_enabled():
            self._findings.warn(
                "validation-grad-enabled",
                f"MemoryAudit [rank {self._rank}]: grad is enabled after validation_step (batch {batch_idx}):"
                " something called `torch.set_grad_enabled(True)` in validation code, so every validation"
                " forward builds an autograd graph. Use `with torch.enable_grad():` around the part that needs it.",
            )

    def _check_metric_states(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        found = metric_states_requiring_grad(pl_module)
        if found:
            self._findings.warn(
                "metric-states-grad",
                f"MemoryAudit [rank {self._rank}]: metric states hold tensors that require grad: {', '.join(found)}."
                " Each `update` keeps its autograd graph alive until `reset`: pass detached tensors"
                " (`metric.update(preds.detach(), target)`).",
            )


def _where_held(pl_module: pl.LightningModule, dup: Duplicates) -> str:
    """Where the largest copies are held, as attribute paths from the LightningModule, in one sentence."""
    try:
        found = find_storage_holders(pl_module, [t.key for t in dup.largest if t.key is not None])
    except Exception:
        found = {}
    paths = sorted(set(found.values()))
    if not paths:
        return "Where: not in an attribute of the LightningModule (a variable, a closure or another object holds them)."
    text = "Held at " + ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "") + "."
    names = sorted({m.group(1) for p in paths if (m := re.search(r"_hparams(?:_initial)?\[['\"](\w+)['\"]\]", p))})
    if names:
        ignore = ", ".join(f'"{n}"' for n in names)
        text += (
            " That is a copy kept by `save_hyperparameters()`: call"
            f" `self.save_hyperparameters(ignore=[{ignore}])` (the weights are in the checkpoint's `state_dict`"
            " already), or save only its configuration."
        )
    elif any("hparams" in p for p in paths):
        text += (
            " That is a copy kept by `save_hyperparameters()`: pass `ignore=[...]` with the module's argument"
            " name, or save only its configuration."
        )
    return text


def _tensor_dict(t: LiveTensor) -> dict[str, Any]:
    return {
        "shape": list(t.shape),
        "dtype": t.dtype,
        "device": t.device,
        "bytes": t.bytes,
        "requires_grad": t.requires_grad,
        "has_grad_fn": t.has_grad_fn,
    }


def _named_loaders(name: str, loaders: Any) -> list[tuple[str, Any]]:
    """``(name, loader)`` for a loader or a list / dict of them, as the Trainer holds them."""
    if isinstance(loaders, (list, tuple)):
        return [(f"{name}[{i}]" if len(loaders) > 1 else name, dl) for i, dl in enumerate(loaders)]
    if isinstance(loaders, dict):
        return [(f"{name}[{key}]", dl) for key, dl in loaders.items()]
    return [] if loaders is None else [(name, loaders)]


def _footprint_text(
    footprint: Footprint, device: str, unexplained: int | None, unowned: list[LiveTensor], when: str
) -> str:
    lines = [f"MemoryAudit ({when.replace('_', ' ')}): model and optimizer footprint", footprint.table()]
    if unexplained is not None:
        lines.append(f"unexplained allocated bytes on {device}: {format_bytes(unexplained)} ({unexplained} bytes)")
    lines.append(
        f"live tensors on {device} not owned by the model or optimizer: {len(unowned)},"
        f" {format_bytes(sum(t.bytes for t in unowned))}"
    )
    return "\n".join(lines)
