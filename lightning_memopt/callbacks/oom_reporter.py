"""OOMReporter: one actionable out-of-memory report per failing rank."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightning_memopt.callbacks._memory_log import ArtifactCallback
from lightning_memopt.callbacks._states import MAX_REMEMBERED_REPORTS as _MAX_REMEMBERED
from lightning_memopt.callbacks._states import restore_state
from lightning_memopt.functional import oom
from lightning_memopt.functional.batching import LengthSample
from lightning_memopt.functional.checkpointing import is_checkpointed
from lightning_memopt.functional.micro_batch import fsdp_sync
from lightning_memopt.functional.readings.memory import read_memory
from lightning_memopt.utilities import _torch_private
from lightning_memopt.utilities.checks import (
    check_bool,
    check_non_negative_int,
    check_path,
    check_positive_int,
    check_writable_dir,
)
from lightning_memopt.utilities.files import check_dir_creatable
from lightning_memopt.utilities.oom import is_out_of_memory_error
from lightning_memopt.utilities.quiet import note_inactive, report_inactive
from lightning_memopt.utilities.run_id import ensure_run_id, run_id
from lightning_memopt.utilities.shared_state import Lease
from lightning_memopt.utilities.trainer import default_artifact_dir, host_name, trainer_device
from lightning_memopt.utilities.warnings import WarnOnce, log

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["OOMReporter"]

#: Set on an exception object once it is reported, so the same error is never written twice.
_REPORTED_MARK = "_lightning_memopt_reported"


class OOMReporter(ArtifactCallback):
    """Writes a JSON and a Markdown post-mortem on every rank where fit/validate/test/predict dies of out-of-memory.

    When the trainer stops on an out-of-memory error (any device, library or the host: see
    :func:`~lightning_memopt.utilities.oom.is_out_of_memory_error`), the failing rank writes to ``dirpath``:

    * ``oom_report_rank{r}.json``: when and where, the error, the failing batch, memory at failure, who holds
      memory, configuration, hyperparameters, environment (allow-listed, secrets redacted) and ranked
      suggestions. Every key is in :class:`~lightning_memopt.functional.oom.schema.OOMReport` and described
      in ``docs/oom-report.md``; ``lightning-memopt report FILE`` prints it as Markdown;
    * ``oom_report_rank{r}.md``: the same, readable (the sections are in ``docs/oom-report.md``). A sharded model
      (FSDP2 ``fully_shard``, e.g. under ``ModelParallelStrategy``) adds how it is sharded (``sharding``: units,
      data-parallel size, this rank's shard bytes beside the unsharded whole) and the suggestions know it;
    * ``oom_snapshot_rank{r}.pickle`` with ``record_history=True`` on CUDA: the allocator's history, for
      https://pytorch.org/memory_viz. Recording starts in ``setup`` and stops at ``teardown`` or after an
      exception; it costs time on every allocation (use it to investigate). On a device without allocator
      history (a CPU) the fit's one line about inactive callbacks says so; a CUDA build without it warns once.

    It never raises over the user's error (a failing part is listed in ``report_errors``; an unwritable report
    is logged and warned about), reports each error once, and never communicates with other ranks at the failure.
    Every report is kept under a name of its own (``oom_report_rank0-20250101T120000.123456Z-4242-0.json``: failure
    time, process id, counter); the names above are hard links to the rank's newest, so writers sharing a
    ``dirpath`` (two jobs, threads) never overwrite each other.

    Args:
        dirpath: Directory of the reports; created when the first report is written. Default:
            ``<trainer.log_dir or default_root_dir>/memopt`` (next to the memory logs), resolved in ``setup``.
        record_history: Record CUDA allocator history and write an allocator snapshot at the failure.
        max_entries: How many allocator events the history keeps (a ring buffer).
        max_listed: How many of the largest live tensors on the device to list (0 to skip the scan).
        lengths_fn: ``lengths_fn(batch)`` returning the failing batch's padding mask (``[samples, padded length]``,
            nonzero where a position is real), for a batch without an ``attention_mask`` of its own (spectra, video
            frames): the report then gives its samples' lengths and padding (``batch.lengths``). Default: read from
            the batch's tensors named ``*mask`` and its labels padded with -100.

    Examples:
        >>> reporter = OOMReporter(dirpath="oom_reports", max_listed=10)
        >>> reporter.state_dict()
        {'reported_steps': [], 'num_reports': 0}
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        record_history: bool = False,
        max_entries: int = 100_000,
        max_listed: int = 20,
        lengths_fn: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__()
        check_path("dirpath", dirpath)
        check_bool("record_history", record_history)
        check_positive_int("max_entries", max_entries, hint="It bounds how many allocator events are kept.")
        check_non_negative_int("max_listed", max_listed, hint="Use 0 to leave out the live-tensor list.")
        if lengths_fn is not None and not callable(lengths_fn):
            raise ValueError(
                f"`lengths_fn` must be a function or None, got {lengths_fn!r} ({type(lengths_fn).__name__}): it takes"
                ' the batch and returns its padding mask, e.g. `lambda batch: batch["peaks"][:, :, 0] > 0`.'
            )
        self.lengths_fn = lengths_fn
        self.dirpath = dirpath
        self.record_history = record_history
        self.max_entries = max_entries
        self.max_listed = max_listed
        self._reported_steps: list[str] = []
        self._num_reports = 0
        self._history: Lease | None = None  # allocator history is the process's: shared with overlapping fits
        self._resolved_dir: Path | None = None
        self._checkpointing_at_start: oom.CheckpointingState | None = None
        self._lengths = LengthSample()  # the first training batches' lengths
        self._warn = WarnOnce()

    @functools.cached_property
    @override
    def state_key(self) -> str:  # read by Lightning on every hook call: built once
        return self._generate_state_key(dirpath=self.dirpath)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Everything that may need the other ranks (``trainer.log_dir`` broadcasts) is resolved here, where all
        # ranks are present; `on_exception` runs on the failing rank alone and must not communicate.
        self._resolved_dir = check_dir_creatable("dirpath", self._resolve_dirpath(trainer))
        self._checkpointing_at_start = None
        ensure_run_id(trainer)
        if self.record_history and not self._recording:
            self._start_history(trainer)
        # Under AutoMicroBatch with FSDP2, a rank left inside a collective by a rank that ran out of memory in it
        # reports while it still waits there: once its process is allowed to end, a launcher may kill it.
        fsdp_sync.report_peer_failures(self, functools.partial(self._report_safely, trainer, pl_module))

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        report_inactive(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Seen once, after every callback's setup: a callback that wrapped the model may unwrap it in its own
        # `on_exception` before this one reports.
        try:
            self._checkpointing_at_start = oom.checkpointing_state(pl_module, is_checkpointed)
        except Exception:
            self._checkpointing_at_start = None
        self._lengths = LengthSample()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """The first training batches' lengths (from their padding masks, or ``lengths_fn``): where 99 % of the data
        fits, for the tip to cap ``max_length``. Host copies of the masks of 16 batches at most."""
        if self._lengths.done:
            return
        try:
            if self.lengths_fn is not None:
                padding = oom.mask_lengths("lengths_fn(batch)", self.lengths_fn(batch))
            else:
                padding = oom.batch_padding(batch)
            self._lengths.add([dict(found) for found in padding])
        except Exception as err:  # a failing lengths_fn costs the tip, never the step
            self._lengths.unmasked = self._lengths.without_masks
            self._warn.warn("lengths", f"OOMReporter: the batch's lengths could not be read ({err!r}); carrying on.")

    def _data_lengths(self) -> oom.DataLengths | None:
        sample = self._lengths
        p99 = sample.p99()
        if p99 is None:
            return None
        return {"batches": sample.seen, "samples": len(sample.lengths), "p99": p99, "longest": max(sample.lengths)}

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        fsdp_sync.report_peer_failures(self, None)
        self._stop_history()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        try:
            self._report_safely(trainer, pl_module, exception)
        finally:
            # Lightning does not call `teardown` hooks after an exception: give the allocator state back here.
            fsdp_sync.report_peer_failures(self, None)
            self._stop_history()

    def _report_safely(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """The report of ``exception`` when it is an out-of-memory error; never raises."""
        try:
            if is_out_of_memory_error(exception):
                self._report(trainer, pl_module, exception)
        except Exception as err:  # never raise over the user's error
            log.error("OOMReporter: the out-of-memory report could not be written: %r", err)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"reported_steps": list(self._reported_steps), "num_reports": self._num_reports}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = restore_state("OOMReporter", state_dict)  # statistics: a bad or missing value warns, starts fresh
        self._reported_steps, self._num_reports = state["reported_steps"], state["num_reports"]

    @property
    def _recording(self) -> bool:  # a pickled copy holds a released lease: it records nothing
        return self._history is not None and self._history.held

    def _start_history(self, trainer: pl.Trainer) -> None:
        """Borrow the process's allocator history (CUDA); say why not where it cannot be recorded."""
        device = trainer_device(trainer)
        if device.type != "cuda":
            note_inactive(trainer, "OOMReporter(record_history=True)", f"no allocator history on {device.type}")
            return
        try:
            if _torch_private.supports_memory_history():
                self._history = _torch_private.borrow_memory_history(self.max_entries, self._warn)
        except Exception as err:
            self._warn.warn("history", f"OOMReporter: allocator history could not be started ({err!r}).")
            return
        if not self._recording:
            self._warn.warn(
                "history",
                "OOMReporter(record_history=True): this torch build records no CUDA allocator history."
                " Reports are still written, without a snapshot.",
            )

    def _stop_history(self) -> None:
        history, self._history = self._history, None
        if history is None:
            return
        try:
            history.release()  # the last fit out stops the recording
        except Exception as err:
            log.warning("OOMReporter: allocator history could not be stopped: %r", err)

    def _report(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        device = trainer_device(trainer)
        guard = oom.SectionGuard(catch=(Exception,))  # a part that fails is listed in the report, never raised
        memory = oom.failure_memory(lambda: read_memory(device), guard)  # first: nothing may change it
        when = oom.failure_position(
            functools.partial(_trainer_position, trainer),
            device=device,
            traceback=exception.__traceback__,
            run_id=run_id(trainer),
            guard=guard,
        )
        if getattr(exception, _REPORTED_MARK, False):
            log.info("OOMReporter: this out-of-memory error was reported already; not writing another report.")
            return
        with contextlib.suppress(Exception):  # some exception types refuse new attributes: then report again
            setattr(exception, _REPORTED_MARK, True)
        step_key = "/".join(str(when.get(k)) for k in ("fn", "stage", "epoch", "global_step", "batch_idx"))
        self._reported_steps = [*self._reported_steps, step_key][-_MAX_REMEMBERED:]
        rank = int(when.get("rank") or 0)
        # Never `trainer.log_dir` here: it is a collective, and only this rank is in `on_exception`.
        directory = self._resolved_dir or Path(self.dirpath or default_artifact_dir(trainer, communicate=False))
        slot = oom.reserve_report(check_writable_dir("dirpath", directory), rank, float(when["time"]))
        try:
            report = oom.build_oom_report(
                exception,
                when=when,
                memory=memory,
                device=device,
                module=pl_module,
                sources=oom.ReportSources(
                    settings=functools.partial(_trainer_settings, trainer),
                    optimizers=functools.partial(_trainer_optimizers, trainer),
                    is_checkpointed=is_checkpointed,
                    snapshot=functools.partial(
                        oom.take_snapshot,
                        slot.paths["pickle"],
                        device.type,
                        requested=self.record_history,
                        recording=self._recording,
                        dump=_torch_private.dump_memory_snapshot,
                    ),
                    lengths_fn=self.lengths_fn,
                    data_lengths=self._data_lengths,
                ),
                message=_safe_str(exception),
                max_listed=self.max_listed,
                checkpointing_at_start=self._checkpointing_at_start,
                guard=guard,
            )
            failed = oom.save_report(slot, report, _markdown)
        finally:
            slot.release()
        if failed:
            header = f"OOMReporter: out-of-memory on rank {rank}; the report could not be written (error re-raised):"
            log.error(header + "\n  %s" * len(failed), *failed)  # a line per failure, paths escaped onto it
            self._warn.warn("write", f"{header} {'; '.join(failed)}")
            return
        self._num_reports += 1
        log.warning("OOMReporter: out-of-memory on rank %d; report written to\n  %s", rank, slot.paths["md"])


# What the report reads from the Trainer at a failure, as the plain values `functional.oom` takes. Attribute reads
# only: nothing here communicates with other ranks (`on_exception` runs on the failing rank alone). A read that
# fails raises; `build_oom_report`'s guard lists it in the report's `report_errors`.
def _trainer_position(trainer: pl.Trainer) -> oom.TrainerPosition:
    """Rank (global, local), node (rank, host name), world size, trainer function and stage, epoch, global step."""
    state = trainer.state
    return {
        "rank": trainer.global_rank,
        "local_rank": trainer.local_rank,
        "node_rank": trainer.node_rank,
        "host": host_name(),
        "world_size": trainer.world_size,
        "fn": None if state.fn is None else str(state.fn.value),
        "stage": None if state.stage is None else str(state.stage.value),
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
    }


def _trainer_settings(trainer: pl.Trainer) -> oom.TrainerSettings:
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


def _trainer_optimizers(trainer: pl.Trainer) -> list[Any]:
    """The trainer's optimizers (none before they are configured)."""
    return list(getattr(trainer, "optimizers", []) or [])


def _markdown(report: oom.OOMReport) -> str:
    try:
        return oom.render_markdown(report)
    except Exception as err:
        return f"# Out-of-memory report\n\nThe Markdown form could not be rendered ({err!r}); see the JSON.\n"


def _safe_str(obj: Any) -> str:
    try:
        return str(obj)
    except Exception:
        return f"<{type(obj).__name__} whose str() failed>"
