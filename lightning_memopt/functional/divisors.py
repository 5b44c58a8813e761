"""The divisors of a batch size: the micro-batches that split it evenly (``sympy.divisors``, which torch requires)."""

from __future__ import annotations

__all__ = ["INT64_MAX", "divisors"]

#: The largest int64: torch and the samplers count samples in int64, so no batch is larger.
INT64_MAX = 2**63 - 1


def divisors(n: int) -> list[int]:
    """Every divisor of ``n`` (``1 <= n <= 2**63 - 1``), ascending.

    ``sympy.divisors`` (sympy is a requirement of torch) factorises ``n`` first (trial division, then Pollard's rho
    and a deterministic primality test): milliseconds for any int64, where trial division up to ``sqrt(n)`` takes
    minutes for a prime near ``2**63``.

    Raises:
        ValueError: ``n`` is not an int in that range.

    Examples:
        >>> divisors(12), len(divisors(10**12)), divisors(2**63 - 25)  # the largest prime below 2**63
        ([1, 2, 3, 4, 6, 12], 169, [1, 9223372036854775783])
    """
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= INT64_MAX:
        raise ValueError(f"`n` must be an int in [1, 2**63 - 1] (a batch size), got {n!r}.")
    from sympy import divisors as sympy_divisors  # imported on first use: 0.2 s that most runs never need

    return sympy_divisors(n)
