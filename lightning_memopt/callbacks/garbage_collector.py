"""GarbageCollector: young-generation ``gc.collect`` every N optimizer steps, at the same step on every rank."""

from __future__ import annotations

import gc
import os
import time
from functools import cached_property
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightning_memopt.callbacks._states import restore_state
from lightning_memopt.functional.collection import CollectionSchedule
from lightning_memopt.utilities.checks import check_bool, check_choice, check_non_negative_int, check_positive_int
from lightning_memopt.utilities.namespaces import Callback, rank_zero_info
from lightning_memopt.utilities.shared_state import Lease, Restore, borrow
from lightning_memopt.utilities.trainer import log_to_loggers
from lightning_memopt.utilities.warnings import WarnOnce

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["GarbageCollector"]

#: While a collector has the automatic collector switched off, whether a forked child process (a DataLoader
#: worker) gets it back on: the application's own setting. ``None`` while no collector has switched it off.
_enable_in_forked_child: bool | None = None


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) runs no collections of ours: give it the application's gc setting."""
    global _enable_in_forked_child
    enable, _enable_in_forked_child = _enable_in_forked_child, None
    if enable:
        gc.enable()


if hasattr(os, "register_at_fork"):  # POSIX; elsewhere workers are spawned and start with the collector on
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _disable_automatic(_: object) -> Restore:
    """Switch automatic collection off (the first collector in); the returned function gives the setting back."""
    global _enable_in_forked_child
    enabled = gc.isenabled()
    gc.disable()
    _enable_in_forked_child = enabled

    def restore() -> None:
        global _enable_in_forked_child
        _enable_in_forked_child = None
        if enabled:
            gc.enable()

    return restore


def _freeze(_: object) -> Restore | None:
    """Freeze what exists now (the first collector in), unless the application froze objects itself: ``None``."""
    if gc.get_freeze_count() > 0:
        # `gc.unfreeze()` cannot tell our objects from the application's: freezing on top of the application's
        # freeze could only be undone by unfreezing everything, so the application's freeze is left as it is.
        return None
    gc.collect()  # garbage frozen now would stay until teardown
    gc.freeze()
    return gc.unfreeze


class GarbageCollector(Callback):
    """Runs Python's garbage collector every N optimizer steps during training, at the same step on every rank.

    By default it switches the automatic collector off during fit and runs ``gc.collect(1)`` every
    ``every_n_train_steps`` optimizer steps instead: a young collection that costs what the steps allocated, not what
    the process holds. What it changed (automatic collection on/off, its freeze) is given back at teardown and on an
    exception during fit.
    Both belong to the process: collectors of fits that overlap (threads) share them through
    :func:`~lightning_memopt.utilities.shared_state.borrow`, so the first one in switches collection off (or freezes)
    and the last one out gives back the state from before the first; the thresholds are never changed.

    Args:
        every_n_train_steps: Collect every this many optimizer steps (default 25), counted as ``trainer.global_step``
            like ``ModelCheckpoint(every_n_train_steps=...)``: with ``accumulate_grad_batches=4`` and
            ``every_n_train_steps=2`` it collects after every 8th training batch, right after the optimizer step.
        generation: The generation to collect: 0, 1 (default, the two young generations) or 2 (a full collection that
            scans every tracked object).
        disable_automatic: Switch the automatic collector off during fit, restored afterwards (default ``True``).
        freeze_after_setup: Call ``gc.collect()`` and ``gc.freeze()`` after setup so that a full collection skips what
            existed then; unfrozen at teardown (default ``False``; not done, with a warning, if the application froze
            objects itself).
        full_every_n_train_steps: Also run a full collection every this many optimizer steps, in place of the regular
            one on the same step; ``None`` (default): never.
        verbose: Print a one-line summary of the collections at the end of fit (default ``False``).

    Logs (rank zero, at the end of fit): ``memory/gc/collect_calls`` (count), ``memory/gc/collect_seconds`` (total
    seconds collecting) and ``memory/gc/collected_objects`` (unreachable objects found). The checkpoint holds the
    three totals.

    Examples:
        >>> collector = GarbageCollector(every_n_train_steps=25, full_every_n_train_steps=10_000)
        >>> collector.calls, collector.generation, collector.disable_automatic
        (0, 1, True)

    More: docs/memory-callbacks.md
    """

    def __init__(
        self,
        every_n_train_steps: int = 25,
        generation: int = 1,
        disable_automatic: bool = True,
        freeze_after_setup: bool = False,
        full_every_n_train_steps: int | None = None,
        verbose: bool = False,
    ) -> None:
        check_positive_int("every_n_train_steps", every_n_train_steps)
        check_non_negative_int("generation", generation, hint="Use 0, 1 or 2 (2 is a full collection).")
        check_choice("generation", generation, (0, 1, 2))
        check_bool("disable_automatic", disable_automatic)
        check_bool("freeze_after_setup", freeze_after_setup)
        check_bool("verbose", verbose)
        check_positive_int(
            "full_every_n_train_steps",
            full_every_n_train_steps,
            allow_none=True,
            hint="Pass None to never run a full collection on an interval.",
        )
        self.every_n_train_steps = every_n_train_steps
        self.generation = generation
        self.disable_automatic = disable_automatic
        self.freeze_after_setup = freeze_after_setup
        self.full_every_n_train_steps = full_every_n_train_steps
        self.verbose = verbose
        #: Collections made, the seconds they took and the unreachable objects they found (restored on resume).
        self.calls = 0
        self.seconds = 0.0
        self.collected = 0
        self._schedule = self._new_schedule()
        self._automatic: Lease | None = None
        self._frozen: Lease | None = None
        self._warn = WarnOnce()

    @cached_property
    def state_key(self) -> str:  # read by Lightning on every hook call: built once
        return self._generate_state_key(every_n_train_steps=self.every_n_train_steps, generation=self.generation)

    def _new_schedule(self) -> CollectionSchedule:
        return CollectionSchedule(self.every_n_train_steps, self.generation, self.full_every_n_train_steps)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or not self.freeze_after_setup or self._frozen is not None:
            return
        self._frozen = borrow("gc.freeze", True, _freeze, self._warn, "GarbageCollector")
        if self._frozen is None and trainer.is_global_zero:
            self._warn.warn(
                "already_frozen",
                f"GarbageCollector(freeze_after_setup=True) did not freeze: the application has already frozen"
                f" {gc.get_freeze_count()} objects with `gc.freeze()`, and Python can only unfreeze all of them"
                " at once. They stay frozen as they are; pass `freeze_after_setup=False` to silence this.",
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._schedule = self._new_schedule()  # a new Trainer counts its steps from 0 again
        if self.disable_automatic and self._automatic is None:
            self._automatic = borrow("gc.automatic", False, _disable_automatic, self._warn, "GarbageCollector")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        generation = self._schedule.generation_at(trainer.global_step)  # the same step on every rank
        if generation is None:
            return  # only on optimizer-step boundaries (gradient accumulation calls this per micro-batch)
        start = time.perf_counter()
        try:
            found = gc.collect(generation)
        except Exception as err:  # pragma: no cover - gc.collect does not raise in practice
            self._warn.warn("collect", f"GarbageCollector: gc.collect failed ({err!r}); training goes on.")
            return  # a failed call is not counted
        self.seconds += time.perf_counter() - start
        self.calls += 1
        self.collected += found

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.verbose:
            rank_zero_info(
                f"GarbageCollector: {self.calls} collections took {self.seconds:.3f} s and found {self.collected}"
                " unreachable objects."
            )
        metrics = {
            "memory/gc/collect_calls": float(self.calls),
            "memory/gc/collect_seconds": self.seconds,
            "memory/gc/collected_objects": float(self.collected),
        }
        log_to_loggers(trainer, metrics, self._warn, "GarbageCollector")

    def _restore(self) -> None:
        frozen, automatic, self._frozen, self._automatic = self._frozen, self._automatic, None, None
        for lease in (frozen, automatic):  # unfreeze (if last out) before collection comes back on
            if lease is not None:
                lease.release()

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
        """Restore the totals; a bad or missing one (statistics only) warns and starts at 0."""
        state = restore_state("GarbageCollector", state_dict)
        self.calls, self.seconds, self.collected = state["calls"], state["seconds"], state["collected"]
