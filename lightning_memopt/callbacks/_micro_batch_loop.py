"""The Lightning side of ``AutoMicroBatch``: its automatic-optimization loop, whose closure runs micro-batches.

The loop replaces ``trainer.fit_loop.epoch_loop.automatic_optimization`` during fit. Its closure calls Lightning's own
``training_step`` and backward hooks once per micro-batch, through
:func:`~lightning_memopt.functional.micro_batch_retry.run_micro_batches`, which holds the retry logic. Lightning's
classes are private: they are looked up in the Trainer's namespace (``lightning.pytorch`` or ``pytorch_lightning``).
"""

from __future__ import annotations

import functools
import importlib
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_memopt.functional.ddp_sync import gradient_reduction
from lightning_memopt.functional.memory import empty_device_cache
from lightning_memopt.functional.micro_batch import count_samples, micro_batch_of
from lightning_memopt.functional.micro_batch_retry import (
    BUCKET_BYTES,
    Agreement,
    MicroBatchPart,
    combine_losses,
    extend_message,
    give_up_note,
    mark_micro_batch,
    micro_batch_weight,
    restore_grads,
    run_micro_batches,
    snapshot_grads,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult, _AutomaticOptimization

    from lightning_memopt.callbacks.auto_micro_batch import AutoMicroBatch

__all__ = ["MicroBatchOptimization", "optimization_class"]


class _MicroBatchClosure:
    """Lightning's closure, with training_step + backward run once per micro-batch (mixed into the Trainer's own)."""

    def __init__(self, run: Callable[[], ClosureResult]) -> None:
        super().__init__(step_fn=run)  # type: ignore[call-arg]  # Lightning's Closure, mixed in by optimization_class

    @torch.enable_grad()
    def closure(self, *args: Any, **kwargs: Any) -> ClosureResult:
        return self._step_fn()  # type: ignore[attr-defined]  # set by Lightning's Closure.__init__


@functools.cache
def optimization_class(namespace: str) -> type:
    """:class:`MicroBatchOptimization` on the automatic-optimization loop of ``namespace`` (the Trainer's own)."""
    automatic = importlib.import_module(f"{namespace}.loops.optimization.automatic")
    closure = type("_MicroBatchClosure", (_MicroBatchClosure, automatic.Closure), {})
    return type(
        "_MicroBatchOptimization",
        (MicroBatchOptimization, automatic._AutomaticOptimization),
        {
            "_closure_class": closure,
            "_result_class": automatic.ClosureResult,
            "_call": importlib.import_module(f"{namespace}.trainer.call"),
        },
    )


class MicroBatchOptimization:
    """Lightning's automatic optimization with the closure replaced; its progress counters are the original's.

    A mixin: :func:`optimization_class` puts it in front of the loop class of the Trainer's namespace.
    """

    _closure_class: type
    _result_class: type[ClosureResult]
    _call: Any
    trainer: pl.Trainer  # set by Lightning's loop

    def __init__(self, trainer: pl.Trainer, owner: AutoMicroBatch, original: _AutomaticOptimization) -> None:
        super().__init__(trainer)  # type: ignore[call-arg]  # Lightning's _AutomaticOptimization, mixed in
        self.optim_progress = original.optim_progress  # checkpointed: the same object keeps counting
        self._skip_backward = original._skip_backward
        self._owner = owner

    def _make_closure(self, kwargs: OrderedDict, optimizer: torch.optim.Optimizer, batch_idx: int) -> Closure:
        zero_grad_fn = self._make_zero_grad_fn(batch_idx, optimizer)  # type: ignore[attr-defined]  # Lightning's
        backward_fn = self._make_backward_fn(optimizer)  # type: ignore[attr-defined]  # Lightning's
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
        n = count_samples(batch, owner.batch_size)
        size = owner.micro_batch_size if owner.micro_batch_size is not None else n
        owner.micro_batch_size = size
        if owner._first_size is None:
            owner._check_first(trainer, batch, n)
            owner._first_size = size
        accumulate = trainer.accumulate_grad_batches
        params = [p for p in pl_module.parameters() if p.requires_grad]
        active = trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()
        no_sync = getattr(trainer.strategy, "block_backward_sync", None)  # DDP's; the only strategy let through
        comm = Agreement(active, trainer.strategy.root_device, no_sync)
        # the gradients to go back to after an out-of-memory error: those accumulated by the window's earlier batches
        saved = None
        if zero_grad_fn is None and backward_fn is not None and accumulate > 1:
            saved = snapshot_grads(params)
        # under DDP every micro-batch runs without the reducer; the stepping batch syncs once, at its end
        sync_at_end = comm.active and backward_fn is not None and not trainer.fit_loop._should_accumulate()
        # ... through the DDP communication hook the user registered, if any (on DDP's own buckets)
        reduce = gradient_reduction(trainer.strategy.model) if sync_at_end else None
        bucket_bytes = getattr(trainer.strategy.model, "bucket_bytes_cap", BUCKET_BYTES)  # DDP's bucket_cap_mb
        results = trainer._results
        snapshot = owner._keep(pl_module, results, size)  # before the first attempt: what a retry puts back
        zeroed = [False]

        def step(start: int, stop: int) -> MicroBatchPart:
            micro_kwargs = OrderedDict(kwargs)
            micro_kwargs["batch"] = micro_batch_of(batch, start, stop, n, owner.split_batch)
            if results is not None:  # epoch means weighted by micro-batch size (what Lightning infers)
                results.batch = micro_kwargs["batch"]
                results.batch_size = stop - start
            fx_name = pl_module._current_fx_name
            try:
                output = self._call._call_strategy_hook(trainer, "training_step", *micro_kwargs.values())
                trainer.strategy.post_training_step()
                result = self._result_class.from_training_step_output(output, 1)
                del output
                if zero_grad_fn is not None and not zeroed[0]:
                    zero_grad_fn()
                    zeroed[0] = True
                if backward_fn is not None and result.closure_loss is not None:
                    backward_fn(result.closure_loss * micro_batch_weight(stop - start, n, accumulate))
                return MicroBatchPart(stop - start, result.loss, result.extra)
            finally:  # a hook that raised leaves its own name behind (trainer/call.py)
                pl_module._current_fx_name = fx_name

        def give_up(err: BaseException, at: int) -> None:
            min_size = owner.min_micro_batch_size
            extend_message(err, give_up_note(at, n, min_size, owner._first_size, owner.retries))
            mark_micro_batch(err, n, at)  # the OOM report reads the whole batch here, its frames hold the slice

        def restore() -> None:
            restore_grads(params, saved, zeroed[0])
            owner._restore(snapshot)

        # logs after the closure (on_before_optimizer_step, on_train_batch_end) are weighted by the whole batch again
        whole = (results.batch, results.batch_size) if results is not None else None
        try:
            parts, _ = run_micro_batches(
                n,
                size,
                owner.min_micro_batch_size,
                step,
                agreement=comm,
                restore=restore,
                release=lambda: empty_device_cache(pl_module.device),
                on_halve=lambda old, new, here: owner._shrink(trainer, old, new, n, here, kwargs.get("batch_idx")),
                give_up=give_up,
            )
            owner._went_through(snapshot, pl_module)
            if sync_at_end:
                comm.average_gradients(params, reduce, bucket_bytes)
            return self._result_class(combine_losses(parts, n, accumulate), extra=parts[-1].extra if parts else {})
        finally:
            if results is not None and whole is not None:
                results.batch, results.batch_size = whole
