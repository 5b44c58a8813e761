"""AutoMicroBatch in validation, test and predict: each evaluation step split into micro-batches on out-of-memory.

For the length of one evaluation run (``on_validation_start`` to ``on_validation_end``, and the same for test and
predict) the strategy's step method (``strategy.validation_step``, ``test_step``, ``predict_step``, which Lightning's
loops call once per loader batch) is replaced by :meth:`EvaluationSplitter.step`. It runs the original method once
per micro-batch through :func:`~lightning_memopt.functional.micro_batch.retry.run_micro_batches` with
``resume=True``: after an out-of-memory error, what the failed micro-batch changed (``self.log`` results, metric
states, random states) is put back and the batch goes on from that micro-batch's first sample at half the size. The
micro-batches' outputs are put back together (:func:`~lightning_memopt.functional.micro_batch.outputs.
combine_outputs`), so the loop, its ``on_*_batch_end`` hooks, collected predictions and prediction writers see one
output per loader batch. Each micro-batch's ``self.log`` values are weighted by its own number of samples, as
Lightning weights a loader batch of that size.

Under several processes the ranks agree: the same number of micro-batch rounds per batch, a two-element all-reduce
after each round, and an agreement point before each collective a step runs through the strategy (``self.log(...,
sync_dist=True)``, ``self.all_gather``) or through FSDP2's all-gathers, so that a rank that ran out of memory never
leaves another waiting in a collective; every rank halves together.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lightning_memopt.callbacks._micro_batch_state import MicroBatchSettings, MicroBatchState, report_halving
from lightning_memopt.callbacks.memory_monitor import MemoryMonitor
from lightning_memopt.functional.micro_batch.fsdp_sync import fsdp_modules, install_agreement, reset_fsdp_state
from lightning_memopt.functional.micro_batch.outputs import combine_outputs
from lightning_memopt.functional.micro_batch.retry import (
    Agreement,
    MicroBatchPart,
    agree_before_collectives,
    extend_message,
    give_up_note,
    mark_micro_batch,
    run_micro_batches,
)
from lightning_memopt.functional.micro_batch.retry_state import ModuleParts, RetrySnapshot, find_parts
from lightning_memopt.functional.micro_batch.slicing import count_samples, micro_batch_of, sample_elements
from lightning_memopt.functional.readings.memory import empty_device_cache
from lightning_memopt.utilities import _lightning_private as private
from lightning_memopt.utilities.warnings import WarnOnce

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["EVALUATION_STEPS", "EvaluationSplitter"]

#: The strategy method each evaluation stage runs once per loader batch.
EVALUATION_STEPS = {"validate": "validation_step", "test": "test_step", "predict": "predict_step"}


class EvaluationSplitter:
    """Splits the steps of one evaluation run (one stage) into micro-batches; :meth:`remove` gives the step back.

    Args:
        trainer: the running Trainer.
        stage: ``"validate"``, ``"test"`` or ``"predict"``.
        settings: how to split batches and what a retry puts back (``restore_buffers`` does not apply: evaluation
            leaves buffers alone).
        state: the stage's micro-batch in use and its halvings (kept across runs by the callback).
        agreement: what the ranks agree with (inactive on one process).
        warn: warns once per kind of problem.
        monitors: the ``MemoryMonitor`` callbacks whose memory logs record each halving.
    """

    def __init__(
        self,
        trainer: pl.Trainer,
        stage: str,
        settings: MicroBatchSettings,
        state: MicroBatchState,
        agreement: Agreement,
        warn: WarnOnce | None = None,
        monitors: Sequence[MemoryMonitor] = (),
    ) -> None:
        self.trainer, self.stage, self.settings, self.state = trainer, stage, settings, state
        self.agreement = agreement
        if warn is not None:
            self._warn = warn
        else:
            self._warn = WarnOnce()
        self._monitors = list(monitors)
        self._parts: ModuleParts | None = None  # the module's metrics, found once per run
        self._size = 0  # the micro-batch of the running attempt
        if agreement.active:
            self._fsdp = fsdp_modules(trainer.lightning_module)
        else:
            self._fsdp = []
        #: what the latest micro-batch may change, kept before it ran, with its first sample
        self._kept: tuple[int, RetrySnapshot | None] | None = None
        strategy = trainer.strategy
        name = EVALUATION_STEPS[stage]
        original = getattr(strategy, name)
        self._give_back: list[Callable[[], None]] = []
        if agreement.active:
            self._give_back.append(agree_before_collectives(strategy, agreement))
        had = vars(strategy).get(name)  # a step set on the strategy object itself (another wrapper) comes back too

        def give_back_step() -> None:
            if had is None:
                delattr(strategy, name)
            else:
                setattr(strategy, name, had)

        setattr(strategy, name, functools.partial(self.step, original))
        self._give_back.append(give_back_step)

    def remove(self) -> None:
        """Give the strategy its own step (and collectives) back."""
        while self._give_back:
            self._give_back.pop()()

    def step(self, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The strategy's step for one loader batch, run in micro-batches; one output for the whole batch."""
        if not args or isinstance(args[0], Iterator):  # a step that takes `dataloader_iter` fetches its own batches
            return original(*args, **kwargs)
        batch, rest = args[0], args[1:]
        settings = self.settings
        samples = count_samples(batch, settings.batch_size_fn)
        per_sample = sample_elements(batch, samples)
        size = self.state.size_for(samples, per_sample, settings.min_micro_batch_size)
        if self.state.elements is not None:  # learned from each rank's own shapes: the ranks take the smallest
            size = self.agreement.min(size)
        self._size = size
        batch_idx = rest[0] if rest and isinstance(rest[0], int) else None
        results = private.logged_results(self.trainer)
        whole = private.results_batch(results)

        def run(start: int, stop: int) -> MicroBatchPart:
            micro = micro_batch_of(batch, start, stop, samples, settings.split_batch_fn)
            private.point_results(results, micro, stop - start)
            self._kept = (start, self._keep(results))
            return MicroBatchPart(stop - start, None, original(micro, *rest, **kwargs))

        try:
            parts, _ = run_micro_batches(
                samples,
                size,
                settings.min_micro_batch_size,
                run,
                agreement=self.agreement,
                restore=self._restore,
                release=lambda: empty_device_cache(self.trainer.lightning_module.device),
                on_halve=lambda old, new, here: self._halved((old, new, samples, here, per_sample), batch_idx),
                give_up=lambda err, at: self._give_up(err, samples, at),
                resume=True,
            )
        finally:
            self._kept = None
            private.point_results(results, *whole)
        return combine_outputs([(part.samples, part.extra) for part in parts])

    def _keep(self, results: Any) -> RetrySnapshot | None:
        """What a micro-batch may change, kept before it runs; ``None`` when no retry can follow."""
        settings = self.settings
        if self._size <= settings.min_micro_batch_size:  # an out-of-memory error now ends the run
            return None
        if self._parts is None:
            self._parts = find_parts(self.trainer.lightning_module)
        return RetrySnapshot(
            self.trainer.lightning_module,
            results if settings.restore_metrics else None,
            rng=settings.restore_rng,
            metrics=settings.restore_metrics,
            parts=self._parts,
        )

    def _restore(self, start: int) -> None:
        """Put back what the micro-batch round from ``start`` changed here (nothing when this rank had no samples
        left in it)."""
        if self._fsdp:
            reset_fsdp_state(self._fsdp)
        if self._kept is not None and self._kept[0] == start and self._kept[1] is not None:
            self._kept[1].restore()
        self._kept = None

    def _halved(self, halving: tuple[int, int, int, bool, int], batch_idx: int | None) -> None:
        self._size = halving[1]
        report_halving(self.trainer, self.state, halving, batch_idx, self.stage, self._warn, self._monitors)

    def _give_up(self, err: BaseException, samples: int, size: int) -> None:
        min_size, retries = self.settings.min_micro_batch_size, self.state.retries
        extend_message(err, give_up_note(size, samples, min_size, None, retries, self.stage))
        mark_micro_batch(err, samples, size)


def evaluation_agreement(trainer: pl.Trainer, training: Agreement | None) -> Agreement:
    """What the ranks of an evaluation run agree with: the training loop's agreement during fit (under FSDP2 it is in
    the modules' collectives already), else a new one (put into FSDP2's collectives when the model is sharded)."""
    if training is not None:
        return training
    active = trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized()
    agreement = Agreement(active, trainer.strategy.root_device)
    if active:
        modules = fsdp_modules(trainer.lightning_module)
        if modules:
            install_agreement(modules, agreement)
    return agreement
