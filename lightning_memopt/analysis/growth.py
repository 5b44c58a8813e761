"""Whether memory grows over a phase: a least-squares line through its step readings, kept as bucketed sums.

The rule (documented for users in :func:`~lightning_memopt.analysis.summarize_memory_log`): leave out the first
third of the steps (warm-up); with fewer than 10 readings over 100 steps, or readings bunched in fewer than 4 of
8 blocks, the verdict is ``"too short"``; else the slope is reported (``"growing"`` / ``"shrinking"``) only when
it is 4 standard errors from zero and the line's change is twice the readings' scatter about it, otherwise
``"flat"``. :class:`StepFit` keeps sums in at most 64 step buckets, never the readings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

__all__ = ["Growth", "StepFit"]

#: The fit leaves out this fraction of a phase's steps (warm-up) and needs this many readings over this many
#: steps, in at least this many of 8 blocks, in the rest ...
GROWTH_WARM_UP = 1 / 3
GROWTH_MIN_READINGS = 10
GROWTH_MIN_STEPS = 100
GROWTH_BLOCKS = 8
GROWTH_MIN_BLOCKS = 4
#: ... and reports a slope only when it is this many standard errors from zero and the line's change over the
#: fitted steps is this many times the readings' scatter around the line (residual standard deviation).
GROWTH_MIN_T = 4.0
GROWTH_MIN_CHANGE_OVER_NOISE = 2.0
#: Step buckets the fit keeps per phase: sums per bucket, never the readings, so memory does not grow with the log.
GROWTH_BUCKETS = 64

#: A bucket: ``[n, first step, last step, mean step, mean bytes, Sxx, Syy, Sxy]``.
_Bucket = list[float]


def _merge(a: _Bucket, b: _Bucket) -> _Bucket:
    """Two buckets' least-squares sums as one (pairwise update of means and co-moments: stable, exact)."""
    n = a[0] + b[0]
    dx, dy = b[3] - a[3], b[4] - a[4]
    w = a[0] * b[0] / n
    return [
        n,
        min(a[1], b[1]),
        max(a[2], b[2]),
        a[3] + dx * b[0] / n,
        a[4] + dy * b[0] / n,
        a[5] + b[5] + dx * dx * w,
        a[6] + b[6] + dy * dy * w,
        a[7] + b[7] + dx * dy * w,
    ]


def _blocks(buckets: list[_Bucket], count: int) -> list[_Bucket]:
    """Consecutive buckets merged into at most ``count`` blocks of about the same number of readings."""
    total = sum(b[0] for b in buckets)
    blocks: list[_Bucket] = []
    current: _Bucket | None = None
    done = 0.0
    for b in buckets:
        merged = b
        if current is not None:
            merged = _merge(current, b)
        current = merged
        done += b[0]
        if done * count >= total * (len(blocks) + 1):
            blocks.append(current)
            current = None
    if current is not None:
        blocks.append(current)
    return blocks


@dataclass(frozen=True)
class Growth:
    """A phase's growth verdict: ``"growing"``, ``"shrinking"``, ``"flat"`` or ``"too short"``; ``per_1k_steps``
    the fitted slope times 1000 (growing and shrinking only); the readings and steps the verdict rests on."""

    verdict: str
    per_1k_steps: float | None
    readings: int
    first_step: int | None
    last_step: int | None


class StepFit:
    """(global_step, bytes) readings as least-squares sums in at most ``GROWTH_BUCKETS`` step buckets.

    A bucket holds ``[n, first step, last step, mean step, mean bytes, Sxx, Syy, Sxy]`` (sums of squares about
    its means, updated one reading at a time, so large byte counts lose no precision). Buckets cover steps
    ``[k * width, (k + 1) * width)``; when there are too many, the width doubles and neighbours merge. The buckets
    depend only on which readings arrived, not on their order, and fitting any run of buckets is exact.

    Examples:
        >>> fit = StepFit()
        >>> for step in range(0, 401, 10):
        ...     fit.add(step, 100 + 2 * step)
        >>> fit.growth()
        Growth(verdict='growing', per_1k_steps=2000.0, readings=27, first_step=140, last_step=400)
    """

    __slots__ = ("buckets", "width")

    def __init__(self) -> None:
        self.width = 1
        self.buckets: dict[int, _Bucket] = {}

    def __len__(self) -> int:
        return len(self.buckets)

    def add(self, step: int, value: float) -> None:
        key = step // self.width
        b = self.buckets.get(key)
        if b is None:
            self.buckets[key] = [1.0, step, step, float(step), float(value), 0.0, 0.0, 0.0]
            while len(self.buckets) > GROWTH_BUCKETS:
                self._coarsen()
            return
        n = b[0] + 1.0
        dx, dy = step - b[3], value - b[4]
        b[3] += dx / n
        b[4] += dy / n
        b[5] += dx * (step - b[3])
        b[6] += dy * (value - b[4])
        b[7] += dx * (value - b[4])
        b[0] = n
        if step < b[1]:
            b[1] = step
        elif step > b[2]:
            b[2] = step

    def _coarsen(self) -> None:
        self.width *= 2
        merged: dict[int, _Bucket] = {}
        for key, b in self.buckets.items():
            half = key // 2
            if half not in merged:
                merged[half] = b
            else:
                merged[half] = _merge(merged[half], b)
        self.buckets = merged

    def growth(self) -> Growth:
        """The verdict of the rule above on the readings added so far."""
        buckets = [self.buckets[k] for k in sorted(self.buckets)]
        if not buckets:
            return Growth("too short", None, 0, None, None)
        first, last = int(buckets[0][1]), int(buckets[-1][2])
        short = Growth("too short", None, int(sum(b[0] for b in buckets)), first, last)
        cut = first + (last - first) * GROWTH_WARM_UP
        window = [b for b in buckets if b[1] >= cut]  # the first part of the steps holds the warm-up
        if not window:
            return short
        n, lo, hi, mx, my, sxx, syy, sxy = reduce(_merge, window)
        blocks = _blocks(window, GROWTH_BLOCKS)
        if n < GROWTH_MIN_READINGS or hi - lo < GROWTH_MIN_STEPS or len(blocks) < GROWTH_MIN_BLOCKS:
            return short
        slope = sxy / sxx
        scatter = max(syy - slope * sxy, 0.0) / (n - 2)  # the readings' variance about the line
        # The block means' variance about the line, per reading: as large as `scatter` when the readings
        # scatter independently, larger when memory wanders in plateaus (host RSS); the slope's error uses the larger.
        wander = sum(b[0] * (b[4] - my - slope * (b[3] - mx)) ** 2 for b in blocks) / (len(blocks) - 2)
        error = math.sqrt(max(scatter, wander) / sxx)
        change = slope * (hi - lo)
        significant = (
            slope != 0
            and abs(slope) >= GROWTH_MIN_T * error
            and (abs(change) >= GROWTH_MIN_CHANGE_OVER_NOISE * math.sqrt(scatter))
        )
        if not significant:
            return Growth("flat", None, int(n), int(lo), int(hi))
        return Growth("growing" if slope > 0 else "shrinking", 1000.0 * slope, int(n), int(lo), int(hi))
