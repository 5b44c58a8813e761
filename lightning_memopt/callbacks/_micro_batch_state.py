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

    Attributes:
        micro_batch_size: the micro-batch in use; ``None`` until the first batch when starting with the whole batch.
        retries: how many times the micro-batch was halved.
    """

    micro_batch_size: int | None = None
    retries: int = 0


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
    halving: tuple[int, int, int, bool],
    batch_idx: int | None,
    stage: str = "fit",
    warn: WarnOnce | None = None,
    monitors: Sequence[MemoryMonitor] = (),
) -> None:
    """Take the halved micro-batch into ``state`` and say why: rank zero prints one line and logs
    ``memory/micro_batch_size`` (training) or ``memory/<stage>/micro_batch_size``; every rank's memory log gets an
    ``event: "micro_batch"`` record (no collective).

    ``halving`` is ``(size, new size, samples of the batch, whether this process ran out of memory)``.
    """
    size, new, samples, here = halving
    state.micro_batch_size, state.retries = new, state.retries + 1
    reason = "out of memory" if here else "out of memory on another process"
    if trainer.is_global_zero:
        rank_zero_info(halving_line(size, new, reason, samples, trainer.global_step, stage))
    key = "memory/micro_batch_size" if stage == "fit" else f"memory/{stage}/micro_batch_size"
    log_to_loggers(trainer, {key: float(new)}, warn if warn is not None else WarnOnce(), "AutoMicroBatch")
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
