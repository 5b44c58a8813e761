"""AutoMicroBatch: survive out-of-memory by halving the micro-batch; same effective batch, same weights, same steps."""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightning_memopt.callbacks._micro_batch_loop import MicroBatchOptimization, optimization_class
from lightning_memopt.callbacks._states import restore_state
from lightning_memopt.callbacks.memory_monitor import MemoryMonitor
from lightning_memopt.functional.ddp_sync import check_ddp_for_micro_batches, check_strategy_for_micro_batches
from lightning_memopt.functional.micro_batch import check_first_batch, loader_batch_size
from lightning_memopt.functional.retry_state import BufferKeeper, ModuleParts, RetrySnapshot, find_parts
from lightning_memopt.utilities.checks import check_bool, check_positive_int
from lightning_memopt.utilities.namespaces import Callback, is_instance, namespace_of, rank_zero_info
from lightning_memopt.utilities.trainer import log_to_loggers
from lightning_memopt.utilities.warnings import WarnOnce

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization

__all__ = ["AutoMicroBatch"]


class AutoMicroBatch(Callback):
    """Runs each training batch as micro-batches and halves the micro-batch when one runs out of memory.

    ``training_step`` is unchanged and is called once per micro-batch with a slice of the batch. Each micro-batch's loss
    is weighted by its share of the batch, so the gradients, the optimizer step count, clipping, LR schedulers and
    ``accumulate_grad_batches`` are those of the whole batch. On ``torch.OutOfMemoryError`` in forward or backward the
    gradients go back to the batch's start, the micro-batch is halved and the batch runs again from its first sample.

    Args:
        micro_batch_size: The micro-batch size to start with; ``"auto"`` (default) starts with the whole batch.
        min_micro_batch_size: The smallest micro-batch size to try (default 1); an out-of-memory error at this size or
            below ends the run.
        split_batch: ``fn(batch, start, stop)`` returning the samples ``[start, stop)`` of a batch; ``None`` (default):
            the default slicer of :mod:`lightning_memopt.functional.micro_batch`.
        batch_size: ``fn(batch)`` returning the number of samples of a batch; ``None`` (default): the first dim of the
            first tensor in it.
        restore_rng: Put the random states (torch CPU and accelerators, ``random``, NumPy) back to the batch's start
            before a retry, so that dropout draws what a run at the smaller micro-batch draws (default ``True``).
        restore_metrics: Put the states of the ``torchmetrics`` metrics among the module's submodules and the
            ``self.log`` results back before a retry (default ``True``).
        restore_buffers: Put the module's buffers (BatchNorm running statistics) back before a retry (default
            ``True``); each batch copies the buffers that batches change (all of them before the first batch).

    A retry cannot undo what ``training_step`` does outside these: Python attributes it sets, prints, logger calls.

    Logs (rank zero, to the Trainer's loggers): ``memory/micro_batch_size`` (samples) at each change and at the end of
    fit, ``memory/micro_batch_retries`` (count) at the end of fit. Each change is also printed by rank zero and, with a
    ``MemoryMonitor`` among the callbacks, written to every rank's memory log as an ``event: "micro_batch"`` record.
    The checkpoint holds the micro-batch size and the retry count.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[AutoMicroBatch()], logger=False, enable_checkpointing=False)
        >>> AutoMicroBatch(micro_batch_size=8).micro_batch_size
        8

    More: docs/auto-micro-batch.md
    """

    def __init__(
        self,
        micro_batch_size: int | str = "auto",
        min_micro_batch_size: int = 1,
        split_batch: Callable[[Any, int, int], Any] | None = None,
        batch_size: Callable[[Any], int] | None = None,
        restore_rng: bool = True,
        restore_metrics: bool = True,
        restore_buffers: bool = True,
    ) -> None:
        if micro_batch_size != "auto":
            hint = 'Use a positive int, or "auto" to start with the whole batch.'
            check_positive_int("micro_batch_size", micro_batch_size, hint=hint)
        check_positive_int("min_micro_batch_size", min_micro_batch_size)
        if isinstance(micro_batch_size, int) and micro_batch_size < min_micro_batch_size:
            raise ValueError(
                f"`micro_batch_size` ({micro_batch_size}) must be >= `min_micro_batch_size` ({min_micro_batch_size})."
                " Lower `min_micro_batch_size` or start with a larger micro-batch."
            )
        for name, fn in (("split_batch", split_batch), ("batch_size", batch_size)):
            if fn is not None and not callable(fn):
                raise ValueError(f"`{name}` must be a function or None, got {fn!r} ({type(fn).__name__}).")
        flags = {"restore_rng": restore_rng, "restore_metrics": restore_metrics, "restore_buffers": restore_buffers}
        for name, flag in flags.items():
            check_bool(name, flag)
        self.restore_rng, self.restore_metrics, self.restore_buffers = restore_rng, restore_metrics, restore_buffers
        self.start_micro_batch_size = micro_batch_size
        self.min_micro_batch_size = min_micro_batch_size
        self.split_batch = split_batch
        self.batch_size = batch_size
        #: The micro-batch size in use (``None`` until the first batch with ``"auto"``).
        self.micro_batch_size: int | None = None
        self.retries = 0
        self._reset()
        self._first_size: int | None = None
        self._restored = False
        self._original: _AutomaticOptimization | None = None
        self._monitors: list[MemoryMonitor] = []
        self._warn = WarnOnce()

    def _reset(self) -> None:
        start = self.start_micro_batch_size
        self.micro_batch_size = None if start == "auto" else int(start)
        self.retries = 0

    @cached_property
    def state_key(self) -> str:
        return self._generate_state_key(min_micro_batch_size=self.min_micro_batch_size)

    # ------------------------------------------------------------------------------------------- setup / teardown

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not pl_module.automatic_optimization:
            raise ValueError(
                "AutoMicroBatch needs automatic optimization: `training_step` calls `manual_backward` itself when"
                " `self.automatic_optimization = False`, so there is no backward to split. Remove the callback or use"
                " automatic optimization."
            )
        strategy = trainer.strategy
        is_ddp = is_instance(strategy, "strategies.DDPStrategy")
        check_strategy_for_micro_batches(type(strategy).__name__, trainer.world_size, is_ddp)
        if not self._restored:
            self._reset()
        self._first_size = None
        self._buffers = BufferKeeper()  # learned again: another fit may train another module
        self._parts: ModuleParts | None = None  # found after the fit's first batch that went through
        callbacks: list[Any] = getattr(trainer, "callbacks", [])
        self._monitors = [c for c in callbacks if isinstance(c, MemoryMonitor)]
        epoch_loop = trainer.fit_loop.epoch_loop
        current = epoch_loop.automatic_optimization
        if not isinstance(current, MicroBatchOptimization):
            self._original = current
            loop_class = optimization_class(namespace_of(trainer).__name__)
            epoch_loop.automatic_optimization = loop_class(trainer, self, current)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_ddp_for_micro_batches(trainer.strategy.model)  # DDP wraps the model after setup, before this hook

    def _give_back(self, trainer: pl.Trainer) -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        if isinstance(epoch_loop.automatic_optimization, MicroBatchOptimization) and self._original is not None:
            epoch_loop.automatic_optimization = self._original
        self._original = None
        self._restored = False
        self._monitors = []

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.micro_batch_size is not None:
            metrics = {
                "memory/micro_batch_size": float(self.micro_batch_size),
                "memory/micro_batch_retries": float(self.retries),
            }
            log_to_loggers(trainer, metrics, self._warn, "AutoMicroBatch")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._give_back(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._give_back(trainer)

    # ------------------------------------------------------------------------------------------- checkpoint

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"micro_batch_size": self.micro_batch_size, "retries": self.retries}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the size; a bad or missing one raises (see ``callbacks/_states.py``), a bad ``retries`` warns."""
        state = restore_state("AutoMicroBatch", state_dict)
        size, self.retries, self._restored = state["micro_batch_size"], state["retries"], True
        self.micro_batch_size = self.micro_batch_size if size is None else size

    # ------------------------------------------------------------------------------------------- a batch

    def _check_first(self, trainer: pl.Trainer, batch: Any, n: int) -> None:
        """Refuse a first batch that cannot be split; warn when its size is not the DataLoader's batch_size."""
        expected = loader_batch_size(trainer.train_dataloader)
        if (warning := check_first_batch(batch, n, self.split_batch, self.batch_size, expected)) is not None:
            self._warn.warn("split-dim", warning)

    def _keep(self, pl_module: pl.LightningModule, results: Any, size: int) -> RetrySnapshot | None:
        """What the batch's attempts may change, kept before the first; ``None`` when no retry can follow."""
        if size <= self.min_micro_batch_size:  # an out-of-memory error at this size ends the run
            return None
        return RetrySnapshot(
            pl_module,
            results if self.restore_metrics else None,
            rng=self.restore_rng,
            metrics=self.restore_metrics,
            buffers=self._buffers if self.restore_buffers else None,
            parts=self._parts,
        )

    def _went_through(self, snapshot: RetrySnapshot | None, pl_module: pl.LightningModule) -> None:
        """A batch went through: learn the buffers it changed; find the module's parts once, after the first."""
        if snapshot is not None:
            snapshot.succeeded()
            if self._parts is None:
                self._parts = find_parts(pl_module)

    def _restore(self, snapshot: RetrySnapshot | None) -> None:
        lost = snapshot.restore() if snapshot is not None else []
        if lost:
            self._warn.warn(
                f"lost:{lost}",
                f"AutoMicroBatch could not put back the buffers {lost} after an out-of-memory error: no earlier batch"
                " had changed them, so they were not copied (they are from now on).",
            )

    # ------------------------------------------------------------------------------------------- a halving

    def _shrink(self, trainer: pl.Trainer, size: int, new: int, n: int, here: bool, batch_idx: int | None) -> None:
        """Take the halved micro-batch; say why (rank zero), log it, and record it in every rank's memory log."""
        self.micro_batch_size = new
        self.retries += 1
        reason = "out of memory" if here else "out of memory on another process"
        if trainer.is_global_zero:
            rank_zero_info(
                f"AutoMicroBatch: {reason} at a micro-batch of {size} (batch of {n}, global step"
                f" {trainer.global_step}); running the batch again with micro-batches of {new}."
            )
        log_to_loggers(trainer, {"memory/micro_batch_size": float(new)}, self._warn, "AutoMicroBatch")
        for monitor in self._monitors:  # each rank writes its own log; no collective
            monitor.record_event(
                trainer,
                "micro_batch",
                batch_idx,
                micro_batch_size=new,
                previous_micro_batch_size=size,
                batch_size=n,
                retries=self.retries,
                reason=reason,
            )
