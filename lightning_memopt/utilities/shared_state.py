"""Process-wide settings borrowed by runs that may overlap: the first in applies, the last out gives back.

Python's garbage collector, the CUDA allocator's settings and memory fraction, allocator history recording and the
float32 matmul precision belong to the process, not to one ``Trainer``. Two fits can overlap in one process (two
threads, a notebook, a sweep driver), so a part that saves the state at its own start and restores it at its own end
gives back the *other* run's change when the ends interleave: the last one out restores what the first one set.

Every such change in this package goes through :func:`borrow`. Borrowers of one ``key`` are counted per process,
under one lock:

* the first borrower in applies its value and keeps what is needed to give back the state from before it;
* a later borrower asking for the same value joins without touching anything;
* a later borrower asking for a *different* value also joins, but the value in effect stays the first one's: it gets
  one warning (per :class:`~lightning_memopt.utilities.warnings.WarnOnce` it passes) that names both values, and
  :attr:`Lease.in_effect` says which value it runs with. Values never combine: a process has one setting;
* the last borrower out gives back the state from before the first one came in, whoever that was.

A :class:`Lease` is released at most once (teardown and ``on_exception`` may both release it). Applying and giving
back run while the lock is held, so a borrower that joins always sees the setting already applied.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_memopt.utilities.warnings import WarnOnce

__all__ = ["Lease", "borrow", "borrowers"]

#: Gives the state from before the first borrower back; built by the first borrower's ``apply``.
Restore = Callable[[], None]

_LOCK = threading.RLock()


@dataclass
class _Holding:
    value: Any
    restore: Restore
    count: int


_HELD: dict[str, _Holding] = {}


class Lease:
    """One borrower's hold on a process-wide setting, from :func:`borrow`; :meth:`release` gives it up once.

    A copy made by ``pickle`` or ``copy.deepcopy`` holds nothing: only the borrower that was counted releases.
    """

    def __init__(self, key: str, value: Any, in_effect: Any) -> None:
        self.key = key
        #: The value this borrower asked for.
        self.value = value
        #: The value in effect while this lease is held (another borrower's when it came first with another value).
        self.in_effect = in_effect
        self._held = True

    @property
    def held(self) -> bool:
        """Whether this lease is still counted."""
        return self._held

    def release(self) -> None:
        """Stop borrowing. The last borrower of the key out gives the state from before the first one back.

        Raises what giving it back raised (the lease is released all the same, and the next borrower starts afresh).
        """
        with _LOCK:
            if not self._held:
                return
            self._held = False
            holding = _HELD.get(self.key)
            if holding is None:  # pragma: no cover - a lease always has its holding while held
                return
            holding.count -= 1
            if holding.count > 0:
                return
            del _HELD[self.key]
            holding.restore()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_released_lease, (self.key, self.value, self.in_effect))

    def __deepcopy__(self, memo: dict[int, Any]) -> Lease:
        return _released_lease(self.key, self.value, self.in_effect)

    def __repr__(self) -> str:
        state = "held" if self._held else "released"
        return f"Lease({self.key!r}, value={self.value!r}, in_effect={self.in_effect!r}, {state})"


def _released_lease(key: str, value: Any, in_effect: Any) -> Lease:
    lease = Lease(key, value, in_effect)
    lease._held = False
    return lease


def borrow(
    key: str,
    value: Any,
    apply: Callable[[Any], Restore | None],
    warn: WarnOnce | None = None,
    who: str = "",
) -> Lease | None:
    """Borrow the process-wide setting ``key`` with ``value`` until the returned lease is released.

    Args:
        key: Names the setting, e.g. ``"gc.automatic"`` or ``"cuda.memory_fraction:0"``.
        value: What this borrower wants; compared with ``==`` to the value in effect.
        apply: Called only by the first borrower in (while no one holds ``key``): applies ``value`` and returns the
            function that gives back the state from before, or ``None`` when it applied nothing (then nothing is
            held and :func:`borrow` returns ``None``; the next borrower calls ``apply`` again). What it raises
            reaches the caller and nothing is held.
        warn: Where the warning about a different value in effect goes (one per key); a fresh one when ``None``.
        who: Names the borrower in that warning, e.g. ``"AllocatorSettings"``.

    Returns:
        The lease to release at the end, or ``None`` when ``apply`` applied nothing.

    Examples:
        >>> state = {"x": 0}
        >>> def set_x(value):
        ...     before, state["x"] = state["x"], value
        ...     return lambda: state.update(x=before)
        >>> first = borrow("example.x", 1, set_x)
        >>> second = borrow("example.x", 1, set_x)
        >>> first.release(); state["x"], borrowers("example.x")
        (1, 1)
        >>> second.release(); state["x"], borrowers("example.x")
        (0, 0)
    """
    with _LOCK:
        holding = _HELD.get(key)
        if holding is None:
            restore = apply(value)
            if restore is None:
                return None
            _HELD[key] = _Holding(value, restore, 1)
            return Lease(key, value, value)
        holding.count += 1
        if holding.value != value:
            (warn or WarnOnce()).warn(
                f"shared:{key}",
                f"{who or 'A run'} asked for `{key}` = {value!r} while another run in this process holds"
                f" {holding.value!r}. A process has one such setting: the first run's value stays in effect until"
                " every run that borrowed it has ended, and then the state from before the first one is given back.",
            )
        return Lease(key, value, holding.value)


def borrowers(key: str) -> int:
    """How many leases on ``key`` are held now in this process (0 when the setting is not borrowed)."""
    with _LOCK:
        holding = _HELD.get(key)
        return 0 if holding is None else holding.count
