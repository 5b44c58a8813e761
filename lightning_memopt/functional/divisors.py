"""Divisors of any int64, from its prime factors: the micro-batches that split a batch evenly.

Trial division by the primes below 1000, then Miller-Rabin (deterministic for every int64) and Pollard's rho (Brent's
variant) for what is left: milliseconds for any ``n <= 2**63 - 1``, where trial division over ``1..n`` or
``1..sqrt(n)`` takes hours or minutes.
"""

from __future__ import annotations

import math

__all__ = ["INT64_MAX", "divisors", "is_prime", "prime_factors"]

#: The largest int64: torch and the samplers count samples in int64, so no batch is larger.
INT64_MAX = 2**63 - 1
# Deterministic Miller-Rabin witnesses for every n < 3.3e24 (far above INT64_MAX).
_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
_SMALL_PRIMES = tuple(p for p in range(2, 1000) if all(p % q for q in range(2, math.isqrt(p) + 1)))


def _check(n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= INT64_MAX:
        raise ValueError(f"`n` must be an int in [1, 2**63 - 1] (a batch size), got {n!r}.")
    return n


def is_prime(n: int) -> bool:
    """Whether ``n`` is prime; exact for every ``n < 3.3e24`` (Miller-Rabin with the first 13 primes as witnesses).

    Example:
        >>> [p for p in range(30) if is_prime(p)], is_prime(2**61 - 1), is_prime(2**62)
        ([2, 3, 5, 7, 11, 13, 17, 19, 23, 29], True, False)
    """
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _find_factor(n: int) -> int:
    """A non-trivial factor of the odd composite ``n`` (Brent's variant of Pollard's rho, batched gcds)."""
    for c in range(1, n):
        y, r, q, g = 2, 1, 1, 1
        x = ys = y
        while g == 1:
            x = y
            for _ in range(r):
                y = (y * y + c) % n
            k = 0
            while k < r and g == 1:
                ys = y
                for _ in range(min(128, r - k)):
                    y = (y * y + c) % n
                    q = q * abs(x - y) % n
                g = math.gcd(q, n)
                k += 128
            r *= 2
        if g == n:  # the batch overshot: step back one at a time
            g = 1
            while g == 1:
                ys = (ys * ys + c) % n
                g = math.gcd(abs(x - ys), n)
        if g != n:
            return g
    raise AssertionError(f"no factor found for {n}")  # pragma: no cover


def prime_factors(n: int) -> dict[int, int]:
    """``{prime: exponent}`` of ``n`` (``1 <= n <= 2**63 - 1``), smallest prime first.

    Raises:
        ValueError: ``n`` is not an int in that range.

    Example:
        >>> prime_factors(10**12), prime_factors(1)
        ({2: 12, 5: 12}, {})
    """
    n = _check(n)
    exponents: dict[int, int] = {}
    for p in _SMALL_PRIMES:
        while n % p == 0:
            exponents[p] = exponents.get(p, 0) + 1
            n //= p
    pending = [n] if n > 1 else []
    while pending:
        m = pending.pop()
        if is_prime(m):
            exponents[m] = exponents.get(m, 0) + 1
        else:
            f = _find_factor(m)
            pending += [f, m // f]
    return dict(sorted(exponents.items()))


def divisors(n: int) -> list[int]:
    """Every divisor of ``n`` (``1 <= n <= 2**63 - 1``) in increasing order, from its prime factors.

    Raises:
        ValueError: ``n`` is not an int in that range.

    Example:
        >>> divisors(12), len(divisors(10**12)), divisors(2**63 - 25)  # the largest prime below 2**63
        ([1, 2, 3, 4, 6, 12], 169, [1, 9223372036854775783])
    """
    found = [1]
    for p, e in prime_factors(n).items():
        found = [d * p**k for d in found for k in range(e + 1)]
    return sorted(found)
