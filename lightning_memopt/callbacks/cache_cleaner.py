"""CacheCleaner: ``empty_cache()`` on an interval, with its cost counted."""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override

from lightning_memopt.callbacks._states import restore_state
from lightning_memopt.callbacks._timed import TimedCallsCounters
from lightning_memopt.functional.collection import TimedCalls
from lightning_memopt.functional.memory import empty_device_cache, supports_device_memory
from lightning_memopt.utilities.checks import check_bool, check_positive_int
from lightning_memopt.utilities.namespaces import Callback, rank_zero_info
from lightning_memopt.utilities.trainer import log_to_loggers, trainer_device
from lightning_memopt.utilities.warnings import WarnOnce

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["CacheCleaner"]


class CacheCleaner(TimedCallsCounters, Callback):
    """Returns the caching allocator's unused blocks to the driver every N batches and at phase ends.

    ``empty_cache()`` releases cached, unreferenced blocks only: it never lowers peak allocated memory and never
    prevents an out-of-memory error caused by live tensors. Each call is timed and counted. On CPU it does nothing.

    Args:
        every_n_train_batches: Empty the cache after every this many training batches of an epoch (default 10);
            ``None``: never during training batches.
        every_n_val_batches: Empty the cache after every this many validation batches; ``None`` (default): never
            during validation batches.
        on_phase_end: Also empty the cache at the end of each train epoch, validation, test and predict loop (default
            ``True``).

    Logs (rank zero, at the end of fit, on CUDA, XPU or MPS only): ``memory/cache_cleaner/empty_cache_calls`` (count),
    ``memory/cache_cleaner/empty_cache_seconds`` (total seconds in the calls), and a one-line summary. The checkpoint
    holds both totals. On a device without an allocator cache it prints one info message instead.

    Example:
        >>> cleaner = CacheCleaner(every_n_train_batches=10)
        >>> cleaner.calls, cleaner.seconds
        (0, 0.0)

    More: docs/memory-callbacks.md
    """

    def __init__(
        self,
        every_n_train_batches: int | None = 10,
        every_n_val_batches: int | None = None,
        on_phase_end: bool = True,
    ) -> None:
        check_positive_int(
            "every_n_train_batches",
            every_n_train_batches,
            allow_none=True,
            hint="Pass None to never clear during training batches.",
        )
        check_positive_int(
            "every_n_val_batches",
            every_n_val_batches,
            allow_none=True,
            hint="Pass None to never clear during validation batches.",
        )
        check_bool("on_phase_end", on_phase_end)
        self.every_n_train_batches = every_n_train_batches
        self.every_n_val_batches = every_n_val_batches
        self.on_phase_end = on_phase_end
        self._timed = TimedCalls()
        self._device = torch.device("cpu")
        self._enabled = False
        self._warn = WarnOnce()

    @cached_property
    def state_key(self) -> str:  # read by Lightning on every hook call: built once
        return self._generate_state_key(
            every_n_train_batches=self.every_n_train_batches, every_n_val_batches=self.every_n_val_batches
        )

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._device = trainer_device(trainer)
        self._enabled = supports_device_memory(self._device)
        if not self._enabled and not getattr(self, "_told", False):
            self._told = True
            rank_zero_info(f"CacheCleaner: {self._device.type} has no allocator cache to empty; it does nothing here.")

    def _clear(self) -> None:
        if not self._enabled:
            return
        device = self._device
        try:
            self._timed.run(lambda: empty_device_cache(device))
        except Exception as err:
            self._warn.warn("empty", f"CacheCleaner: emptying the cache failed ({err!r}); training goes on.")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.every_n_train_batches and (batch_idx + 1) % self.every_n_train_batches == 0:
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
