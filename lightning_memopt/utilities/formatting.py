"""Formatting helpers for reports and console output."""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(num: int | float | None) -> str:
    """Human-readable bytes (binary units).

    Example:
        >>> format_bytes(3 * 1024**3), format_bytes(None), format_bytes(512)
        ('3.00 GiB', 'n/a', '512 B')
    """
    if num is None:
        return "n/a"
    value = float(num)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"  # pragma: no cover
