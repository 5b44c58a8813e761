"""The package's one divisor function: exact against trial division, fast for any int64."""

from __future__ import annotations

import time

import pytest

from lightning_memopt.functional import divisors as module
from lightning_memopt.functional.divisors import INT64_MAX, divisors
from lightning_memopt.functional.presets import plan_accumulation
from lightning_memopt.planner import plan as planner_plan


def _brute_force(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def test_divisors_equal_trial_division_from_1_to_2000():
    assert all(divisors(n) == _brute_force(n) for n in range(1, 2001))


def _check_divisor_list(n: int, found: list[int]) -> None:
    """Every entry divides ``n``, ascending, no repeats, and pairs up with its co-divisor (``d * (n // d) == n``)."""
    assert found == sorted(set(found)) and found[0] == 1 and found[-1] == n
    assert all(type(d) is int and n % d == 0 for d in found)
    assert found[::-1] == [n // d for d in found]


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (10**12, sorted(2**a * 5**b for a in range(13) for b in range(13))),
        (2**62, [2**k for k in range(63)]),
        (2**63 - 25, [1, 2**63 - 25]),  # the largest prime below 2**63
        (2**61 - 1, [1, 2**61 - 1]),  # a Mersenne prime
        ((2**31 - 1) ** 2, [1, 2**31 - 1, (2**31 - 1) ** 2]),  # a prime square
        (4294967291 * 2147483647, [1, 2147483647, 4294967291, 4294967291 * 2147483647]),  # two 32-bit primes
    ],
    ids=["10^12", "2^62", "prime-near-2^63", "mersenne-2^61-1", "prime-square", "semiprime"],
)
def test_divisors_of_large_int64s_in_milliseconds(n, expected):
    divisors(12)  # the first call imports sympy
    started = time.perf_counter()
    found = divisors(n)
    assert time.perf_counter() - started < 1.0
    assert found == expected
    _check_divisor_list(n, found)


def test_a_highly_composite_number_and_int64_max():
    n = 963761198400  # a highly composite number: 6720 divisors, more than any smaller number has
    found = divisors(n)
    _check_divisor_list(n, found)
    assert len(found) == 6720
    found = divisors(INT64_MAX)  # 7**2 x 73 x 127 x 337 x 92737 x 649657
    _check_divisor_list(INT64_MAX, found)
    assert len(found) == 3 * 2**5


def test_one_divisor_function_and_no_factorisation_of_its_own():
    """The module is the one small function: no primality test or factorisation routine written by hand."""
    assert module.__all__ == ["INT64_MAX", "divisors"]
    assert not hasattr(module, "prime_factors") and not hasattr(module, "is_prime")


@pytest.mark.parametrize("bad", [0, -12, 2**63, 12.0, True, "12"])
def test_divisors_refuses_what_is_not_a_batch_size(bad):
    with pytest.raises(ValueError, match=r"`n` must be an int in \[1, 2\*\*63 - 1\]"):
        divisors(bad)


def test_the_planner_and_the_presets_use_it():
    assert planner_plan.divisors is divisors
    started = time.perf_counter()
    plan = plan_accumulation(2 * (2**61 - 1), target_accumulation=3)  # per rank: 2 x a Mersenne prime
    assert time.perf_counter() - started < 1.0
    assert (plan.micro_batch_size, plan.accumulate_grad_batches) == (2, 2**61 - 1)
