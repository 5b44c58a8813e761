"""AutoMicroBatch: survive out-of-memory by halving the micro-batch; same effective batch, same weights, same steps."""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightning_memopt.callbacks._micro_batch_loop import MicroBatchOptimization, optimization_class
from lightning_memopt.callbacks.memory_monitor import MemoryMonitor
from lightning_memopt.functional.ddp_sync import check_ddp_for_micro_batches
from lightning_memopt.utilities.checks import check_positive_int
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
        name = type(strategy).__name__
        if any(word in name for word in ("FSDP", "DeepSpeed", "ModelParallel", "Tensor")) or (
            trainer.world_size > 1 and not is_instance(strategy, "strategies.DDPStrategy")
        ):
            raise ValueError(
                f"AutoMicroBatch cannot split the batches of strategy {name}: it runs collectives inside forward and"
                " backward, which a rank that ran out of memory never reaches (the others would hang). It works on"
                ' one device and with DDP (`strategy="ddp"`); remove the callback for this strategy.'
            )
        if not self._restored:
            self._reset()
        self._first_size = None
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
        size = state_dict.get("micro_batch_size")
        self.micro_batch_size = int(size) if size is not None else self.micro_batch_size
        self.retries = int(state_dict.get("retries", 0))
        self._restored = True

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
