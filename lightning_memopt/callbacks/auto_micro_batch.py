"""AutoMicroBatch: survive out-of-memory by halving the micro-batch; same effective batch, same weights, same steps."""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import math
from collections import OrderedDict
from collections.abc import Callable
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_memopt.callbacks.memory_monitor import MemoryMonitor
from lightning_memopt.functional.memory import empty_device_cache
from lightning_memopt.functional.micro_batch import batch_size_of, slice_batch
from lightning_memopt.utilities.checks import check_positive_int
from lightning_memopt.utilities.namespaces import Callback, is_instance, namespace_of, rank_zero_info
from lightning_memopt.utilities.trainer import log_to_loggers
from lightning_memopt.utilities.warnings import WarnOnce

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult, _AutomaticOptimization

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

    Logged metrics (from rank zero, at each change and at the end of fit):
        * ``memory/micro_batch_size``: the micro-batch size in use (samples).
        * ``memory/micro_batch_retries``: batches run again after an out-of-memory error (count).

    Each change is printed once by rank zero with its reason and, when a ``MemoryMonitor`` is among the callbacks,
    written by every rank to its memory log as a record with ``event: "micro_batch"`` and the fields
    ``micro_batch_size``, ``previous_micro_batch_size``, ``batch_size``, ``retries`` and ``reason``
    (``lightning-memopt analyze`` lists the changes and marks them on the timeline).

    Device requirements: none; on CPU a simulated ``torch.OutOfMemoryError`` is handled the same way.

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
        if micro_batch_size != "auto" and micro_batch_size < min_micro_batch_size:
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
        self.micro_batch_size: int | None = None if micro_batch_size == "auto" else int(micro_batch_size)
        self.retries = 0
        self._first_size: int | None = None
        self._restored = False
        self._original: _AutomaticOptimization | None = None
        self._monitors: list[MemoryMonitor] = []
        self._warn = WarnOnce()

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
            self.micro_batch_size = None if self.start_micro_batch_size == "auto" else int(self.start_micro_batch_size)
            self.retries = 0
        self._first_size = None
        self._monitors = [c for c in trainer.callbacks if isinstance(c, MemoryMonitor)]
        epoch_loop = trainer.fit_loop.epoch_loop
        current = epoch_loop.automatic_optimization
        if not isinstance(current, _MicroBatchOptimization):
            self._original = current
            epoch_loop.automatic_optimization = _optimization_class(namespace_of(trainer).__name__)(
                trainer, self, current
            )

    def _give_back(self, trainer: pl.Trainer) -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        if isinstance(epoch_loop.automatic_optimization, _MicroBatchOptimization) and self._original is not None:
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

    # ------------------------------------------------------------------------------------------- splitting

    def _size_of(self, batch: Any) -> int:
        size = self.batch_size(batch) if self.batch_size is not None else batch_size_of(batch)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"AutoMicroBatch: the batch size of a batch must be a positive int, got {size!r}.")
        return size

    def _slice(self, batch: Any, start: int, stop: int, size: int) -> Any:
        if start == 0 and stop == size:
            return batch
        if self.split_batch is not None:
            return self.split_batch(batch, start, stop)
        return slice_batch(batch, start, stop, size)

    def _give_up(self, err: BaseException, size: int, n: int) -> None:
        """Extend the out-of-memory error's message with what was tried (the caller re-raises the same object)."""
        note = (
            f" [AutoMicroBatch: a micro-batch of {size} sample(s) of a batch of {n} still ran out of memory and the"
            f" smallest allowed is min_micro_batch_size={self.min_micro_batch_size}; tried micro-batches down from"
            f" {self._first_size or size} after {self.retries} earlier halving(s).]"
        )
        if err.args and isinstance(err.args[0], str):
            err.args = (err.args[0] + note, *err.args[1:])
        else:
            err.args = (*err.args, note)

    def _shrink(self, trainer: pl.Trainer, size: int, n: int, here: bool, batch_idx: int | None) -> None:
        """Halve the micro-batch after an out-of-memory error; say why (rank zero), log it, and record it."""
        new = max(self.min_micro_batch_size, size // 2)
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


class _MicroBatchClosure:
    """Lightning's closure, with training_step + backward run once per micro-batch (mixed into the Trainer's own)."""

    def __init__(self, run: Callable[[], ClosureResult]) -> None:
        super().__init__(step_fn=run)  # type: ignore[call-arg]

    @torch.enable_grad()
    def closure(self, *args: Any, **kwargs: Any) -> ClosureResult:
        return self._step_fn()  # type: ignore[attr-defined]


@functools.cache
def _optimization_class(namespace: str) -> type:
    """:class:`_MicroBatchOptimization` on the automatic-optimization loop of ``namespace`` (the Trainer's own)."""
    automatic = importlib.import_module(f"{namespace}.loops.optimization.automatic")
    closure = type("_MicroBatchClosure", (_MicroBatchClosure, automatic.Closure), {})
    return type(
        "_MicroBatchOptimization",
        (_MicroBatchOptimization, automatic._AutomaticOptimization),
        {
            "_closure_class": closure,
            "_result_class": automatic.ClosureResult,
            "_call": importlib.import_module(f"{namespace}.trainer.call"),
        },
    )


class _MicroBatchOptimization:
    """Lightning's automatic optimization with the closure replaced; its progress counters are the original's.

    A mixin: :func:`_optimization_class` puts it in front of the loop class of the Trainer's namespace.
    """

    _closure_class: type
    _result_class: type[ClosureResult]
    _call: Any

    def __init__(self, trainer: pl.Trainer, owner: AutoMicroBatch, original: _AutomaticOptimization) -> None:
        super().__init__(trainer)  # type: ignore[call-arg]
        self.optim_progress = original.optim_progress  # checkpointed: the same object keeps counting
        self._skip_backward = original._skip_backward
        self._owner = owner

    def _make_closure(self, kwargs: OrderedDict, optimizer: torch.optim.Optimizer, batch_idx: int) -> Closure:
        zero_grad_fn = self._make_zero_grad_fn(batch_idx, optimizer)  # type: ignore[attr-defined]
        backward_fn = self._make_backward_fn(optimizer)  # type: ignore[attr-defined]
        return self._closure_class(lambda: self._run_batch(kwargs, zero_grad_fn, backward_fn))

    def _run_batch(
        self,
        kwargs: OrderedDict,
        zero_grad_fn: Callable[[], None] | None,
        backward_fn: Callable[[Tensor], None] | None,
    ) -> ClosureResult:
        trainer, owner = self.trainer, self._owner
        pl_module = trainer.lightning_module
        batch = kwargs["batch"]
        n = owner._size_of(batch)
        if owner.micro_batch_size is None:
            owner.micro_batch_size = n
        if owner._first_size is None:
            owner._first_size = owner.micro_batch_size
        accumulate = trainer.accumulate_grad_batches
        params = [p for p in pl_module.parameters() if p.requires_grad]
        comm = _Agreement(trainer)
        # the gradients to go back to after an out-of-memory error: those accumulated by the window's earlier batches
        saved = None
        if zero_grad_fn is None and backward_fn is not None and accumulate > 1:
            saved = [None if p.grad is None else p.grad.detach().clone() for p in params]
        # under DDP every micro-batch runs without the reducer; the stepping batch syncs once, at its end
        sync_at_end = comm.active and backward_fn is not None and not trainer.fit_loop._should_accumulate()
        results = trainer._results
        # logs after the closure (on_before_optimizer_step, on_train_batch_end) are weighted by the whole batch again
        whole = (results.batch, results.batch_size) if results is not None else None
        try:
            return self._run_micro_batches(
                kwargs, batch, n, accumulate, params, comm, saved, sync_at_end, zero_grad_fn, backward_fn
            )
        finally:
            if whole is not None:
                results.batch, results.batch_size = whole

    def _run_micro_batches(
        self,
        kwargs: OrderedDict,
        batch: Any,
        n: int,
        accumulate: int,
        params: list[torch.nn.Parameter],
        comm: _Agreement,
        saved: list[Tensor | None] | None,
        sync_at_end: bool,
        zero_grad_fn: Callable[[], None] | None,
        backward_fn: Callable[[Tensor], None] | None,
    ) -> ClosureResult:
        trainer, owner = self.trainer, self._owner
        pl_module = trainer.lightning_module
        results = trainer._results
        zeroed = False
        while True:
            parts: list[tuple[int, Tensor | None, dict[str, Any]]] = []
            size = owner.micro_batch_size
            flag, error, here = _OK, None, False
            # every rank runs the same number of micro-batch rounds (a rank with fewer samples idles through the rest)
            for k in range(comm.max(math.ceil(n / size))):
                start, stop = k * size, min(n, (k + 1) * size)
                if start < n:
                    micro_kwargs = OrderedDict(kwargs)
                    micro_kwargs["batch"] = owner._slice(batch, start, stop, n)
                    if results is not None:  # epoch means weighted by micro-batch size (what Lightning infers)
                        results.batch = micro_kwargs["batch"]
                        results.batch_size = stop - start
                    fx_name = pl_module._current_fx_name
                    try:
                        with comm.no_sync():
                            output = self._call._call_strategy_hook(trainer, "training_step", *micro_kwargs.values())
                            trainer.strategy.post_training_step()
                            step = self._result_class.from_training_step_output(output, 1)
                            del output
                            if zero_grad_fn is not None and not zeroed:
                                zero_grad_fn()
                                zeroed = True
                            if backward_fn is not None and step.closure_loss is not None:
                                backward_fn(step.closure_loss * ((stop - start) / (n * accumulate)))
                        parts.append((stop - start, step.loss, step.extra))
                        del step
                    except torch.OutOfMemoryError as err:
                        here = True
                        if size <= owner.min_micro_batch_size:
                            owner._give_up(err, size, n)
                            if not comm.active:
                                raise
                            flag, error = _GIVE_UP, err
                        else:
                            flag = _RETRY
                    finally:
                        pl_module._current_fx_name = fx_name
                flag = comm.max(flag)  # every rank learns whether any rank ran out of memory in this round
                if flag != _OK:
                    break
            if flag == _GIVE_UP:
                if error is not None:
                    raise error
                raise torch.OutOfMemoryError(
                    f"AutoMicroBatch: another process ran out of memory at a micro-batch of {size} sample(s), the"
                    f" smallest allowed (min_micro_batch_size={owner.min_micro_batch_size}); every process stops."
                )
            if flag == _OK:
                break
            # out of the except block: the failed attempt's activations are unreachable now
            self._restore_grads(params, saved, zeroed)
            gc.collect()
            empty_device_cache(pl_module.device)
            owner._shrink(trainer, size, n, here, kwargs.get("batch_idx"))
        if sync_at_end:
            comm.average_gradients(params)
        return _combine(self._result_class, parts, n, accumulate)

    @staticmethod
    def _restore_grads(params: list[torch.nn.Parameter], saved: list[Tensor | None] | None, zeroed: bool) -> None:
        if saved is not None:
            for p, g in zip(params, saved):
                p.grad = None if g is None else g.clone()
        elif zeroed:  # the window starts with this batch: back to "just zeroed"
            for p in params:
                p.grad = None


_OK, _RETRY, _GIVE_UP = 0, 1, 2


class _Agreement:
    """The few collectives every rank runs in the same order, whatever happened locally (no-ops on one process)."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.strategy = trainer.strategy
        self.active = trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()
        self.device = trainer.strategy.root_device

    def max(self, value: int) -> int:
        if not self.active:
            return value
        flag = torch.tensor([value], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return int(flag.item())

    def no_sync(self) -> Any:
        return self.strategy.block_backward_sync() if self.active else contextlib.nullcontext()

    def average_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """One all-reduce for the step (per dtype), averaged as DDP does; a gradient no rank has stays ``None``."""
        world = torch.distributed.get_world_size()
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(has, op=torch.distributed.ReduceOp.MAX)
        synced = [p for p, h in zip(params, has.tolist()) if h]
        for p in synced:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in synced:
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for group in by_dtype.values():
            flat = torch.cat([p.grad.reshape(-1) for p in group])
            torch.distributed.all_reduce(flat)
            flat.div_(world)
            offset = 0
            for p in group:
                count = p.grad.numel()
                p.grad.copy_(flat[offset : offset + count].view_as(p.grad))
                offset += count


def _combine(
    result: type[ClosureResult], parts: list[tuple[int, Tensor | None, dict[str, Any]]], n: int, accumulate: int
) -> ClosureResult:
    """One result for the batch: the loss as Lightning reports it (the batch mean over accumulation), detached."""
    losses = [(m, loss) for m, loss, _ in parts if loss is not None]
    if not losses:
        return result(None, extra=parts[-1][2] if parts else {})
    total = sum(loss.detach().double() * (m / n) for m, loss in losses) / accumulate
    return result(total.to(losses[0][1].dtype), extra=parts[-1][2])
