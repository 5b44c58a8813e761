"""AutoMicroBatch: survive out-of-memory by halving the micro-batch; same effective batch, same weights, same steps."""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING, Any

from typing_extensions import override

from lightning_memopt.callbacks._micro_batch_loop import MicroBatchOptimization, optimization_class
from lightning_memopt.callbacks.memory_monitor import MemoryMonitor
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

    The DataLoader yields the batch that defines the effective batch (per device); ``training_step`` is unchanged and
    is called once per micro-batch with a slice of the batch. Each micro-batch's loss is weighted by its share of the
    batch's samples, so the gradients, the optimizer step, the step count, gradient clipping, LR schedulers and
    ``accumulate_grad_batches`` are those of the whole batch. When a micro-batch raises ``torch.OutOfMemoryError``
    (in forward or backward), the gradients are put back to what they were at the start of the batch, memory is
    released, the micro-batch size is halved and the batch is run again from its first sample: no sample is skipped
    or counted twice, and the optimizer steps exactly as often as without the callback.

    The micro-batch size never grows back within a run: a size that ran out of memory once would likely do so again
    (the peak of a step varies with the data), and every failed attempt costs a forward pass. It is saved in the
    checkpoint, so a resumed run starts at the size that worked; a new ``fit`` starts from ``micro_batch_size``.

    Under DDP every rank agrees after each micro-batch (a 1-element all-reduce): an out-of-memory error on one rank
    makes every rank restore its gradients and halve, so nothing hangs. Micro-batches run without DDP's gradient
    sync, and the gradients are all-reduced once, after the last micro-batch of a batch that steps the optimizer.
    Strategies that run collectives inside forward or backward (FSDP, DeepSpeed, model or tensor parallel) are
    refused in ``setup``. Collectives inside ``training_step`` itself (``self.log(..., sync_dist=True)`` on step
    logs, an ``all_gather`` of negatives, ``SyncBatchNorm``) cannot be made safe: a rank that ran out of memory
    before reaching one leaves the others waiting in it.

    Below ``min_micro_batch_size`` the original ``torch.OutOfMemoryError`` ends the run, its message extended with
    what was tried (``OOMReporter`` then writes its report). Other errors are never retried, nor are CUDA errors that
    are not allocator out-of-memory errors (``RuntimeError: CUDA error: out of memory`` from a kernel).

    Known differences to a run at the feasible micro-batch: ``self.log`` values of a failed attempt stay in the epoch
    aggregates, BatchNorm running statistics see the failed attempt's forward, and with ``accumulate_grad_batches >
    1`` a copy of the gradients is kept during a batch that is not the first of its window (to restore them on an
    out-of-memory error). Out-of-memory errors outside ``training_step`` and backward (the optimizer step, validation,
    checkpointing) are not retried.

    Args:
        micro_batch_size: The micro-batch size to start with; ``"auto"`` starts with the whole batch.
        min_micro_batch_size: The smallest micro-batch size to try before giving up.
        split_batch: ``fn(batch, start, stop)`` returning the samples ``[start, stop)`` of a batch, for batch types the
            default slicer does not handle (see :mod:`lightning_memopt.functional.micro_batch`).
        batch_size: ``fn(batch)`` returning the number of samples of a batch (default: the first dim of the first
            tensor in it).

    Logged metrics (to the Trainer's loggers):
        * ``memory/micro_batch_size``: the micro-batch size in use (samples), at each change and at the end of fit.
        * ``memory/micro_batch_retries``: batches run again after an out-of-memory error (count), at the end of fit.

    Each change is printed once by rank zero with its reason and, when a ``MemoryMonitor`` is among the callbacks,
    written by every rank to its memory log as a record with ``event: "micro_batch"`` and the fields
    ``micro_batch_size``, ``previous_micro_batch_size``, ``batch_size``, ``retries`` and ``reason``
    (``lightning-memopt analyze`` lists the changes and marks them on the timeline).

    Device requirements: none; on CPU a simulated ``torch.OutOfMemoryError`` is handled the same way.

    The splitting, the retry decision and the loss weights are Trainer-free:
    :func:`~lightning_memopt.functional.micro_batch_retry.run_micro_batches` and
    :mod:`lightning_memopt.functional.micro_batch`.

    Example:
        >>> from lightning.pytorch import Trainer
        >>> trainer = Trainer(callbacks=[AutoMicroBatch()], logger=False, enable_checkpointing=False)
        >>> AutoMicroBatch(micro_batch_size=8).micro_batch_size
        8
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
