"""AutoMicroBatch: survive out-of-memory by halving the micro-batch; same effective batch, same weights, same steps.

Two parts, one way. The micro-batch loop replaces ``trainer.fit_loop.epoch_loop.automatic_optimization`` during fit:
its closure calls Lightning's own ``training_step`` and backward hooks once per micro-batch, through
:func:`~lightning_memopt.functional.micro_batch_retry.run_micro_batches` (the retry logic), and writes what it learns
into a :class:`MicroBatchState`. The callback installs the loop in ``setup``, gives the Trainer's own loop back at
teardown, and reads the state for its logs and its checkpoint. Lightning's loop classes are private: they are looked
up in the Trainer's namespace (``lightning.pytorch`` or ``pytorch_lightning``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_memopt.callbacks._states import restore_state
from lightning_memopt.callbacks.memory_monitor import MemoryMonitor
from lightning_memopt.functional.ddp_sync import (
    check_ddp_for_micro_batches,
    check_strategy_for_micro_batches,
    gradient_reduction,
)
from lightning_memopt.functional.fsdp_sync import (
    check_fsdp_for_micro_batches,
    fsdp_modules,
    install_agreement,
    reset_fsdp_state,
)
from lightning_memopt.functional.memory import empty_device_cache
from lightning_memopt.functional.micro_batch import check_first_batch, count_samples, loader_batch_size, micro_batch_of
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
from lightning_memopt.functional.retry_state import BufferKeeper, ModuleParts, RetrySnapshot, find_parts
from lightning_memopt.utilities.checks import check_bool, check_positive_int
from lightning_memopt.utilities.formatting import wrap_to_width
from lightning_memopt.utilities.namespaces import Callback, is_instance, namespace_of, rank_zero_info
from lightning_memopt.utilities.trainer import log_to_loggers
from lightning_memopt.utilities.warnings import WarnOnce

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult, _AutomaticOptimization

__all__ = ["AutoMicroBatch"]


@dataclasses.dataclass
class MicroBatchState:
    """What the micro-batch loop learns; :class:`AutoMicroBatch` reads it for its logs and checkpoints it.

    Attributes:
        micro_batch_size: the micro-batch in use; ``None`` until the first batch when starting with the whole batch.
        retries: how many times the micro-batch was halved.
    """

    micro_batch_size: int | None = None
    retries: int = 0


@dataclasses.dataclass(frozen=True)
class MicroBatchSettings:
    """How the micro-batch loop splits batches and what a retry puts back (``AutoMicroBatch``'s arguments)."""

    min_micro_batch_size: int = 1
    split_batch_fn: Callable[[Any, int, int], Any] | None = None
    batch_size_fn: Callable[[Any], int] | None = None
    restore_rng: bool = True
    restore_metrics: bool = True
    restore_buffers: bool = True


def halving_line(size: int, new: int, reason: str, samples: int, global_step: int) -> str:
    """What rank zero prints when the micro-batch is halved, wrapped to 100 columns.

    Examples:
        >>> halving_line(16, 8, "out of memory", 16, 0)
        'AutoMicroBatch: micro-batch 16 -> 8 (out of memory; batch of 16, global step 0).'
    """
    line = f"AutoMicroBatch: micro-batch {size} -> {new} ({reason}; batch of {samples}, global step {global_step})."
    return wrap_to_width(line)


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


@dataclasses.dataclass
class _Batch:
    """One training batch on its way through the loop: what each micro-batch step needs."""

    kwargs: OrderedDict
    samples: int
    accumulate: int
    zero_grad_fn: Callable[[], None] | None
    backward_fn: Callable[[Tensor], None] | None
    zeroed: bool = False  # whether this batch zeroed the gradients (the window starts with it)


class MicroBatchOptimization:
    """Lightning's automatic optimization with the closure replaced; its progress counters are the original's.

    A mixin: :func:`optimization_class` puts it in front of the loop class of the Trainer's namespace. One per fit: it
    learns the module's buffers and parts during the fit, and writes the micro-batch it uses into ``state``.

    Args:
        trainer: the Trainer whose loop it replaces.
        original: that loop (given back at teardown: :attr:`original`).
        settings: how to split batches and what a retry puts back.
        state: where the micro-batch in use and the retries are kept (read by the callback).
        warn: warns once per kind of problem.
        monitors: the ``MemoryMonitor`` callbacks whose memory logs record each halving.
    """

    _closure_class: type
    _result_class: type[ClosureResult]
    _call: Any
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
        self._warn = warn if warn is not None else WarnOnce()
        self._monitors = list(monitors)
        self._first_size: int | None = None  # the micro-batch of the fit's first batch (the final error names it)
        self._buffers = BufferKeeper()
        self._parts: ModuleParts | None = None  # found after the fit's first batch that went through
        #: what the ranks agree with, made once per fit: by :meth:`use_fsdp`, else at the first batch
        self.agreement: Agreement | None = None
        #: under FSDP2: the sharded modules (set by :meth:`use_fsdp`)
        self.fsdp_modules: list[torch.nn.Module] = []

    def use_fsdp(self, modules: list[torch.nn.Module]) -> None:
        """Run under FSDP2: the collectives of ``modules`` agree first, an abandoned attempt resets their state."""
        self.agreement = self._new_agreement()
        install_agreement(modules, self.agreement)
        self.fsdp_modules = modules

    def _new_agreement(self, no_sync: Callable[[], Any] | None = None) -> Agreement:
        """The agreement of this fit's ranks (inactive on one process); ``no_sync`` holds DDP's reducer back."""
        trainer = self.trainer
        active = trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()
        return Agreement(active, trainer.strategy.root_device, no_sync)

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
        n = count_samples(kwargs["batch"], settings.batch_size_fn)
        size = self._micro_batch_size(kwargs["batch"], n)
        batch = _Batch(kwargs, n, trainer.accumulate_grad_batches, zero_grad_fn, backward_fn)
        params = [p for p in pl_module.parameters() if p.requires_grad]
        if self.agreement is None:  # one device, or DDP: its reducer held back during micro-batches
            self.agreement = self._new_agreement(getattr(trainer.strategy, "block_backward_sync", None))
        comm = self.agreement
        # the gradients to go back to after an out-of-memory error: those accumulated by the window's earlier batches
        saved = (
            snapshot_grads(params)
            if zero_grad_fn is None and backward_fn is not None and batch.accumulate > 1
            else None
        )
        # under DDP every micro-batch runs without the reducer; the stepping batch syncs once, at its end (FSDP2
        # reduce-scatters every micro-batch's gradients itself, as under Lightning's accumulation)
        sync_at_end = (
            comm.active
            and not self.fsdp_modules
            and backward_fn is not None
            and not trainer.fit_loop._should_accumulate()
        )
        results = trainer._results
        snapshot = self._keep(pl_module, results, size)  # before the first attempt: what a retry puts back

        def restore() -> None:
            if self.fsdp_modules:  # unsharded parameters and FSDP2's trackers of the abandoned attempt
                reset_fsdp_state(self.fsdp_modules)
            restore_grads(params, saved, batch.zeroed)
            self._restore(snapshot)

        # logs after the closure (on_before_optimizer_step, on_train_batch_end) are weighted by the whole batch again
        whole = (results.batch, results.batch_size) if results is not None else None
        try:
            parts, _ = run_micro_batches(
                n,
                size,
                settings.min_micro_batch_size,
                functools.partial(self._step, batch),
                agreement=comm,
                restore=restore,
                release=lambda: empty_device_cache(pl_module.device),
                on_halve=lambda old, new, here: self._halved(old, new, n, here, kwargs.get("batch_idx")),
                give_up=lambda err, at: self._give_up(err, n, at),
            )
            self._went_through(snapshot, pl_module)
            if sync_at_end:  # through the DDP communication hook the user registered, if any (on DDP's own buckets)
                bucket_bytes = getattr(trainer.strategy.model, "bucket_bytes_cap", BUCKET_BYTES)  # DDP's bucket_cap_mb
                comm.average_gradients(params, gradient_reduction(trainer.strategy.model), bucket_bytes)
            return self._result_class(
                combine_losses(parts, n, batch.accumulate), extra=parts[-1].extra if parts else {}
            )
        finally:
            if results is not None and whole is not None:
                results.batch, results.batch_size = whole

    def _micro_batch_size(self, batch: Any, n: int) -> int:
        """The micro-batch this batch starts with; on the fit's first batch, check that the batch can be split."""
        size = self.state.micro_batch_size if self.state.micro_batch_size is not None else n
        self.state.micro_batch_size = size
        if self._first_size is None:
            expected = loader_batch_size(self.trainer.train_dataloader)
            settings = self.settings
            warning = check_first_batch(batch, n, settings.split_batch_fn, settings.batch_size_fn, expected)
            if warning is not None:
                self._warn.warn("split-dim", warning)
            self._first_size = size
        return size

    def _step(self, batch: _Batch, start: int, stop: int) -> MicroBatchPart:
        """``training_step`` and backward on the samples ``[start, stop)``, the loss weighted by their share."""
        trainer, pl_module = self.trainer, self.trainer.lightning_module
        micro_kwargs = OrderedDict(batch.kwargs)
        micro_kwargs["batch"] = micro_batch_of(
            batch.kwargs["batch"], start, stop, batch.samples, self.settings.split_batch_fn
        )
        results = trainer._results
        if results is not None:  # epoch means weighted by micro-batch size (what Lightning infers)
            results.batch = micro_kwargs["batch"]
            results.batch_size = stop - start
        fx_name = pl_module._current_fx_name
        try:
            output = self._call._call_strategy_hook(trainer, "training_step", *micro_kwargs.values())
            trainer.strategy.post_training_step()
            result = self._result_class.from_training_step_output(output, 1)
            del output
            if batch.zero_grad_fn is not None and not batch.zeroed:
                batch.zero_grad_fn()
                batch.zeroed = True
            if batch.backward_fn is not None and result.closure_loss is not None:
                batch.backward_fn(
                    result.closure_loss * micro_batch_weight(stop - start, batch.samples, batch.accumulate)
                )
            return MicroBatchPart(stop - start, result.loss, result.extra)
        finally:  # a hook that raised leaves its own name behind (trainer/call.py)
            pl_module._current_fx_name = fx_name

    # ------------------------------------------------------------------------------------------- what a retry needs

    def _keep(self, pl_module: pl.LightningModule, results: Any, size: int) -> RetrySnapshot | None:
        """What the batch's attempts may change, kept before the first; ``None`` when no retry can follow."""
        settings = self.settings
        if size <= settings.min_micro_batch_size:  # an out-of-memory error at this size ends the run
            return None
        return RetrySnapshot(
            pl_module,
            results if settings.restore_metrics else None,
            rng=settings.restore_rng,
            metrics=settings.restore_metrics,
            buffers=self._buffers if settings.restore_buffers else None,
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

    def _give_up(self, err: BaseException, samples: int, size: int) -> None:
        """The smallest micro-batch ran out of memory: say what was tried in the error that ends the run."""
        min_size, retries = self.settings.min_micro_batch_size, self.state.retries
        extend_message(err, give_up_note(size, samples, min_size, self._first_size, retries))
        mark_micro_batch(err, samples, size)  # the OOM report reads the whole batch here, its frames hold the slice

    def _halved(self, size: int, new: int, samples: int, here: bool, batch_idx: int | None) -> None:
        """Take the halved micro-batch (the batch runs again with it); say why (rank zero, one line of at most 100
        columns), log it, and record it in every rank's memory log."""
        trainer, state = self.trainer, self.state
        state.micro_batch_size, state.retries = new, state.retries + 1
        reason = "out of memory" if here else "out of memory on another process"
        if trainer.is_global_zero:
            rank_zero_info(halving_line(size, new, reason, samples, trainer.global_step))
        log_to_loggers(trainer, {"memory/micro_batch_size": float(new)}, self._warn, "AutoMicroBatch")
        for monitor in self._monitors:  # each rank writes its own log; no collective
            monitor.record_event(
                trainer,
                "micro_batch",
                batch_idx,
                micro_batch_size=new,
                previous_micro_batch_size=size,
                batch_size=samples,
                retries=state.retries,
                reason=reason,
            )


# ----------------------------------------------------------------------------------------------- the callback


def _tensor_parallel_size(strategy: Any) -> int:
    """The tensor-parallel size of Lightning's ``ModelParallelStrategy`` (its device mesh exists before ``setup``)."""
    mesh = strategy.device_mesh
    names = mesh.mesh_dim_names or ()
    return mesh["tensor_parallel"].size() if "tensor_parallel" in names else 1


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
        split_batch_fn: ``fn(batch, start, stop)`` returning the samples ``[start, stop)`` of a batch; ``None``
            (default): the default slicer of :mod:`lightning_memopt.functional.micro_batch`.
        batch_size_fn: ``fn(batch)`` returning the number of samples of a batch; ``None`` (default): the first dim of
            the first tensor in it.
        restore_rng: Put the random states (torch CPU and accelerators, ``random``, NumPy) back to the batch's start
            before a retry, so that dropout draws what a run at the smaller micro-batch draws (default ``True``).
        restore_metrics: Put the states of the ``torchmetrics`` metrics among the module's submodules and the
            ``self.log`` results back before a retry (default ``True``).
        restore_buffers: Put the module's buffers (BatchNorm running statistics) back before a retry (default
            ``True``); each batch copies the buffers that batches change (all of them before the first batch).

    A retry cannot undo what ``training_step`` does outside these: Python attributes it sets, prints, logger calls.

    Strategies: one device, DDP, and FSDP2 through ``ModelParallelStrategy(tensor_parallel_size=1)`` with
    ``fully_shard`` per block and on the root in ``configure_model``. When any rank runs out of memory, every rank
    halves together. Under FSDP2 each all-gather and reduce-scatter of a micro-batch is preceded by a 1-element
    all-reduce, so that all ranks stop at the same collective (:mod:`~lightning_memopt.functional.fsdp_sync`, which
    also gives the cost). An out-of-memory error raised inside a collective itself ends the run. FSDP1
    (``FSDPStrategy``), DeepSpeed and tensor parallelism are refused in ``setup``.

    Logs (rank zero, to the Trainer's loggers): ``memory/micro_batch_size`` (samples) at each change and at the end of
    fit, ``memory/micro_batch_retries`` (count) at the end of fit. Each change is also printed by rank zero and, with a
    ``MemoryMonitor`` among the callbacks, written to every rank's memory log as an ``event: "micro_batch"`` record.
    A fit without an out-of-memory error prints nothing. The checkpoint holds the micro-batch size and the retry count.

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
        for name, fn in (("split_batch_fn", split_batch_fn), ("batch_size_fn", batch_size_fn)):
            if fn is not None and not callable(fn):
                raise ValueError(f"`{name}` must be a function or None, got {fn!r} ({type(fn).__name__}).")
        flags = {"restore_rng": restore_rng, "restore_metrics": restore_metrics, "restore_buffers": restore_buffers}
        for name, flag in flags.items():
            check_bool(name, flag)
        self.restore_rng, self.restore_metrics, self.restore_buffers = restore_rng, restore_metrics, restore_buffers
        self.start_micro_batch_size = micro_batch_size
        self.min_micro_batch_size = min_micro_batch_size
        self.split_batch_fn = split_batch_fn
        self.batch_size_fn = batch_size_fn
        self._state = self._fresh_state()
        self._restored = False
        self._fsdp2 = False
        self._warn = WarnOnce()

    def _fresh_state(self) -> MicroBatchState:
        start = self.start_micro_batch_size
        return MicroBatchState(None if start == "auto" else int(start))

    @property
    def micro_batch_size(self) -> int | None:
        """The micro-batch size in use (``None`` until the first batch with ``"auto"``)."""
        return self._state.micro_batch_size

    @property
    def retries(self) -> int:
        """How many times the micro-batch was halved (in this fit, or since the checkpoint's run started)."""
        return self._state.retries

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
        self._fsdp2 = is_instance(strategy, "strategies.ModelParallelStrategy") and _tensor_parallel_size(strategy) == 1
        check_strategy_for_micro_batches(type(strategy).__name__, trainer.world_size, is_ddp, self._fsdp2)
        if not self._restored:
            self._state = self._fresh_state()
        settings = MicroBatchSettings(
            self.min_micro_batch_size,
            self.split_batch_fn,
            self.batch_size_fn,
            self.restore_rng,
            self.restore_metrics,
            self.restore_buffers,
        )
        callbacks: list[Any] = getattr(trainer, "callbacks", [])
        monitors = [c for c in callbacks if isinstance(c, MemoryMonitor)]
        epoch_loop = trainer.fit_loop.epoch_loop
        original = epoch_loop.automatic_optimization
        if isinstance(original, MicroBatchOptimization):  # left by a fit that never reached teardown
            original = original.original
        loop_class = optimization_class(namespace_of(trainer).__name__)
        epoch_loop.automatic_optimization = loop_class(trainer, original, settings, self._state, self._warn, monitors)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        check_ddp_for_micro_batches(trainer.strategy.model)  # DDP wraps the model after setup, before this hook
        if not self._fsdp2:
            return
        loop = trainer.fit_loop.epoch_loop.automatic_optimization
        if isinstance(loop, MicroBatchOptimization):  # sharded in configure_model, after setup
            check_fsdp_for_micro_batches(pl_module)
            loop.use_fsdp(fsdp_modules(pl_module))

    def _give_back(self, trainer: pl.Trainer) -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        if isinstance(epoch_loop.automatic_optimization, MicroBatchOptimization):
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
        if state["micro_batch_size"] is not None:
            self._state.micro_batch_size = state["micro_batch_size"]
        self._state.retries, self._restored = state["retries"], True
