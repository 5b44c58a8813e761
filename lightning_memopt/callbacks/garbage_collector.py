"""GarbageCollector: ``gc.collect()`` every N optimizer steps, at the same step on every rank."""

from __future__ import annotations

import gc
import time
from functools import cached_property
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_memopt.utilities.checks import check_bool, check_choice, check_non_negative_int, check_positive_int
from lightning_memopt.utilities.trainer import log_to_loggers
from lightning_memopt.utilities.warnings import WarnOnce

__all__ = ["GarbageCollector"]


class GarbageCollector(Callback):
    """Runs Python's garbage collector on a fixed optimizer-step interval during training.

    Python's automatic collector runs whenever allocation counts cross its thresholds: at different
    moments on each rank, where a full collection (100+ ms in a process with many objects) makes the
    other ranks wait at the next collective. Running ``gc.collect(generation)`` every ``every_n_steps``
    optimizer steps makes collections happen at the same step on every rank (``global_step`` is the same
    on all ranks), and optionally the automatic collector is switched off during fit so that only these
    collections run. Collecting also frees tensors kept alive only by reference cycles, whose device
    memory the caching allocator cannot reuse until then.

    The process's gc state (automatic collection on/off, frozen objects) is recorded at setup and
    restored at teardown and when training stops with an exception. Thresholds are never changed.

    Args:
        every_n_steps: Collect every this many optimizer steps.
        generation: The generation to collect (0, 1 or 2; 2 is a full collection).
        disable_automatic: Switch the automatic collector off during fit (restored afterwards).
        freeze_after_setup: Call ``gc.freeze()`` after setup, so that the objects that exist then (the model,
            the data) are never scanned again, which makes every later collection cheaper. Unfrozen at teardown.
            Python can only unfreeze everything at once, so when the application has already frozen objects
            itself (``gc.get_freeze_count() > 0`` at setup), nothing is frozen here, a warning says so, and the
            application's frozen objects stay frozen after fit.

    Logged metrics (at the end of fit, from rank zero):
        * ``memory/gc/collect_calls``: number of collections (count).
        * ``memory/gc/collect_seconds``: total seconds spent collecting.
        * ``memory/gc/collected_objects``: unreachable objects found (count).

    Device requirements: none (host-side).

    Example:
        >>> collector = GarbageCollector(every_n_steps=25, disable_automatic=True)
        >>> collector.calls
        0
    """

    def __init__(
        self,
        every_n_steps: int = 25,
        generation: int = 2,
        disable_automatic: bool = False,
        freeze_after_setup: bool = False,
    ) -> None:
        check_positive_int("every_n_steps", every_n_steps)
        check_non_negative_int("generation", generation, hint="Use 0, 1 or 2 (2 is a full collection).")
        check_choice("generation", generation, (0, 1, 2))
        check_bool("disable_automatic", disable_automatic)
        check_bool("freeze_after_setup", freeze_after_setup)
        self.every_n_steps = every_n_steps
        self.generation = generation
        self.disable_automatic = disable_automatic
        self.freeze_after_setup = freeze_after_setup
        self.calls = 0
        self.seconds = 0.0
        self.collected = 0
        self._saved_enabled: bool | None = None
        self._froze = False
        self._last_step = -1
        self._warn = WarnOnce()

    @cached_property
    def state_key(self) -> str:  # read by Lightning on every hook call: built once
        return self._generate_state_key(every_n_steps=self.every_n_steps, generation=self.generation)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if self._saved_enabled is None:
            self._saved_enabled = gc.isenabled()
        if not self.freeze_after_setup or self._froze:
            return
        if gc.get_freeze_count() > 0:
            # `gc.unfreeze()` cannot tell our objects from the application's: freezing on top of the application's
            # freeze could only be undone by unfreezing everything, so the application's freeze is left as it is.
            if trainer.is_global_zero:
                self._warn.warn(
                    "already_frozen",
                    f"GarbageCollector(freeze_after_setup=True) did not freeze: the application has already frozen"
                    f" {gc.get_freeze_count()} objects with `gc.freeze()`, and Python can only unfreeze all of them"
                    " at once. They stay frozen as they are; pass `freeze_after_setup=False` to silence this.",
                )
            return
        gc.collect()
        gc.freeze()
        self._froze = True

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.disable_automatic:
            if self._saved_enabled is None:
                self._saved_enabled = gc.isenabled()
            gc.disable()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == self._last_step or step == 0 or step % self.every_n_steps != 0:
            return  # only on optimizer-step boundaries (gradient accumulation calls this per micro-batch)
        self._last_step = step
        start = time.perf_counter()
        try:
            self.collected += gc.collect(self.generation)
        except Exception as err:  # pragma: no cover - gc.collect does not raise in practice
            self._warn.warn("collect", f"GarbageCollector: gc.collect failed ({err!r}); training goes on.")
            return
        self.seconds += time.perf_counter() - start
        self.calls += 1

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank_zero_info(
            f"GarbageCollector: {self.calls} gc.collect({self.generation}) calls took {self.seconds:.3f} s"
            f" and found {self.collected} unreachable objects."
        )
        metrics = {
            "memory/gc/collect_calls": float(self.calls),
            "memory/gc/collect_seconds": self.seconds,
            "memory/gc/collected_objects": float(self.collected),
        }
        log_to_loggers(trainer, metrics, self._warn, "GarbageCollector")

    def _restore(self) -> None:
        if self._froze:
            gc.unfreeze()  # only ever reached when the freeze count was 0 before our freeze
            self._froze = False
        if self._saved_enabled is not None:
            if self._saved_enabled:
                gc.enable()
            else:
                gc.disable()
            self._saved_enabled = None

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._restore()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "seconds": self.seconds, "collected": self.collected}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.calls = int(state_dict.get("calls", 0))
        self.seconds = float(state_dict.get("seconds", 0.0))
        self.collected = int(state_dict.get("collected", 0))
