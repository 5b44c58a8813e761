"""The search behind :func:`~lightning_memopt.planner.plan_memory`, in one flow: :func:`search_plan` tries each
strategy in order (DDP, FSDP2, FSDP2 with CPU offload), in each the micro-batches (one estimate per micro-batch
tried, with and without activation checkpointing), then, for the setting chosen, the evaluation batch and FSDP2's
own mixed precision; when nothing fits, the GPUs FSDP2 would need. :mod:`~lightning_memopt.planner.plan` turns the
outcome into a :class:`~lightning_memopt.planner.plan.MemoryPlan` and its words.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn

from lightning_memopt.planner.estimate import MemoryEstimate, estimate_memory
from lightning_memopt.planner.model_step import MemoryEstimateError
from lightning_memopt.utilities.formatting import format_bytes

__all__ = [
    "EvaluationPlan",
    "GpusNeeded",
    "PlanSearch",
    "PlanSettings",
    "PlanTrial",
    "Stage",
    "Trials",
    "evaluation_batch",
    "largest_fitting",
    "lower_bound",
    "most_estimates",
    "needed_bytes",
    "replicated_floor",
    "search_plan",
    "split_needs",
    "strategy_label",
]

#: GPU counts the advice plans for when nothing fits (after the lower bound from the model states).
GPU_COUNTS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


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


def replicated_floor(module: nn.Module, precision: str, world: int) -> int:
    """The fewest bytes a rank that holds the whole model needs (DDP): its parameters and buffers at the plan's
    precision (``-true``: floating ones in 16 bits), the trainable parameters' gradients and, over several ranks,
    DDP's gradient buckets (one more copy). Every estimate of that strategy needs at least this (the gradients are
    all alive at the end of backward), whatever the optimizer and the batch: a plan skips the strategy when it is over
    the usable bytes.

    Examples:
        >>> replicated_floor(nn.Linear(1000, 1000), "bf16-mixed", world=8) == 3 * 4 * (1000 * 1000 + 1000)
        True
    """
    half = precision.endswith("-true") and not precision.startswith("32")

    def nbytes(t: Tensor) -> int:
        if half and t.is_floating_point():
            return t.numel() * 2
        return t.numel() * t.element_size()

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


def _estimate(source: Any, size: int, checkpointing: bool, accumulate: int, **sharding: Any) -> MemoryEstimate:
    """One training-step estimate of a plan at micro-batch ``size`` (``source``: the plan's shared settings, a
    :class:`Trials` or :class:`PlanSettings`), checkpointing on or off, ``accumulate`` micro-batches per step."""
    return estimate_memory(
        source.module,
        source.batch_fn(size),
        precision=source.precision,
        optimizer=source.optimizer,
        device=source.device,
        gradient_checkpointing=checkpointing,
        checkpoint_modules=source.checkpoint_modules if checkpointing else None,
        loss_fn=source.loss_fn,
        accumulate_grad_batches=accumulate,
        gpu=source.gpu if source.device == "cuda" else None,
        **sharding,
    )


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
        known = self.estimates.get((size, checkpointing))
        if known is not None:  # estimated before in this search
            return needed_bytes(known, self.world) <= self.usable
        accumulate = max(1, self.batch_per_device // size)
        est = _estimate(self, size, checkpointing, accumulate, **self._sharding())
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

    def largest_fitting(self, checkpointing: bool, candidates: list[int], verify: bool = True) -> int | None:
        """The largest of ``candidates`` that fits with checkpointing on or off.

        The largest is estimated first, then the smallest (as :func:`largest_fitting`). Between them the need is
        taken as affine in the micro-batch (activations grow with the samples, the model states do not): the largest
        size predicted to fit is estimated to verify it (:meth:`confirm`; ``verify=False`` returns it unverified, for
        a caller that may not choose it), and only where it does not fit does a binary search below it run. A plan
        over many divisors (a per-device batch of 64: 7) costs one estimate instead of a search.
        """
        if self.fits(candidates[-1], checkpointing):
            return candidates[-1]
        if len(candidates) == 1 or not self.fits(candidates[0], checkpointing):
            return None
        low, high = candidates[0], candidates[-1]
        need_low, need_high = self._needed(low, checkpointing), self._needed(high, checkpointing)
        slope = (need_high - need_low) / (high - low)
        predicted = [s for s in candidates[1:-1] if need_low + slope * (s - low) <= self.usable]
        if not predicted:
            return low
        if not verify:
            return predicted[-1]
        return self.confirm(checkpointing, predicted[-1], candidates)

    def _needed(self, size: int, checkpointing: bool) -> int:
        """The bytes the trial of ``size`` with checkpointing on or off needed."""
        return next(
            t.needed_bytes
            for t in reversed(self.trials)
            if (t.micro_batch_size, t.gradient_checkpointing) == (size, checkpointing)
        )

    def confirm(self, checkpointing: bool, size: int, candidates: list[int]) -> int:
        """``size`` if its estimate fits (estimated unless it was), else the largest of ``candidates`` below it that
        does (the smallest is known to fit)."""
        if self.fits(size, checkpointing):
            return size
        below = [s for s in candidates if s < size]
        if len(below) > 1:
            found = largest_fitting(below, lambda s: self.fits(s, checkpointing))
            return below[0] if found is None else found
        return below[0]


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
    if chosen is None:
        return chosen, None, trials
    return chosen, estimates.get(chosen), trials


def most_estimates(candidates: int) -> int:
    """Estimates :meth:`Trials.largest_fitting` runs at most over ``candidates`` sizes: the largest, the smallest,
    then a binary search between them.

    Examples:
        >>> most_estimates(1), most_estimates(7)
        (1, 5)
    """
    if candidates == 1:
        return 1
    return 2 + max(0, math.ceil(math.log2(candidates - 1)))


@dataclass(frozen=True)
class PlanSettings:
    """What every estimate of one plan shares: the model and its batches, the target, the usable bytes (see
    :func:`~lightning_memopt.plan_memory`'s arguments; ``checkpoint_modules``: the blocks checkpointed when
    checkpointing is on)."""

    module: nn.Module
    batch_fn: Callable[[int], Any]
    usable: int
    precision: str
    device: str
    gpu: str | tuple[int, int] | None = None
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None
    loss_fn: Callable[[nn.Module, Any], Tensor] | None = None
    progress: Callable[[str], None] | None = None
    checkpoint_modules: Sequence[type[nn.Module] | str] | None = None
    shard_modules: Sequence[type[nn.Module] | str] | None = None

    def trials(self, per_device: int, world: int, sharded: bool, cpu_offload: bool) -> Trials:
        """The estimates of one strategy: ``per_device`` samples per optimizer step on each of ``world`` ranks,
        sharded by FSDP2 or not, with CPU offload or not."""
        shared = {f.name: getattr(self, f.name) for f in fields(self)}
        return Trials(batch_per_device=per_device, world=world, sharded=sharded, cpu_offload=cpu_offload, **shared)


def _choose(runs: Trials, sizes: list[int], gradient_checkpointing: bool | Literal["auto"]) -> tuple[int | None, bool]:
    """The chosen micro-batch (``None`` when nothing fits) and whether it is checkpointed.

    Checkpointing is chosen only where it at least doubles the micro-batch that fits without it; with ``"auto"`` a
    model where the default blocks match nothing is planned without. Under ``"auto"`` the largest micro-batch the
    line predicts to fit without checkpointing is estimated only if it is chosen: where checkpointing doubles it,
    checkpointing doubles whatever fits below it too.
    """
    if gradient_checkpointing != "auto":
        option = bool(gradient_checkpointing)
        return runs.largest_fitting(option, sizes), option
    predicted = runs.largest_fitting(False, sizes, verify=False)
    checkpointed, available = _checkpointed(runs, sizes, predicted)
    if checkpointed is not None and (predicted is None or checkpointed >= 2 * predicted):
        return checkpointed, True
    plain = predicted
    if predicted is not None:
        plain = runs.confirm(False, predicted, sizes)
    if available and plain != predicted:  # the line promised more than fits: checkpointing may double what does
        checkpointed, _ = _checkpointed(runs, sizes, plain)
        if checkpointed is not None and (plain is None or checkpointed >= 2 * plain):
            return checkpointed, True
    if plain is not None:
        return plain, False
    return None, available


def _checkpointed(runs: Trials, sizes: list[int], plain: int | None) -> tuple[int | None, bool]:
    """The largest checkpointed micro-batch that fits and is at least twice ``plain`` (``None``: none), and whether
    the model has blocks to checkpoint."""
    candidates = [s for s in sizes if plain is None or s >= 2 * plain]
    if not candidates:
        return None, True
    try:
        return runs.largest_fitting(True, candidates), True
    except MemoryEstimateError as err:
        if "matched no submodule" not in str(err):
            raise
        return None, False  # nothing to checkpoint: the plan is made without


class Stage(NamedTuple):
    """One strategy searched: its estimates and the micro-batch chosen (``None``: nothing fits); ``floor``: the bytes
    its model states alone need per rank, where that ruled it out before any estimate."""

    runs: Trials
    chosen: int | None
    checkpointed: bool
    floor: int | None = None

    def smallest(self) -> MemoryEstimate:
        """The estimate of micro-batch 1 (else the smallest tried) with the checkpointing searched last."""
        estimates = self.runs.estimates
        return estimates.get((1, self.checkpointed)) or estimates[min(estimates)]


class GpusNeeded(NamedTuple):
    """How many GPUs FSDP2 needs for micro-batch 1: ``planned`` when estimated at that count, else a lower bound."""

    number: int
    planned: bool
    needed: int = 0


class EvaluationPlan(NamedTuple):
    """The evaluation batch per device planned for ``stage`` (``size`` ``None``: none; ``note`` says why)."""

    stage: str
    size: int | None = None
    estimate: MemoryEstimate | None = None
    trials: tuple[PlanTrial, ...] = ()
    note: str = ""


def split_needs(estimate: MemoryEstimate, world: int) -> tuple[int, int, int]:
    """``(needed, states, rest)``: the bytes a rank needs, of them the model states' (parameters, buffers, gradients,
    optimizer states), and the rest (activations, temporaries, the batch)."""
    needed = needed_bytes(estimate, world)
    states = sum(estimate.at_peak.get(k, 0) for k in ("parameters", "buffers", "gradients", "optimizer_states"))
    return needed, states, needed - states


def lower_bound(estimate: MemoryEstimate, usable: int, world: int) -> int | None:
    """The fewest ranks whose shares of the model states fit beside one sample's activations and temporaries
    (``None``: those alone exceed ``usable``); ``estimate`` holds one rank's bytes of a ``world_size``-way sharding."""
    _, states, rest = split_needs(estimate, world)
    if usable <= rest:
        return None
    return max(2, math.ceil(states * estimate.world_size / (usable - rest)))


@dataclass
class PlanSearch:
    """The strategies a plan searches in order, until one fits: DDP (the whole model on each rank; a single device
    when the world is 1), FSDP2 over the world, FSDP2 with CPU offload (the last resort); then what the setting that
    fits also needs planned (:func:`search_plan` runs it)."""

    settings: PlanSettings
    effective: int
    world: int
    sizes: list[int]
    gradient_checkpointing: bool | Literal["auto"]
    done: list[Stage] = field(default_factory=list)

    def runs(self, world: int, sharded: bool, cpu_offload: bool) -> Trials:
        return self.settings.trials(max(1, self.effective // world), world, sharded, cpu_offload)

    def strategies(self, strategy: str) -> Stage:
        """Each strategy in order until one fits (``strategy``: ``"auto"``, ``"ddp"`` or ``"fsdp2"``); the last."""
        order = {"ddp": [(False, False)], "fsdp2": [(True, False), (True, True)]}
        options = [(False, False)]  # a single device: nothing to shard
        if self.world != 1:
            options = order.get(strategy, [*order["ddp"], *order["fsdp2"]])
        for sharded, offload in options:
            runs = self.runs(self.world, sharded, offload)
            floor = None
            if not sharded and len(options) > 1:
                floor = replicated_floor(self.settings.module, self.settings.precision, self.world)
            if floor is not None and floor > runs.usable:  # DDP ruled out by its model states: FSDP2 is next
                self.done.append(Stage(runs, None, False, floor))
                continue
            chosen, checkpointed = _choose(runs, self.sizes, self.gradient_checkpointing)
            self.done.append(Stage(runs, chosen, checkpointed))
            if chosen is not None:
                break
        return self.done[-1]

    def gpus(self) -> GpusNeeded | None:
        """The GPUs FSDP2 needs for micro-batch 1 when nothing fits: estimated at the first two counts (2, 4, 8, ...)
        from the lower bound and above the world already sharded over; else the lower bound."""
        final = self.done[-1]
        first = next(stage for stage in self.done if stage.floor is None)  # the last stage is always estimated
        estimate, tried = first.smallest(), self.world if final.runs.sharded else 1
        lower = lower_bound(estimate, self.settings.usable, estimate.world_size)
        if lower is None:
            return None
        for count in [c for c in GPU_COUNTS if c >= lower and c > tried][:2]:
            runs = self.runs(count, sharded=True, cpu_offload=False)
            try:
                fits = runs.fits(1, final.checkpointed)
            except (ValueError, MemoryEstimateError):  # e.g. a process group is initialised: keep the lower bound
                break
            if fits:
                return GpusNeeded(count, True, runs.trials[-1].needed_bytes)
        return GpusNeeded(lower, False)

    def evaluation(self, stage: str, chosen: int) -> EvaluationPlan:
        """The largest evaluation batch of ``stage`` per device: the training micro-batch ``chosen`` doubled up to 4
        x the per-device batch (not under FSDP2: not modelled yet)."""
        if self.done[-1].runs.sharded:
            return EvaluationPlan(stage, note="not planned: evaluation under FSDP2 is not modelled yet.")
        s = self.settings
        size, estimate, tried = evaluation_batch(
            s.module,
            s.batch_fn,
            stage=stage,
            smallest=chosen,
            largest=max(chosen, 4 * (self.effective // self.world)),
            usable=s.usable,
            precision=s.precision,
            device=s.device,
            gpu=s.gpu,
            loss_fn=s.loss_fn,
            progress=s.progress,
        )
        note = "" if size is not None else f"nothing fits, not even the training micro-batch {chosen}."
        return EvaluationPlan(stage, size, estimate, tuple(tried), note)

    def policy(self, chosen: int, checkpointed: bool) -> MemoryEstimate | None:
        """The chosen FSDP2 setting with FSDP2's own ``MixedPrecisionPolicy`` instead of autocast (one estimate),
        where it applies: a sharded plan without CPU offload, a ``*-mixed`` precision, the default sharding."""
        s, runs = self.settings, self.done[-1].runs
        estimate = runs.estimates[(chosen, checkpointed)]
        sharding = estimate.sharding
        if sharding is None or sharding.cpu_offload or sharding.source == "configure_model":
            return None
        if s.precision not in ("bf16-mixed", "16-mixed"):
            return None
        return _estimate(
            s,
            chosen,
            checkpointed,
            estimate.accumulate_grad_batches,
            world_size=runs.world,
            reshard_after_forward=True,
            shard_modules=s.shard_modules,
            mixed_precision_policy=True,
        )


@dataclass(frozen=True)
class SearchOutcome:
    """What :func:`search_plan` found: each strategy searched (``done``, the last one's setting chosen), and for
    it the evaluation batch and FSDP2's own mixed precision; or, when nothing fits, the GPUs FSDP2 would need."""

    done: list[Stage]
    gpus: GpusNeeded | None = None
    evaluation: EvaluationPlan | None = None
    policy: MemoryEstimate | None = None

    @property
    def final(self) -> Stage:
        return self.done[-1]


def search_plan(
    settings: PlanSettings,
    *,
    effective: int,
    world: int,
    sizes: list[int],
    gradient_checkpointing: bool | Literal["auto"],
    strategy: str,
    evaluation: str | None,
) -> SearchOutcome:
    """The whole search of a plan (see :func:`~lightning_memopt.plan_memory`): strategies and micro-batches, then
    for the setting that fits the ``evaluation`` stage's batch and the MixedPrecisionPolicy estimate, or the GPUs
    needed when none fits."""
    search = PlanSearch(settings, effective, world, sizes, gradient_checkpointing)
    final = search.strategies(strategy)
    if final.chosen is None:
        note: EvaluationPlan | None = None
        if evaluation:
            note = EvaluationPlan(evaluation, note="not planned: no training setting fits.")
        return SearchOutcome(search.done, gpus=search.gpus(), evaluation=note)
    planned: EvaluationPlan | None = None
    if evaluation:
        planned = search.evaluation(evaluation, final.chosen)
    return SearchOutcome(search.done, evaluation=planned, policy=search.policy(final.chosen, final.checkpointed))
