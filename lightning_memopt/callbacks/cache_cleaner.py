"""CacheCleaner: ``empty_cache()`` every N optimizer steps and at phase ends, with its cost counted."""

from __future__ import annotations

import time
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from lightning_memopt.callbacks._states import restore_state
from lightning_memopt.functional.readings.memory import empty_device_cache, supports_device_memory
from lightning_memopt.utilities.checks import check_bool, check_positive_int
from lightning_memopt.utilities.namespaces import Callback, rank_zero_info
from lightning_memopt.utilities.quiet import note_inactive, report_inactive
from lightning_memopt.utilities.trainer import log_to_loggers, trainer_device
from lightning_memopt.utilities.warnings import WarnOnce

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["CacheCleaner"]


class CacheCleaner(Callback):
    """Returns the caching allocator's unused blocks to the driver every N optimizer steps and at phase ends.

    ``empty_cache()`` releases cached, unreferenced blocks only: it never lowers peak allocated memory and never
    prevents an out-of-memory error caused by live tensors. Each call is timed and counted. On CPU it does nothing.

    Args:
        every_n_train_steps: Empty the cache after every this many optimizer steps (default 10), counted as
            ``trainer.global_step`` like ``ModelCheckpoint(every_n_train_steps=...)``: with
            ``accumulate_grad_batches=4`` and ``every_n_train_steps=2`` it empties after every 8th training batch,
            right after the optimizer step. ``None``: never during training.
        every_n_val_batches: Empty the cache after every this many validation batches; ``None`` (default): never
            during validation batches.
        on_phase_end: Also empty the cache at the end of each train epoch, validation, test and predict loop (default
            ``True``).
        verbose: Print a one-line summary of the calls and their time at the end of fit (default ``False``).

    Logs (rank zero, at the end of fit, on CUDA, XPU or MPS only): ``memory/cache_cleaner/empty_cache_calls`` (count)
    and ``memory/cache_cleaner/empty_cache_seconds`` (total seconds in the calls). The checkpoint holds both totals.
    On a device without an allocator cache it is named in the one line that lists the inactive callbacks of the fit.

    Examples:
        >>> cleaner = CacheCleaner(every_n_train_steps=10)
        >>> cleaner.calls, cleaner.seconds
        (0, 0.0)

    More: docs/memory-callbacks.md
    """

    def __init__(
        self,
        every_n_train_steps: int | None = 10,
        every_n_val_batches: int | None = None,
        on_phase_end: bool = True,
        verbose: bool = False,
    ) -> None:
        check_positive_int(
            "every_n_train_steps",
            every_n_train_steps,
            allow_none=True,
            hint="Pass None to never clear during training.",
        )
        check_positive_int(
            "every_n_val_batches",
            every_n_val_batches,
            allow_none=True,
            hint="Pass None to never clear during validation batches.",
        )
        check_bool("on_phase_end", on_phase_end)
        check_bool("verbose", verbose)
        self.every_n_train_steps = every_n_train_steps
        self.every_n_val_batches = every_n_val_batches
        self.on_phase_end = on_phase_end
        self.verbose = verbose
        #: ``empty_cache()`` calls made and the seconds they took (restored from a checkpoint on resume).
        self.calls = 0
        self.seconds = 0.0
        self._device = torch.device("cpu")
        self._enabled = False
        self._last_step = -1  # the optimizer step emptied last: accumulation ends several batches at one step
        self._warn = WarnOnce()

    @cached_property
    def state_key(self) -> str:  # read by Lightning on every hook call: built once
        return self._generate_state_key(
            every_n_train_steps=self.every_n_train_steps, every_n_val_batches=self.every_n_val_batches
        )

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._device = trainer_device(trainer)
        self._enabled = supports_device_memory(self._device)
        if not self._enabled and stage == "fit":
            note_inactive(trainer, "CacheCleaner", f"no cache on {self._device.type}")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        report_inactive(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_step = -1  # a new Trainer counts its steps from 0 again

    def _clear(self) -> None:
        if not self._enabled:
            return
        start = time.perf_counter()
        try:
            empty_device_cache(self._device)
        except Exception as err:
            self._warn.warn("empty", f"CacheCleaner: emptying the cache failed ({err!r}); training goes on.")
            return  # a failed call is not counted
        self.seconds += time.perf_counter() - start
        self.calls += 1

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step, every = trainer.global_step, self.every_n_train_steps
        if every is None or step == 0 or step % every or step == self._last_step:
            return  # between optimizer steps (accumulation), or not on the interval
        self._last_step = step
        self._clear()

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
        if self.every_n_val_batches and (batch_idx + 1) % self.every_n_val_batches == 0:
            self._clear()

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.on_phase_end:
            self._clear()

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.on_phase_end:
            self._clear()

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.on_phase_end:
            self._clear()

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.on_phase_end:
            self._clear()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._enabled:
            return
        if self.verbose:
            rank_zero_info(f"CacheCleaner: {self.calls} empty_cache() calls took {self.seconds:.3f} s in total.")
        metrics = {
            "memory/cache_cleaner/empty_cache_calls": float(self.calls),
            "memory/cache_cleaner/empty_cache_seconds": self.seconds,
        }
        log_to_loggers(trainer, metrics, self._warn, "CacheCleaner")

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "seconds": self.seconds}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the totals; a bad or missing one (statistics only) warns and starts at 0."""
        state = restore_state("CacheCleaner", state_dict)
        self.calls, self.seconds = state["calls"], state["seconds"]
