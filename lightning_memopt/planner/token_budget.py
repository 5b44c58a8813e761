"""The largest batch per length bucket that fits a memory budget, from the estimator: the table a
:class:`~lightning_memopt.data.TokenBudgetBatchSampler` batches by (``budget=plan.table``), and the longest input that
fits at a given batch (``max_length``, ``max_frames``, ``max_peaks_n``)."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_memopt.functional.batching import Lengths, as_lengths
from lightning_memopt.planner.estimate import estimate_memory
from lightning_memopt.planner.plan import _resolve_budget
from lightning_memopt.planner.search import needed_bytes
from lightning_memopt.utilities.checks import check_positive_int
from lightning_memopt.utilities.formatting import format_bytes

__all__ = ["TokenBudgetPlan", "length_buckets", "longest_input", "plan_token_budget"]


def length_buckets(lengths: Sequence[int | Sequence[int]], buckets: int) -> list[Lengths]:
    """About ``buckets`` bucket lengths covering ``lengths``: on each axis the lengths at evenly spaced quantiles (the
    last the longest), ``round(buckets ** (1 / axes))`` per axis, every combination of them.

    Examples:
        >>> length_buckets([5, 9, 12, 40, 41, 90, 100, 512], 4)
        [(9,), (40,), (90,), (512,)]
        >>> length_buckets([(10, 2), (20, 8), (30, 4), (40, 6)], 4)
        [(20, 4), (20, 8), (40, 4), (40, 8)]
    """
    check_positive_int("buckets", buckets)
    samples = as_lengths(lengths)
    axes = len(samples[0])
    per_axis = max(1, round(buckets ** (1 / axes)))
    levels = []
    for k in range(axes):
        values = sorted(s[k] for s in samples)
        picks = {values[min(len(values) - 1, math.ceil(len(values) * (q + 1) / per_axis) - 1)] for q in range(per_axis)}
        levels.append(sorted(picks))
    return [tuple(key) for key in itertools.product(*levels)]


@dataclass(frozen=True)
class BucketRow:
    """One bucket of a :class:`TokenBudgetPlan`: its lengths, its largest batch (0: not even one sample fits), the
    bytes that batch needs and the bytes one more sample would need (``None`` at ``max_batch_size``)."""

    lengths: Lengths
    batch_size: int
    needed_bytes: int | None
    next_needed_bytes: int | None


@dataclass(frozen=True)
class TokenBudgetPlan:
    """What :func:`plan_token_budget` found: per length bucket, the largest batch whose estimated step fits.

    Attributes:
        table: ``{lengths: largest batch}`` for ``TokenBudgetBatchSampler(lengths, budget=plan.table)`` (one-axis
            lengths as ints); buckets where not even one sample fits are left out.
        rows: every bucket, in the order planned.
        budget_bytes / usable_bytes / margin: the budget, and what a step may need of it (the budget less the CUDA
            context and the margin).
        precision / device: as estimated.
        estimates: how many estimates ran; seconds: how long the plan took.
    """

    rows: tuple[BucketRow, ...]
    budget_bytes: int
    usable_bytes: int
    margin: float
    precision: str
    device: str
    estimates: int
    seconds: float
    table: dict[Any, int] = field(init=False)

    def __post_init__(self) -> None:
        table = {(r.lengths[0] if len(r.lengths) == 1 else r.lengths): r.batch_size for r in self.rows if r.batch_size}
        object.__setattr__(self, "table", table)

    def __str__(self) -> str:
        head = (
            f"Largest batch per length bucket within {format_bytes(self.usable_bytes)} of"
            f" {format_bytes(self.budget_bytes)} ({self.margin:.0%} margin, {self.precision}, {self.device});"
            f" {self.estimates} estimates in {self.seconds:.1f} s"
        )
        lines = [head, f"  {'lengths':>16s} {'batch':>7s} {'needs':>11s} {'one more':>11s}"]
        for r in self.rows:
            needs = _shown_bytes(r.needed_bytes)
            more = _shown_bytes(r.next_needed_bytes)
            lines.append(f"  {','.join(map(str, r.lengths)):>16s} {r.batch_size:7d} {needs:>11s} {more:>11s}")
        return "\n".join(lines)


def _shown_bytes(nbytes: int | None) -> str:
    """``nbytes`` formatted, or ``-`` when not estimated."""
    if nbytes is None:
        return "-"
    return format_bytes(nbytes)


@dataclass(frozen=True)
class _StepBytes:
    """What a training step of ``batch_fn(n, lengths)`` needs by the estimator (DDP's buckets counted over
    ``devices``; one rank's bytes when sharded over ``world_size``)."""

    module: nn.Module
    batch_fn: Callable[[int, Any], Any]
    resolved: Any  # the budget resolved (its precision and GPU)
    device: str
    optimizer: Callable[[Any], torch.optim.Optimizer] | None
    loss_fn: Callable[[nn.Module, Any], Tensor] | None
    devices: int = 1
    world_size: int = 1

    def __call__(self, n: int, lengths: Any) -> int:
        est = estimate_memory(
            self.module, self.batch_fn(n, lengths), precision=self.resolved.precision, optimizer=self.optimizer,
            device=self.device, loss_fn=self.loss_fn, gpu=self.resolved.gpu, world_size=self.world_size,
        )  # fmt: skip
        return needed_bytes(est, max(self.devices, self.world_size))


class _Needs:
    """The bytes a step of ``n`` samples at ``lengths`` needs, each estimated once."""

    def __init__(self, estimate: Callable[[int, Lengths], int]) -> None:
        self._estimate = estimate
        self.known: dict[tuple[int, Lengths], int] = {}

    def __call__(self, n: int, lengths: Lengths) -> int:
        key = (n, lengths)
        if key not in self.known:
            self.known[key] = self._estimate(n, lengths)
        return self.known[key]


def _largest_batch(
    needs: _Needs, lengths: Lengths, usable: int, guess: int, cap: int, intercept: float | None
) -> tuple[int, tuple[float, float] | None]:
    """The largest ``n`` in ``[1, cap]`` with ``needs(n, lengths) <= usable`` (0: none), starting from ``guess``, and
    the line through this bucket's last two estimates (bytes at a batch of 0, bytes per sample; for the next buckets).

    A step grows about linearly with the batch: the next try is where the line through the last two estimates meets
    ``usable`` (with one estimate, the line through it and ``intercept``, the previous bucket's), kept strictly
    inside the bracket found so far."""
    low, high = 0, cap + 1  # low fits (0: nothing known), high does not
    n = max(1, min(cap, guess))
    points: list[tuple[int, int]] = []
    while high - low > 1:
        need = needs(n, lengths)
        points.append((n, need))
        if need <= usable:
            low = n
        else:
            high = n
        n = _next_try(points, usable, low, high, intercept)
    line: tuple[float, float] | None = None
    if len(points) >= 2:
        line = _line(points[-2:], None)
    return low, line


def _line(points: list[tuple[int, int]], intercept: float | None) -> tuple[float, float] | None:
    """(bytes at batch 0, bytes per sample) through two points, or one point and ``intercept``; ``None``: no line."""
    if len(points) >= 2 and points[-1][0] != points[-2][0]:
        (n1, b1), (n2, b2) = points[-2], points[-1]
        slope = (b2 - b1) / (n2 - n1)
        return b2 - slope * n2, slope
    if len(points) == 1 and intercept is not None:
        n, b = points[0]
        return intercept, (b - intercept) / n
    return None


def _next_try(points: list[tuple[int, int]], usable: int, low: int, high: int, intercept: float | None) -> int:
    """The next batch to estimate, strictly between ``low`` and ``high``."""
    line = _line(points, intercept)
    if line is not None and line[1] > 0:
        target = math.floor((usable - line[0]) / line[1])
        if points[-1][1] <= usable:  # from a fitting point, also try the one above the line's answer
            target = max(target, points[-1][0] + 1)
        return min(high - 1, max(low + 1, target))
    if low > 0:  # only fitting points: double
        return min(high - 1, 2 * low)
    return (low + high) // 2


def plan_token_budget(
    module: nn.Module,
    batch_fn: Callable[[int, Any], Any],
    lengths: Sequence[int | Sequence[int]] | None = None,
    *,
    buckets: int | Sequence[int | Sequence[int]] = 16,
    budget: int | float | str | None = None,
    margin: float = 0.1,
    precision: str = "auto",
    device: str = "cuda",
    gpu: str | tuple[int, int] | None = None,
    devices: int = 1,
    world_size: int = 1,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    loss_fn: Callable[[nn.Module, Any], Tensor] | None = None,
    max_batch_size: int = 4096,
    progress: Callable[[str], None] | None = None,
) -> TokenBudgetPlan:
    """For each length bucket the largest batch whose estimated training step fits ``budget``.

    Every axis of the lengths is bounded by the bucket (a batch of short sources with long targets is planned at the
    long targets). Buckets are planned shortest first, each starting from the batch the previous one allowed scaled
    by their padded tokens; within a bucket the next try is where the line through the last two estimates meets the
    budget, so a bucket usually costs two or three estimates. Each chosen batch's own estimate fits; one more sample
    does not (or the batch is ``max_batch_size``).

    Args:
        module: the model, as for :func:`~lightning_memopt.estimate_memory`.
        batch_fn: ``batch_fn(n, lengths)`` -> a batch of ``n`` samples padded to ``lengths`` (an int for one axis, a
            tuple otherwise), as the training step gets it (CPU or meta tensors).
        lengths: the dataset's per-sample lengths, for ``buckets=N``: the buckets are their quantiles.
        buckets: about how many buckets (from ``lengths``), or the bucket lengths themselves.
        budget: the device's memory (bytes, ``"24GB"``, a GPU's name), as for :func:`~lightning_memopt.plan_memory`.
        margin: the share of ``budget`` left free (0.1).
        precision: as for :func:`~lightning_memopt.estimate_memory`; ``"auto"``: as
            :func:`~lightning_memopt.plan_memory` chooses it for the budget.
        device: ``"cuda"`` (modelled) or ``"cpu"``.
        gpu: the target GPU, as for :func:`~lightning_memopt.estimate_memory`.
        devices: data-parallel processes (over 1: DDP's gradient buckets are counted, as the planner does).
        world_size: ranks the model is sharded over with FSDP2 (each bucket's batch is then one rank's, its bytes
            one rank's), as for :func:`~lightning_memopt.estimate_memory`.
        optimizer: ``optimizer(params) -> Optimizer``, as for :func:`~lightning_memopt.estimate_memory`.
        loss_fn: ``loss_fn(model, batch) -> loss``, as for :func:`~lightning_memopt.estimate_memory`.
        max_batch_size: the largest batch tried.
        progress: called with one line per bucket.

    Examples:
        >>> import functools
        >>> plan = plan_token_budget(
        ...     nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 4)),
        ...     lambda n, length: torch.zeros(n, length, dtype=torch.long),
        ...     buckets=[32, 128], budget=2**20, device="cpu", margin=0.0,
        ... )
        >>> plan.table[32] > plan.table[128] > 0
        True
    """
    started = time.perf_counter()
    check_positive_int("max_batch_size", max_batch_size)
    check_positive_int("devices", devices)
    check_positive_int("world_size", world_size)
    if devices > 1 and world_size > 1:
        raise ValueError(
            f"`devices={devices}` (DDP) and `world_size={world_size}` (FSDP2) both given: pass `world_size` for a model"
            " sharded with FSDP2, `devices` for DDP."
        )
    keys = _bucket_keys(lengths, buckets)
    resolved = _resolve_budget(budget, gpu, device, margin, precision)

    step = _StepBytes(module, batch_fn, resolved, device, optimizer, loss_fn, devices, world_size)
    needs = _Needs(lambda n, key: step(n, key[0] if len(key) == 1 else key))
    rows: list[BucketRow] = []
    previous: tuple[int, int] | None = None  # (largest batch, padded tokens) of the bucket before
    intercept: float | None = None  # what a batch of 0 needs, by the bucket before's line (the model's fixed bytes)
    slopes: list[tuple[Lengths, float]] = []  # bytes per sample of the buckets before, by their lengths
    for key in sorted(keys, key=sum):
        guess = _guess(key, slopes, intercept, resolved.usable, previous)
        n, line = _largest_batch(needs, key, resolved.usable, guess, max_batch_size, intercept)
        rows.append(_row(needs, key, n, max_batch_size))
        if progress is not None:
            progress(f"lengths {key}: largest batch {n} ({len(needs.known)} estimates so far)")
        if line is not None and line[1] > 0:
            intercept = line[0]
            slopes.append((key, line[1]))
        if n:
            previous = (n, sum(key))
    return TokenBudgetPlan(
        tuple(rows),
        resolved.total,
        resolved.usable,
        margin,
        resolved.precision,
        device,
        len(needs.known),
        time.perf_counter() - started,
    )


def _guess(
    key: Lengths, slopes: list[tuple[Lengths, float]], intercept: float | None, usable: int,
    previous: tuple[int, int] | None,
) -> int:  # fmt: skip
    """The first batch to estimate for the bucket ``key``: where the model's fixed bytes (``intercept``) and the bytes
    per sample, fitted as affine in each length over the buckets before (``slopes``), meet ``usable``; before there
    are enough buckets, the batch before scaled by the padded tokens (1 for the first bucket)."""
    if intercept is not None and len(slopes) > len(key):
        lengths = torch.tensor([[1.0, *k] for k, _ in slopes], dtype=torch.float64)
        per_sample = torch.tensor([[b] for _, b in slopes], dtype=torch.float64)
        weights = torch.linalg.lstsq(lengths, per_sample).solution
        predicted = float(torch.tensor([1.0, *key], dtype=torch.float64) @ weights[:, 0])
        if predicted > 0 and usable > intercept:
            return max(1, math.floor((usable - intercept) / predicted))
    if previous is None:
        return 1
    return max(1, previous[0] * previous[1] // sum(key))


def _row(needs: _Needs, key: Lengths, n: int, cap: int) -> BucketRow:
    known = needs.known
    needed = known.get((n, key))
    next_needed = None
    if n < cap:
        next_needed = known.get((n + 1, key))
    return BucketRow(key, n, needed, next_needed)


def _bucket_keys(lengths: Sequence[int | Sequence[int]] | None, buckets: int | Sequence[int | Sequence[int]]) -> list:
    if isinstance(buckets, int):
        if lengths is None:
            raise ValueError(
                f"`buckets={buckets}` needs the dataset's `lengths` (one per sample) to place the buckets; or give the"
                " bucket lengths themselves, e.g. buckets=[64, 128, 256, 512]."
            )
        return length_buckets(lengths, buckets)
    return sorted(set(as_lengths(list(buckets), "buckets")))


def longest_input(
    module: nn.Module,
    batch_fn: Callable[[int, Any], Any],
    batch_size: int,
    max_length: int,
    *,
    budget: int | float | str | None = None,
    margin: float = 0.1,
    precision: str = "auto",
    device: str = "cuda",
    gpu: str | tuple[int, int] | None = None,
    devices: int = 1,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None = None,
    loss_fn: Callable[[nn.Module, Any], Tensor] | None = None,
) -> int:
    """The longest input (``max_length``, ``max_frames``, ``max_peaks_n``) up to ``max_length`` whose step at
    ``batch_size`` fits ``budget`` (0: not even length 1); a binary search over estimates. ``batch_fn(n, length)``
    and the other arguments are those of :func:`plan_token_budget`.

    Examples:
        >>> model = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 4))
        >>> longest = longest_input(model, lambda n, length: torch.zeros(n, length, dtype=torch.long), 8, 4096,
        ...                         budget=2**20, device="cpu", margin=0.0)
        >>> 0 < longest < 4096
        True
    """
    check_positive_int("batch_size", batch_size)
    check_positive_int("max_length", max_length)
    resolved = _resolve_budget(budget, gpu, device, margin, precision)

    step = _StepBytes(module, batch_fn, resolved, device, optimizer, loss_fn, devices)
    low, high = 0, max_length + 1
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if step(batch_size, mid) <= resolved.usable else (low, mid)
    return low
