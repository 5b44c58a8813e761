"""The least-squares slope of a series: how fast a figure changes per step (memory per optimizer step)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["least_squares_slope"]


def least_squares_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The slope of the least-squares line through ``(xs[i], ys[i])``; ``0.0`` when every ``x`` is the same.

    Used by :func:`~lightning_memopt.functional.leaks.detect_growth` (bytes per optimizer step over a window of leak
    samples); any trend of a figure over steps can use it.

    Raises:
        ValueError: if ``xs`` and ``ys`` differ in length or are empty.

    Example:
        >>> least_squares_slope([10, 20, 30, 40], [1000, 2000, 3000, 4000])
        100.0
        >>> least_squares_slope([5, 5], [1, 9])
        0.0
    """
    n = len(xs)
    if n != len(ys) or n == 0:
        raise ValueError(f"`xs` and `ys` must be non-empty and of one length, got {n} and {len(ys)}.")
    fx = [float(x) for x in xs]
    fy = [float(y) for y in ys]
    mean_x = sum(fx) / n
    mean_y = sum(fy) / n
    var_x = sum((x - mean_x) ** 2 for x in fx)
    if var_x == 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(fx, fy)) / var_x
