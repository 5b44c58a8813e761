"""What AutoMicroBatch's training loop and its evaluation splitter share: settings, learned state, halving reports."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from lightning_memopt.callbacks.memory_monitor import MemoryMonitor
from lightning_memopt.utilities.formatting import wrap_to_width
from lightning_memopt.utilities.namespaces import rank_zero_info
from lightning_memopt.utilities.trainer import log_to_loggers
from lightning_memopt.utilities.warnings import WarnOnce

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["MicroBatchSettings", "MicroBatchState", "halving_line", "report_halving"]


@dataclasses.dataclass
class MicroBatchState:
    """What a micro-batch loop learns; :class:`AutoMicroBatch` reads it for its logs and checkpoints it.

    The size that fits is learned in elements (tensor elements per micro-batch,
    :func:`~lightning_memopt.functional.micro_batch.slicing.sample_elements` per sample), so that it carries over to
    batches of other shapes: a batch of longer sequences gets fewer samples per micro-batch, a shorter one more, and a
    batch that never ran out of memory (a small first batch) pins nothing.

    Attributes:
        micro_batch_size: the micro-batch of the latest batch; ``None`` before the first.
        retries: how many times the micro-batch was halved.
        elements: tensor elements per micro-batch at the latest halving; ``None`` before the first (see
            :meth:`size_for`).
        start: samples per micro-batch before the first halving (the configured start, or an older checkpoint's
            size); ``None``: the whole batch.
    """

    micro_batch_size: int | None = None
    retries: int = 0
    elements: int | None = None
    start: int | None = None

    def size_for(self, samples: int, per_sample: int, min_size: int) -> int:
        """The micro-batch a batch of ``samples`` with ``per_sample`` elements each starts with.

        Examples:
            >>> state = MicroBatchState(elements=4 * 128)  # 4 samples of 128 elements fitted
            >>> state.size_for(16, 128, 1), state.size_for(16, 512, 1), state.size_for(16, 64, 1)
            (4, 1, 8)
            >>> MicroBatchState().size_for(16, 128, 1), MicroBatchState(start=6).size_for(4, 128, 1)
            (16, 4)
        """
        if self.elements is not None:
            size = max(min_size, self.elements // max(per_sample, 1))
        elif self.start is not None:
            size = self.start
        else:
            size = samples
        return max(1, min(size, samples))

    def halved(self, new: int, per_sample: int) -> None:
        """The micro-batch was halved to ``new`` samples of ``per_sample`` elements each."""
        self.micro_batch_size, self.retries = new, self.retries + 1
        self.elements = new * max(per_sample, 1)


@dataclasses.dataclass(frozen=True)
class MicroBatchSettings:
    """How the micro-batch loops split batches and what a retry puts back (``AutoMicroBatch``'s arguments)."""

    min_micro_batch_size: int = 1
    split_batch_fn: Callable[[Any, int, int], Any] | None = None
    batch_size_fn: Callable[[Any], int] | None = None
    restore_rng: bool = True
    restore_metrics: bool = True
    restore_buffers: bool = True
    weight_fn: Callable[[Any], Any] | None = None


def halving_line(size: int, new: int, reason: str, samples: int, global_step: int, stage: str = "fit") -> str:
    """What rank zero prints when the micro-batch is halved, wrapped to 100 columns.

    Examples:
        >>> halving_line(16, 8, "out of memory", 16, 0)
        'AutoMicroBatch: micro-batch 16 -> 8 (out of memory; batch of 16, global step 0).'
        >>> halving_line(16, 8, "out of memory", 16, 0, stage="validate")
        'AutoMicroBatch: validate micro-batch 16 -> 8 (out of memory; batch of 16, global step 0).'
    """
    what = "micro-batch" if stage == "fit" else f"{stage} micro-batch"
    line = f"AutoMicroBatch: {what} {size} -> {new} ({reason}; batch of {samples}, global step {global_step})."
    return wrap_to_width(line)


def report_halving(
    trainer: pl.Trainer,
    state: MicroBatchState,
    halving: tuple[int, int, int, bool, int],
    batch_idx: int | None,
    stage: str = "fit",
    warn: WarnOnce | None = None,
    monitors: Sequence[MemoryMonitor] = (),
) -> None:
    """Take the halved micro-batch into ``state`` and say why: rank zero prints one line and logs
    ``memory/micro_batch_size`` (training) or ``memory/<stage>/micro_batch_size``; every rank's memory log gets an
    ``event: "micro_batch"`` record (no collective).

    ``halving`` is ``(size, new size, samples of the batch, whether this process ran out of memory, elements per
    sample)``.
    """
    size, new, samples, here, per_sample = halving
    state.halved(new, per_sample)
    reason = "out of memory" if here else "out of memory on another process"
    if trainer.is_global_zero:
        rank_zero_info(halving_line(size, new, reason, samples, trainer.global_step, stage))
    key = "memory/micro_batch_size" if stage == "fit" else f"memory/{stage}/micro_batch_size"
    if warn is None:
        warn = WarnOnce()
    log_to_loggers(trainer, {key: float(new)}, warn, "AutoMicroBatch")
    phase = "train" if stage == "fit" else stage
    for monitor in monitors:  # each rank writes its own log; no collective
        monitor.record_event(
            trainer,
            "micro_batch",
            batch_idx,
            phase=phase,
            micro_batch_size=new,
            previous_micro_batch_size=size,
            batch_size=samples,
            retries=state.retries,
            reason=reason,
        )
