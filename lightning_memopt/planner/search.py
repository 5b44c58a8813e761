"""The search behind :func:`~lightning_memopt.planner.plan_memory`: one estimate per micro-batch tried."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_memopt.planner.estimate import MemoryEstimate, estimate_memory
from lightning_memopt.utilities.formatting import format_bytes

__all__ = [
    "PlanTrial",
    "Trials",
    "evaluation_batch",
    "largest_fitting",
    "needed_bytes",
    "replicated_floor",
    "strategy_label",
]


@dataclass(frozen=True)
class PlanTrial:
    """One estimate :func:`plan_memory` ran: the settings, the bytes needed and whether they fit.

    Attributes:
        micro_batch_size / precision / gradient_checkpointing: the settings estimated.
        accumulate_grad_batches: micro-batches per optimizer step at that micro-batch (the estimate ran with it).
        needed_bytes: the estimate's peak, plus one more copy of the gradients under DDP (its buckets).
        fits: whether ``needed_bytes`` is within the plan's usable bytes.
        seconds: how long the estimate took.
        strategy: ``"single device"``, ``"ddp"`` (every rank holds the whole model), ``"fsdp2"`` or
            ``"fsdp2 + cpu offload"`` (sharded over the plan's world: one rank's bytes).
    """

    micro_batch_size: int
    precision: str
    gradient_checkpointing: bool
    needed_bytes: int
    fits: bool
    seconds: float
    accumulate_grad_batches: int = 1
    strategy: str = "single device"


def needed_bytes(estimate: MemoryEstimate, world: int) -> int:
    """The estimate's peak, and under DDP its gradient buckets: about one more copy of the gradients per process.

    A sharded estimate (FSDP2) counts its reduce-scatter buffers itself: nothing is added."""
    ddp = world > 1 and estimate.sharding is None
    return estimate.peak_bytes + (estimate.gradient_bytes if ddp else 0)


def replicated_floor(trials: Mapping[str, Any], world: int) -> int:
    """The fewest bytes a rank that holds the whole model needs (DDP): its parameters and buffers at the plan's
    precision (``-true``: floating ones in 16 bits), the trainable parameters' gradients and, over several ranks,
    DDP's gradient buckets (one more copy). Every estimate of that strategy needs at least this (the gradients are
    all alive at the end of backward), whatever the optimizer and the batch: a plan skips the strategy when it is over
    the usable bytes.

    Examples:
        >>> trials = {"module": nn.Linear(1000, 1000), "precision": "bf16-mixed"}
        >>> replicated_floor(trials, world=8) == 3 * 4 * (1000 * 1000 + 1000)
        True
    """
    half = trials["precision"].endswith("-true") and not trials["precision"].startswith("32")
    module = trials["module"]

    def nbytes(t: Tensor) -> int:
        size = 2 if half and t.is_floating_point() else t.element_size()
        return t.numel() * size

    held = sum(nbytes(t) for t in [*module.parameters(), *module.buffers()])
    gradients = sum(nbytes(p) for p in module.parameters() if p.requires_grad)
    return held + gradients * (2 if world > 1 else 1)


def strategy_label(world: int, sharded: bool, cpu_offload: bool) -> str:
    """How the plan's ranks hold the model: ``"single device"``, ``"ddp"``, ``"fsdp2"`` or ``"fsdp2 + cpu offload"``.

    Examples:
        >>> strategy_label(1, False, False), strategy_label(4, False, False), strategy_label(4, True, True)
        ('single device', 'ddp', 'fsdp2 + cpu offload')
    """
    if sharded:
        return "fsdp2 + cpu offload" if cpu_offload else "fsdp2"
    return "ddp" if world > 1 else "single device"


class Trials:
    """Runs the estimates of a plan, one per (micro-batch, checkpointing), and keeps them in the order they ran.

    Args:
        module / batch_fn: as for :func:`~lightning_memopt.plan_memory`.
        batch_per_device: samples per optimizer step on one device: a micro-batch of ``size`` is estimated with
            ``batch_per_device // size`` micro-batches accumulated, as the plan would run it.
        usable: the bytes a step may need (the budget less the CUDA context and the margin).
        gpu: the target GPU (see :func:`~lightning_memopt.estimate_memory`).
        world: devices x nodes (over 1 and not sharded, DDP's gradient buckets are counted).
        precision / checkpoint_modules / optimizer / device / loss_fn: as for
            :func:`~lightning_memopt.estimate_memory` (the blocks checkpointed when checkpointing is on).
        progress: called with one line per estimate.
        sharded: shard the model over ``world`` ranks with FSDP2 (``estimate_memory(world_size=world)``), with
            ``cpu_offload`` and the blocks ``shard_modules`` (``None``: the default blocks); reshard after forward.

    Outputs (attributes): ``trials`` (a :class:`PlanTrial` per estimate) and ``estimates`` (by ``(micro-batch,
    checkpointing)``).

    Examples:
        >>> runs = Trials(nn.Linear(8, 8), lambda b: torch.randn(b, 8), batch_per_device=4, usable=10**6, world=1,
        ...               precision="32-true", optimizer=None, device="cpu", loss_fn=None)
        >>> runs.largest_fitting(False, [1, 2, 4]), [t.micro_batch_size for t in runs.trials]
        (4, [4])
    """

    def __init__(
        self,
        module: nn.Module,
        batch_fn: Callable[[int], Any],
        *,
        batch_per_device: int,
        usable: int,
        world: int,
        precision: str,
        optimizer: Callable[[Any], torch.optim.Optimizer] | None,
        device: str,
        loss_fn: Callable[[nn.Module, Any], Tensor] | None,
        progress: Callable[[str], None] | None = None,
        gpu: str | tuple[int, int] | None = None,
        checkpoint_modules: Sequence[type[nn.Module] | str] | None = None,
        sharded: bool = False,
        cpu_offload: bool = False,
        shard_modules: Sequence[type[nn.Module] | str] | None = None,
    ) -> None:
        self.module, self.batch_fn, self.usable, self.world = module, batch_fn, usable, world
        self.batch_per_device, self.gpu = batch_per_device, gpu
        self.precision, self.optimizer, self.device, self.loss_fn = precision, optimizer, device, loss_fn
        self.progress, self.checkpoint_modules = progress, checkpoint_modules
        self.sharded, self.cpu_offload, self.shard_modules = sharded, cpu_offload, shard_modules
        self.strategy = strategy_label(world, sharded, cpu_offload)
        self.trials: list[PlanTrial] = []
        self.estimates: dict[tuple[int, bool], MemoryEstimate] = {}

    def fits(self, size: int, checkpointing: bool) -> bool:
        """Estimate micro-batch ``size`` with activation checkpointing on or off (off: the model as it is) and the
        accumulation it needs; whether it fits."""
        accumulate = max(1, self.batch_per_device // size)
        est = estimate_memory(
            self.module,
            self.batch_fn(size),
            precision=self.precision,
            optimizer=self.optimizer,
            device=self.device,
            gradient_checkpointing=checkpointing,
            checkpoint_modules=self.checkpoint_modules if checkpointing else None,
            loss_fn=self.loss_fn,
            accumulate_grad_batches=accumulate,
            gpu=self.gpu if self.device == "cuda" else None,
            **self._sharding(),
        )
        needed = needed_bytes(est, self.world)
        ok = needed <= self.usable
        self.trials.append(
            PlanTrial(size, self.precision, checkpointing, needed, ok, est.seconds, accumulate, self.strategy)
        )
        self.estimates[(size, checkpointing)] = est
        if self.progress is not None:
            where = f"{self.strategy}, " if self.world > 1 else ""
            self.progress(
                f"{where}micro-batch {size:>5}, {self.precision}, accumulate {accumulate},"
                f" checkpointing {'on' if checkpointing else 'off'}:"
                f" {format_bytes(needed):>11} {'fits' if ok else 'too much'} ({est.seconds:.1f} s)"
            )
        return ok

    def _sharding(self) -> dict[str, Any]:
        """``estimate_memory``'s sharding arguments (none when not sharded: the single-device estimate per rank)."""
        if not self.sharded:
            return {}
        return {
            "world_size": self.world,
            "reshard_after_forward": True,
            "cpu_offload": self.cpu_offload,
            "shard_modules": self.shard_modules,
        }

    def largest_fitting(self, checkpointing: bool, candidates: list[int]) -> int | None:
        """The largest of ``candidates`` that fits with checkpointing on or off.

        The largest is estimated first, then the smallest (as :func:`largest_fitting`). Between them the need is
        taken as affine in the micro-batch (activations grow with the samples, the model states do not): the largest
        size predicted to fit is estimated to verify it, and only where it does not fit does a binary search below
        it run. A plan over many divisors (a per-device batch of 64: 7) costs one estimate instead of a search.
        """

        def fits(size: int) -> bool:
            return self.fits(size, checkpointing)

        if fits(candidates[-1]):
            return candidates[-1]
        if len(candidates) == 1 or not fits(candidates[0]):
            return None
        low, high = candidates[0], candidates[-1]
        need_low = self.trials[-1].needed_bytes
        need_high = next(t.needed_bytes for t in reversed(self.trials) if t.micro_batch_size == high)
        slope = (need_high - need_low) / (high - low)
        predicted = [s for s in candidates[1:-1] if need_low + slope * (s - low) <= self.usable]
        if not predicted:
            return low
        if fits(predicted[-1]):
            return predicted[-1]
        below = [s for s in candidates if s < predicted[-1]]
        return largest_fitting(below, fits) if len(below) > 1 else below[0]


def largest_fitting(candidates: list[int], fits: Callable[[int], bool]) -> int | None:
    """The largest of ``candidates`` (ascending) for which ``fits`` holds, or ``None``; ``fits`` must hold up to a
    size and not beyond (the need grows with the micro-batch). Tries the largest first, then the smallest, then a
    binary search between them.

    Examples:
        >>> tried = []
        >>> largest_fitting([1, 2, 4, 8, 16], lambda size: tried.append(size) or size <= 4), tried
        (4, [16, 1, 4, 8])
    """
    if fits(candidates[-1]):
        return candidates[-1]
    if len(candidates) == 1 or not fits(candidates[0]):
        return None
    lo, hi = 0, len(candidates) - 1  # candidates[lo] fits, candidates[hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(candidates[mid]):
            lo = mid
        else:
            hi = mid
    return candidates[lo]


def evaluation_batch(
    module: nn.Module,
    batch_fn: Callable[[int], Any],
    *,
    stage: str,
    smallest: int,
    largest: int,
    usable: int,
    precision: str,
    device: str,
    gpu: str | tuple[int, int] | None,
    loss_fn: Callable[[nn.Module, Any], Tensor] | None,
    progress: Callable[[str], None] | None = None,
) -> tuple[int | None, MemoryEstimate | None, list[PlanTrial]]:
    """The largest evaluation batch per device for ``stage`` whose estimate fits ``usable``: ``smallest`` doubled up
    to ``largest`` (tried as :func:`largest_fitting` tries); its estimate and the trials run.

    Examples:
        >>> size, est, trials = evaluation_batch(
        ...     nn.Linear(256, 256), lambda b: torch.randn(b, 256), stage="validate", smallest=8, largest=64,
        ...     usable=400_000, precision="32-true", device="cpu", gpu=None, loss_fn=None)
        >>> size, est.stage, [t.micro_batch_size for t in trials]
        (64, 'validate', [64])
    """
    candidates = [smallest]
    while candidates[-1] * 2 <= largest:
        candidates.append(candidates[-1] * 2)
    estimates: dict[int, MemoryEstimate] = {}
    trials: list[PlanTrial] = []

    def fits(size: int) -> bool:
        est = estimate_memory(
            module,
            batch_fn(size),
            precision=precision,
            device=device,
            gpu=gpu if device == "cuda" else None,
            loss_fn=loss_fn,
            stage=stage,
        )
        ok = est.peak_bytes <= usable
        estimates[size] = est
        trials.append(PlanTrial(size, precision, False, est.peak_bytes, ok, est.seconds, 1, stage))
        if progress is not None:
            progress(
                f"{stage} batch {size:>5}, {precision}: {format_bytes(est.peak_bytes):>11}"
                f" {'fits' if ok else 'too much'} ({est.seconds:.1f} s)"
            )
        return ok

    chosen = largest_fitting(candidates, fits)
    return chosen, estimates.get(chosen) if chosen is not None else None, trials
