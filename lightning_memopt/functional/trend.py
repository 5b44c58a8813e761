"""The least-squares slope of a series: how fast a figure changes per step (memory per optimizer step)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

__all__ = ["least_squares_slope"]


def least_squares_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The slope of the least-squares line through ``(xs[i], ys[i])``; ``0.0`` when every ``x`` is the same.

    :func:`statistics.linear_regression`, with one point or a constant ``x`` meaning "no trend" instead of an
    error. Used by :func:`~lightning_memopt.functional.leaks.detect_growth` (bytes per optimizer step over a window
    of leak samples).

    Raises:
        ValueError: if ``xs`` and ``ys`` differ in length or are empty.

    Example:
        >>> least_squares_slope([10, 20, 30, 40], [1000, 2000, 3000, 4000])
        100.0
        >>> least_squares_slope([5, 5], [1, 9]), least_squares_slope([5], [1])
        (0.0, 0.0)
    """
    if len(xs) != len(ys) or not xs:
        raise ValueError(f"`xs` and `ys` must be non-empty and of one length, got {len(xs)} and {len(ys)}.")
    try:
        return float(statistics.linear_regression(xs, ys).slope)
    except statistics.StatisticsError:  # one point, or every x the same: nothing to fit a slope to
        return 0.0
