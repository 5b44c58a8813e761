"""AutoMicroBatch: survive out-of-memory by halving the micro-batch; same effective batch, same weights, same steps.

Two parts, one way. The micro-batch loop replaces ``trainer.fit_loop.epoch_loop.automatic_optimization`` during fit:
its closure calls Lightning's own ``training_step`` and backward hooks once per micro-batch, through
:func:`~lightning_memopt.functional.micro_batch.retry.run_micro_batches` (the retry logic), and writes what it learns
into a :class:`MicroBatchState`. The callback installs the loop in ``setup``, gives the Trainer's own loop back at
teardown, and reads the state for its logs and its checkpoint. Lightning's loop classes are private: they are looked
up in the Trainer's namespace (``lightning.pytorch`` or ``pytorch_lightning``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_memopt.callbacks._micro_batch_eval import EVALUATION_STEPS, EvaluationSplitter, evaluation_agreement
from lightning_memopt.callbacks._micro_batch_state import (
    MicroBatchSettings,
    MicroBatchState,
    halving_line,
    report_halving,
)
from lightning_memopt.callbacks._states import restore_state
from lightning_memopt.callbacks.memory_monitor import MemoryMonitor
from lightning_memopt.functional.micro_batch.ddp_overlap import OverlappedReduction
from lightning_memopt.functional.micro_batch.ddp_sync import (
    check_ddp_for_micro_batches,
    check_strategy_for_micro_batches,
    gradient_reduction,
)
from lightning_memopt.functional.micro_batch.fsdp_sync import (
    check_fsdp_for_micro_batches,
    fsdp_modules,
    install_agreement,
    reset_fsdp_state,
    tensor_parallel_size,
)
from lightning_memopt.functional.micro_batch.outputs import combine_outputs
from lightning_memopt.functional.micro_batch.retry import (
    BUCKET_BYTES,
    Agreement,
    MicroBatchPart,
    agree_before_collectives,
    combine_losses,
    extend_message,
    give_up_note,
    loss_weight,
    mark_micro_batch,
    micro_batch_weight,
    restore_grads,
    run_micro_batches,
    snapshot_grads,
)
from lightning_memopt.functional.micro_batch.retry_state import BufferKeeper, ModuleParts, RetrySnapshot, find_parts
from lightning_memopt.functional.micro_batch.slicing import (
    check_first_batch,
    count_samples,
    loader_batch_size,
    micro_batch_of,
    sample_elements,
)
from lightning_memopt.functional.readings.memory import empty_device_cache
from lightning_memopt.utilities import _lightning_private as private
from lightning_memopt.utilities.checks import check_bool, check_positive_int
from lightning_memopt.utilities.namespaces import Callback, is_instance, namespace_of, rank_zero_only
from lightning_memopt.utilities.trainer import log_to_loggers
from lightning_memopt.utilities.warnings import WarnOnce

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult, _AutomaticOptimization

__all__ = ["AutoMicroBatch", "MicroBatchSettings", "MicroBatchState", "halving_line"]


# ----------------------------------------------------------------------------------------------- the loop


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
    automatic = private.automatic_optimization(namespace)
    closure = type("_MicroBatchClosure", (_MicroBatchClosure, automatic.Closure), {})
    return type(
        "_MicroBatchOptimization",
        (MicroBatchOptimization, automatic._AutomaticOptimization),
        {"_closure_class": closure, "_result_class": automatic.ClosureResult},
    )


@dataclasses.dataclass
class _Batch:
    """One training batch on its way through the loop: what each micro-batch step needs."""

    kwargs: OrderedDict
    samples: int
    accumulate: int
    zero_grad_fn: Callable[[], None] | None
    backward_fn: Callable[[Tensor], None] | None
    weight: float  # what the batch's loss is a mean over: its samples, or ``weight_fn(batch)``
    zeroed: bool = False  # whether this batch zeroed the gradients (the window starts with it)
    overlap: OverlappedReduction | None = None  # under DDP: averages the gradients during a whole-batch backward


def _loss_weight_of(weight_fn: Callable[[Any], Any] | None, batch: Any, samples: int, where: str) -> float:
    """The weight of ``batch`` in the loss: its ``samples``, or ``weight_fn(batch)`` (checked by ``loss_weight``)."""
    if weight_fn is None:
        return float(samples)
    return loss_weight(weight_fn(batch), where)


def _window_grads(batch: _Batch, params: Callable[[], list[torch.nn.Parameter]]) -> list[Tensor | None] | None:
    """A copy of the gradients accumulated by the window's earlier batches, when ``batch`` neither zeroes them nor
    skips backward and the window has more than one batch; else ``None``."""
    if batch.zero_grad_fn is None and batch.backward_fn is not None and batch.accumulate > 1:
        return snapshot_grads(params())
    return None


def _combined_extra(parts: Sequence[MicroBatchPart]) -> Any:
    """The extra outputs of the batch's micro-batches as one (``{}`` without micro-batches)."""
    if not parts:
        return {}
    return combine_outputs([(part.samples, part.extra) for part in parts])


#: Copies of in-place-changing buffers per batch from which ``AutoMicroBatch`` says what they cost (once).
LARGE_BUFFER_COPIES = 64 * 2**20


class MicroBatchOptimization:
    """Lightning's automatic optimization with the closure replaced; its progress counters are the original's.

    A mixin: :func:`optimization_class` puts it in front of the loop class of the Trainer's namespace. One per fit: it
    learns the module's buffers and parts during the fit, and writes the micro-batch it uses into ``state``.

    Args:
        trainer: the Trainer whose loop it replaces.
        original: that loop (given back at teardown: ``original``).
        settings: how to split batches and what a retry puts back.
        state: where the micro-batch in use and the retries are kept (read by the callback).
        warn: warns once per kind of problem.
        monitors: the ``MemoryMonitor`` callbacks whose memory logs record each halving.
    """

    _closure_class: type
    _result_class: type[ClosureResult]
    trainer: pl.Trainer  # set by Lightning's loop

    def __init__(
        self,
        trainer: pl.Trainer,
        original: _AutomaticOptimization,
        settings: MicroBatchSettings,
        state: MicroBatchState,
        warn: WarnOnce | None = None,
        monitors: Sequence[MemoryMonitor] = (),
    ) -> None:
        super().__init__(trainer)  # type: ignore[call-arg]  # Lightning's _AutomaticOptimization, mixed in
        self.optim_progress = original.optim_progress  # checkpointed: the same object keeps counting
        self._skip_backward = original._skip_backward
        self.original, self.settings, self.state = original, settings, state
        if warn is not None:
            self._warn = warn
        else:
            self._warn = WarnOnce()
        self._monitors = list(monitors)
        self._first_size: int | None = None  # the micro-batch of the fit's first batch (the final error names it)
        self._buffers = BufferKeeper()
        self._parts: ModuleParts | None = None  # found after the fit's first batch that went through
        #: what the ranks agree with, made once per fit: by :meth:`use_fsdp`, else at the first batch
        self.agreement: Agreement | None = None
        #: under FSDP2: the sharded modules (set by :meth:`use_fsdp`)
        self.fsdp_modules: list[torch.nn.Module] = []
        self._give_back_collectives: Callable[[], None] = lambda: None
        #: under DDP: the reduction overlapped with backward (made at the first stepping batch, again when the
        #: parameters that need a gradient change)
        self.overlap: OverlappedReduction | None = None

    def use_fsdp(self, modules: list[torch.nn.Module]) -> None:
        """Run under FSDP2: the collectives of ``modules`` agree first, an abandoned attempt resets their state."""
        self.agreement = self._new_agreement()
        install_agreement(modules, self.agreement)
        self.fsdp_modules = modules

    def _new_agreement(self, no_sync: Callable[[], Any] | None = None) -> Agreement:
        """The agreement of this fit's ranks (inactive on one process); ``no_sync`` holds DDP's reducer back. The
        strategy's collectives (a step's ``self.log(..., sync_dist=True)``) agree first until :meth:`release`."""
        trainer = self.trainer
        active = trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()
        agreement = Agreement(active, trainer.strategy.root_device, no_sync)
        if active:
            self._give_back_collectives = agree_before_collectives(trainer.strategy, agreement)
        return agreement

    def release(self) -> None:
        """Give the strategy its own collectives back (at the end of the fit)."""
        self._give_back_collectives()
        self._give_back_collectives = lambda: None
        if self.overlap is not None:
            self.overlap.remove()
            self.overlap = None

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
        trainer, settings = self.trainer, self.settings
        pl_module = trainer.lightning_module
        if self.agreement is None:  # one device, or DDP: its reducer held back during micro-batches
            self.agreement = self._new_agreement(getattr(trainer.strategy, "block_backward_sync", None))
        comm = self.agreement
        n = count_samples(kwargs["batch"], settings.batch_size_fn)
        size, per_sample = self._micro_batch_size(kwargs["batch"], n)
        weight = _loss_weight_of(settings.weight_fn, kwargs["batch"], n, "a batch")
        batch = _Batch(kwargs, n, trainer.accumulate_grad_batches, zero_grad_fn, backward_fn, weight)
        # listed only where a batch needs them (a retry, an accumulation window, DDP's sync): not on every batch
        params = functools.cache(lambda: [p for p in pl_module.parameters() if p.requires_grad])
        # the gradients to go back to after an out-of-memory error: those accumulated by the window's earlier batches
        saved = _window_grads(batch, params)
        # under DDP every micro-batch runs without the reducer; the stepping batch syncs once, at its end (FSDP2
        # reduce-scatters every micro-batch's gradients itself, as under Lightning's accumulation)
        sync_at_end = (
            comm.active and not self.fsdp_modules and backward_fn is not None and not private.should_accumulate(trainer)
        )
        reduce = None
        if sync_at_end:
            reduce = gradient_reduction(trainer.strategy.model)  # DDP's hook, if any
            if reduce is None:
                batch.overlap = self._overlap(params())
        results = private.logged_results(trainer)
        snapshot = self._keep(pl_module, results, size)  # before the first attempt: what a retry puts back

        def restore(_start: int) -> None:  # the batch runs again from its first sample
            if self.fsdp_modules:  # unsharded parameters and FSDP2's trackers of the abandoned attempt
                reset_fsdp_state(self.fsdp_modules)
            restore_grads(params(), saved, batch.zeroed)
            self._restore(snapshot)

        # logs after the closure (on_before_optimizer_step, on_train_batch_end) are weighted by the whole batch again
        whole = private.results_batch(results)
        give_back_backward = _wrap_backward(pl_module, batch.overlap)
        try:
            parts, _ = run_micro_batches(
                n,
                size,
                settings.min_micro_batch_size,
                functools.partial(self._step, batch),
                agreement=comm,
                restore=restore,
                release=lambda: empty_device_cache(pl_module.device),
                on_halve=lambda old, new, here: self._halved((old, new, n, here, per_sample), kwargs.get("batch_idx")),
                give_up=lambda err, at: self._give_up(err, n, at),
            )
            self._went_through(snapshot, pl_module)
            if sync_at_end and not (batch.overlap is not None and batch.overlap.reduced):
                # after the batch: through the DDP communication hook the user registered, if any (on DDP's own
                # buckets), else one bucket at a time
                comm.average_gradients(params(), reduce, self._bucket_bytes())
            extra = _combined_extra(parts)
            return self._result_class(combine_losses(parts, batch.weight, batch.accumulate), extra=extra)
        finally:
            give_back_backward()
            private.point_results(results, *whole)

    def _bucket_bytes(self) -> int:
        return int(getattr(self.trainer.strategy.model, "bucket_bytes_cap", BUCKET_BYTES))  # DDP's bucket_cap_mb

    def _overlap(self, params: list[torch.nn.Parameter]) -> OverlappedReduction:
        """The reduction overlapped with backward for ``params`` (made again when they changed)."""
        assert self.agreement is not None
        if self.overlap is None or not self.overlap.matches(params):
            if self.overlap is not None:
                self.overlap.remove()
            self.overlap = OverlappedReduction(params, self.agreement, self._bucket_bytes())
        return self.overlap

    def _micro_batch_size(self, batch: Any, n: int) -> tuple[int, int]:
        """The micro-batch this batch starts with (the smallest over the ranks) and its elements per sample; on the
        fit's first batch, check that the batch can be split."""
        per_sample = sample_elements(batch, n)
        size = self.state.size_for(n, per_sample, self.settings.min_micro_batch_size)
        if self.agreement is not None and self.state.elements is not None:  # learned from each rank's own shapes
            size = self.agreement.min(size)
        self.state.micro_batch_size = size
        if self._first_size is None:
            expected = loader_batch_size(self.trainer.train_dataloader)
            settings = self.settings
            warning = check_first_batch(batch, n, settings.split_batch_fn, settings.batch_size_fn, expected)
            if warning is not None:
                self._warn.warn("split-dim", warning)
            self._first_size = size
        return size, per_sample

    def _step(self, batch: _Batch, start: int, stop: int) -> MicroBatchPart:
        """``training_step`` and backward on the samples ``[start, stop)``, the loss weighted by their share."""
        trainer, pl_module = self.trainer, self.trainer.lightning_module
        micro_kwargs = OrderedDict(batch.kwargs)
        micro_kwargs["batch"] = micro_batch_of(
            batch.kwargs["batch"], start, stop, batch.samples, self.settings.split_batch_fn
        )
        # epoch means weighted by micro-batch size (what Lightning infers)
        private.point_results(private.logged_results(trainer), micro_kwargs["batch"], stop - start)
        fx_name = private.current_fx_name(pl_module)
        if batch.overlap is not None and start == 0:  # the attempt's first micro-batch: its backward may all-reduce
            batch.overlap.arm(more=stop < batch.samples)
        try:
            output = private.call_strategy_hook(trainer, "training_step", *micro_kwargs.values())
            trainer.strategy.post_training_step()
            result = self._result_class.from_training_step_output(output, 1)
            del output
            if batch.zero_grad_fn is not None and not batch.zeroed:
                batch.zero_grad_fn()
                batch.zeroed = True
            weight = self._weight(micro_kwargs["batch"], stop - start)
            if batch.backward_fn is not None and result.closure_loss is not None and weight > 0:
                batch.backward_fn(result.closure_loss * micro_batch_weight(weight, batch.weight, batch.accumulate))
            if batch.overlap is not None:
                batch.overlap.finish_step()  # no backward ran: its window all the same, as on the other ranks
            return MicroBatchPart(stop - start, result.loss, result.extra, weight)
        finally:  # a hook that raised leaves its own name behind (trainer/call.py)
            private.set_current_fx_name(pl_module, fx_name)

    def _weight(self, micro: Any, samples: int) -> float:
        """A micro-batch's weight in the batch's loss: its samples, or ``weight_fn(micro)`` (a weight of 0, a
        micro-batch with nothing the loss counts, runs no backward: its mean is undefined)."""
        return _loss_weight_of(self.settings.weight_fn, micro, samples, "a micro-batch")

    # ------------------------------------------------------------------------------------------- what a retry needs

    def _keep(self, pl_module: pl.LightningModule, results: Any, size: int) -> RetrySnapshot | None:
        """What the batch's attempts may change, kept before the first; ``None`` when no retry can follow."""
        settings = self.settings
        if size <= settings.min_micro_batch_size:  # an out-of-memory error at this size ends the run
            return None
        snapshot = RetrySnapshot(
            pl_module,
            results if settings.restore_metrics else None,
            rng=settings.restore_rng,
            metrics=settings.restore_metrics,
            buffers=self._buffers if settings.restore_buffers else None,
            parts=self._parts,
        )
        held = self._buffers.copied_bytes()
        if held >= LARGE_BUFFER_COPIES:
            self._warn.warn(
                "buffer-copies",
                f"AutoMicroBatch copies {held / 2**20:.0f} MiB of buffers that change in place (such as a queue) before"
                " each batch, to put them back after an out-of-memory error (in host memory for large ones, one copy"
                " reused all fit). `AutoMicroBatch(restore_buffers=False)` skips the copies.",
            )
        return snapshot

    def _went_through(self, snapshot: RetrySnapshot | None, pl_module: pl.LightningModule) -> None:
        """A batch went through: learn the buffers it changed; find the module's parts once, after the first."""
        if snapshot is not None:
            snapshot.succeeded()
            if self._parts is None:
                self._parts = find_parts(pl_module)

    def _restore(self, snapshot: RetrySnapshot | None) -> None:
        if snapshot is None:
            return
        lost = snapshot.restore()
        if lost:
            self._warn.warn(
                f"lost:{lost}",
                f"AutoMicroBatch could not put back the buffers {lost} after an out-of-memory error: no earlier batch"
                " had changed them, so they were not copied (they are from now on).",
            )

    def _give_up(self, err: BaseException, samples: int, size: int) -> None:
        """The smallest micro-batch ran out of memory: say what was tried in the error that ends the run."""
        min_size, retries = self.settings.min_micro_batch_size, self.state.retries
        extend_message(err, give_up_note(size, samples, min_size, self._first_size, retries))
        mark_micro_batch(err, samples, size)  # the OOM report reads the whole batch here, its frames hold the slice

    def _halved(self, halving: tuple[int, int, int, bool, int], batch_idx: int | None) -> None:
        """Take the halved micro-batch (the batch runs again with it) and say why."""
        report_halving(self.trainer, self.state, halving, batch_idx, "fit", self._warn, self._monitors)


def _wrap_backward(pl_module: pl.LightningModule, overlap: OverlappedReduction | None) -> Callable[[], None]:
    """Run ``pl_module.backward`` (what Lightning's precision plugin calls) inside the overlap's windows; returns the
    function that gives the method back."""
    if overlap is None:
        return lambda: None
    had_own = "backward" in vars(pl_module)
    own = vars(pl_module).get("backward")
    pl_module.backward = overlap.wrap_backward(pl_module.backward)  # type: ignore[method-assign]

    def give_back() -> None:
        if had_own:
            setattr(pl_module, "backward", own)  # noqa: B010  (an instance attribute the user set)
        else:
            del pl_module.backward

    return give_back


# ----------------------------------------------------------------------------------------------- the callback


class AutoMicroBatch(Callback):
    """Runs each batch as micro-batches and halves the micro-batch when one runs out of memory: in training, and in
    validation, test and predict.

    Training: ``training_step`` is unchanged and is called once per micro-batch with a slice of the batch. Each
    micro-batch's loss is weighted by its share of the batch's samples, so the optimizer step count, clipping, LR
    schedulers and ``accumulate_grad_batches`` are those of the whole batch, and so are the gradients of a loss that is
    a mean over samples. On ``torch.OutOfMemoryError`` in forward or backward the gradients go back to the batch's
    start, the micro-batch is halved and the batch runs again from its first sample. The extra outputs of
    ``training_step`` reach ``on_train_batch_end`` put back together for the whole batch
    (:mod:`~lightning_memopt.functional.micro_batch.outputs`).

    Evaluation: ``validation_step``, ``test_step`` and ``predict_step`` run with the whole loader batch until one runs
    out of memory; then what that micro-batch logged or updated is put back, the micro-batch is halved and the batch
    goes on from the micro-batch that failed, in ``fit`` and in ``validate``/``test``/``predict``. Each stage keeps its
    own micro-batch (the smaller size stays for the stage's later batches and runs). ``self.log`` values are weighted
    by each micro-batch's samples; the ``on_*_batch_end`` hooks, the predictions ``trainer.predict`` returns and
    prediction writers get one output per loader batch, put back together. The logged epoch values, metric results
    and predictions are those of evaluating with a loader batch of the micro-batch size.

    Args:
        micro_batch_size: The micro-batch size to start with; ``"auto"`` (default) starts with the whole batch.
        min_micro_batch_size: The smallest micro-batch size to try (default 1); an out-of-memory error at this size or
            below ends the run.
        split_batch_fn: ``fn(batch, start, stop)`` returning the samples ``[start, stop)`` of a batch; ``None``
            (default): the default slicer of :mod:`lightning_memopt.functional.micro_batch.slicing`.
        batch_size_fn: ``fn(batch)`` returning the number of samples of a batch; ``None`` (default): the first dim of
            the first tensor in it.
        restore_rng: Put the random states (torch CPU and accelerators, ``random``, NumPy) back to the batch's start
            before a retry, so that dropout draws what a run at the smaller micro-batch draws (default ``True``).
        restore_metrics: Put the states of the ``torchmetrics`` metrics among the module's submodules and the
            ``self.log`` results back before a retry (default ``True``).
        restore_buffers: Put the module's buffers (BatchNorm running statistics) back before a retry (default
            ``True``); each batch copies the buffers that batches change (all of them before the first batch).
        weight_fn: ``fn(batch)`` returning what the training loss is a mean over, for a batch and for each
            micro-batch (a number or a 1-element tensor); ``None`` (default): the number of samples. A loss that is a
            mean over tokens (the Hugging Face default: non-padded label tokens) needs
            ``weight_fn=lambda batch: (batch["labels"] != -100).sum()``: each micro-batch's loss is then weighted by
            its share of the batch's tokens, and the update equals the whole batch's.
        train: Split training batches (default ``True``; needs automatic optimization).
        evaluate: Split validation, test and predict batches on out-of-memory (default ``True``).

    A retry cannot undo what ``training_step`` does outside these: Python attributes it sets, prints, logger calls.

    Strategies: one device, DDP, and FSDP2 through ``ModelParallelStrategy(tensor_parallel_size=1)`` with
    ``fully_shard`` per block and on the root in ``configure_model``. When any rank runs out of memory, every rank
    halves together. Under FSDP2 each all-gather and reduce-scatter of a micro-batch is preceded by a small
    all-reduce, so that all ranks stop at the same collective
    (:mod:`~lightning_memopt.functional.micro_batch.fsdp_sync`, which
    also gives the cost). An out-of-memory error raised inside a collective itself ends the run. FSDP1
    (``FSDPStrategy``), DeepSpeed and tensor parallelism are refused in ``setup``.

    Under DDP the gradients of a batch that every rank runs as one micro-batch (no out-of-memory error yet) are
    all-reduced bucket by bucket during its backward, as DDP's reducer does; once batches run as several micro-batches
    they are averaged after the last one (:mod:`~lightning_memopt.functional.micro_batch.ddp_overlap`).

    Under several processes a step may call collectives through the strategy (``self.log(..., sync_dist=True)``,
    ``self.all_gather``): each is preceded by an agreement point while a micro-batch runs, so a rank that ran out of
    memory before it never leaves the others waiting in it.

    Logs (rank zero, to the Trainer's loggers): ``memory/micro_batch_size`` (samples) at each change and at the end of
    fit, ``memory/micro_batch_retries`` (count) at the end of fit; ``memory/<stage>/micro_batch_size`` at each change
    of an evaluation stage's micro-batch (``validate``, ``test``, ``predict``). Each change is also printed by rank
    zero and, with a ``MemoryMonitor`` among the callbacks, written to every rank's memory log as an
    ``event: "micro_batch"`` record (``phase``: the stage). A fit without an out-of-memory error prints nothing. The
    checkpoint holds the micro-batch size, the retry count and each evaluation stage's micro-batch size.

    Examples:
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
        split_batch_fn: Callable[[Any, int, int], Any] | None = None,
        batch_size_fn: Callable[[Any], int] | None = None,
        restore_rng: bool = True,
        restore_metrics: bool = True,
        restore_buffers: bool = True,
        weight_fn: Callable[[Any], Any] | None = None,
        train: bool = True,
        evaluate: bool = True,
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
        for name, fn in (
            ("split_batch_fn", split_batch_fn),
            ("batch_size_fn", batch_size_fn),
            ("weight_fn", weight_fn),
        ):
            if fn is not None and not callable(fn):
                raise ValueError(f"`{name}` must be a function or None, got {fn!r} ({type(fn).__name__}).")
        flags = {"restore_rng": restore_rng, "restore_metrics": restore_metrics, "restore_buffers": restore_buffers}
        for name, flag in {**flags, "train": train, "evaluate": evaluate}.items():
            check_bool(name, flag)
        self.train, self.evaluate = train, evaluate
        self.restore_rng, self.restore_metrics, self.restore_buffers = restore_rng, restore_metrics, restore_buffers
        self.start_micro_batch_size = micro_batch_size
        self.min_micro_batch_size = min_micro_batch_size
        self.split_batch_fn = split_batch_fn
        self.batch_size_fn = batch_size_fn
        self.weight_fn = weight_fn
        self._state = self._fresh_state()
        self._restored = False
        self._fsdp2 = False
        self._warn = WarnOnce()
        self._eval_states = {stage: MicroBatchState() for stage in EVALUATION_STEPS}
        self._splitter: EvaluationSplitter | None = None

    def _fresh_state(self) -> MicroBatchState:
        start = self.start_micro_batch_size
        return MicroBatchState(start=None if start == "auto" else int(start))

    @property
    def micro_batch_size(self) -> int | None:
        """The micro-batch of the latest batch (before the first: the configured start; ``None`` with ``"auto"``)."""
        state = self._state
        return state.micro_batch_size if state.micro_batch_size is not None else state.start

    @property
    def retries(self) -> int:
        """How many times the micro-batch was halved (in this fit, or since the checkpoint's run started)."""
        return self._state.retries

    @property
    def eval_micro_batch_sizes(self) -> dict[str, int | None]:
        """Each evaluation stage's micro-batch (``"validate"``, ``"test"``, ``"predict"``); ``None``: the whole batch
        (no out-of-memory error in that stage yet)."""
        return {stage: state.micro_batch_size for stage, state in self._eval_states.items()}

    @cached_property
    def state_key(self) -> str:
        return self._generate_state_key(min_micro_batch_size=self.min_micro_batch_size)

    # ------------------------------------------------------------------------------------------- setup / teardown

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        namespace = namespace_of(trainer).__name__
        private.check_private_api(namespace)
        strategy = trainer.strategy
        is_ddp = is_instance(strategy, "strategies.DDPStrategy")
        tensor_parallel = 1
        if is_instance(strategy, "strategies.ModelParallelStrategy"):
            tensor_parallel = tensor_parallel_size(strategy.device_mesh)  # type: ignore[attr-defined]  # made before setup
        self._fsdp2 = is_instance(strategy, "strategies.ModelParallelStrategy") and tensor_parallel == 1
        name = type(strategy).__name__
        check_strategy_for_micro_batches(name, trainer.world_size, is_ddp, self._fsdp2, tensor_parallel)
        if stage == "fit" and self.train:
            self._install_training(trainer, pl_module, namespace)

    def _settings(self) -> MicroBatchSettings:
        return MicroBatchSettings(
            self.min_micro_batch_size,
            self.split_batch_fn,
            self.batch_size_fn,
            self.restore_rng,
            self.restore_metrics,
            self.restore_buffers,
            self.weight_fn,
        )

    def _monitors(self, trainer: pl.Trainer) -> list[MemoryMonitor]:
        callbacks: list[Any] = getattr(trainer, "callbacks", [])
        return [c for c in callbacks if isinstance(c, MemoryMonitor)]

    def _install_training(self, trainer: pl.Trainer, pl_module: pl.LightningModule, namespace: str) -> None:
        if not pl_module.automatic_optimization:
            raise ValueError(
                "AutoMicroBatch needs automatic optimization to split training batches: `training_step` calls"
                " `manual_backward` itself when `self.automatic_optimization = False`, so there is no backward to"
                " split. Use `AutoMicroBatch(train=False)` to split only evaluation batches, or use automatic"
                " optimization."
            )
        if not self._restored:
            self._state = self._fresh_state()
        epoch_loop = trainer.fit_loop.epoch_loop
        original = epoch_loop.automatic_optimization
        if isinstance(original, MicroBatchOptimization):  # left by a fit that never reached teardown
            original = original.original
        loop_class = optimization_class(namespace)
        epoch_loop.automatic_optimization = loop_class(
            trainer, original, self._settings(), self._state, self._warn, self._monitors(trainer)
        )

    # ------------------------------------------------------------------------------------------- evaluation

    def _start_evaluation(self, trainer: pl.Trainer, stage: str) -> None:
        self._stop_evaluation()
        if not self.evaluate:
            return
        loop = trainer.fit_loop.epoch_loop.automatic_optimization
        training = loop.agreement if isinstance(loop, MicroBatchOptimization) and loop.fsdp_modules else None
        agreement = evaluation_agreement(trainer, training)
        state = self._eval_states[stage]
        self._splitter = EvaluationSplitter(
            trainer, stage, self._settings(), state, agreement, self._warn, self._monitors(trainer)
        )

    def _stop_evaluation(self) -> None:
        if self._splitter is not None:
            self._splitter.remove()
            self._splitter = None

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_evaluation(trainer, "validate")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_evaluation()

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_evaluation(trainer, "test")

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_evaluation()

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_evaluation(trainer, "predict")

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_evaluation()

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.train:
            return
        check_ddp_for_micro_batches(trainer.strategy.model)  # DDP wraps the model after setup, before this hook
        if not self._fsdp2:
            return
        loop = trainer.fit_loop.epoch_loop.automatic_optimization
        if isinstance(loop, MicroBatchOptimization):  # sharded in configure_model, after setup
            check_fsdp_for_micro_batches(pl_module)
            loop.use_fsdp(fsdp_modules(pl_module))

    def _give_back(self, trainer: pl.Trainer) -> None:
        self._stop_evaluation()
        epoch_loop = trainer.fit_loop.epoch_loop
        if isinstance(epoch_loop.automatic_optimization, MicroBatchOptimization):
            epoch_loop.automatic_optimization.release()
            epoch_loop.automatic_optimization = epoch_loop.automatic_optimization.original
        self._restored = False

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
        self._give_back(trainer)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._give_back(trainer)

    def _restore_training_size(self, size: int | None, elements: int | None) -> None:
        """Take a checkpoint's learned training micro-batch, unless ``micro_batch_size`` was given: that one wins,
        and rank zero is warned once when the checkpoint's differs."""
        given = self.start_micro_batch_size
        if given == "auto":
            if size is not None:  # the start until the next halving (an older checkpoint's only size)
                self._state.micro_batch_size = self._state.start = size
            self._state.elements = elements
            return
        self._state.micro_batch_size, self._state.start, self._state.elements = None, int(given), None
        if size is not None and size != given and rank_zero_only.rank == 0:
            self._warn.warn(
                "checkpoint_size",
                f"AutoMicroBatch: the checkpoint's micro-batch size {size} is not used: `micro_batch_size={given}` was"
                f' given and wins, so micro-batches start at {given}. Pass `micro_batch_size="auto"` to go on from'
                f" the checkpoint's {size}.",
            )

    # ------------------------------------------------------------------------------------------- checkpoint

    @override
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "micro_batch_size": self.micro_batch_size,
            "retries": self.retries,
            "micro_batch_elements": self._state.elements,
        }
        for stage, eval_state in self._eval_states.items():
            state[f"{stage}_micro_batch_size"] = eval_state.micro_batch_size
            state[f"{stage}_micro_batch_elements"] = eval_state.elements
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the size; a bad or missing one raises, a bad ``retries`` warns."""
        state = restore_state("AutoMicroBatch", state_dict)
        self._restore_training_size(state["micro_batch_size"], state["micro_batch_elements"])
        self._state.retries, self._restored = state["retries"], True
        for stage, eval_state in self._eval_states.items():
            eval_state.micro_batch_size = eval_state.start = state[f"{stage}_micro_batch_size"]
            eval_state.elements = state[f"{stage}_micro_batch_elements"]
