"""The Trainer-free cores of ``CacheCleaner`` and ``GarbageCollector``: timed calls and the collection schedule."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["CollectionSchedule", "TimedCalls"]

T = TypeVar("T")


class TimedCalls:
    """Runs an action and counts the calls that returned and the seconds they took (a call that raises counts not).

    Args:
        clock: Seconds, increasing (``time.perf_counter``); tests pass a fake.

    Example:
        >>> now = [0.0]
        >>> def work():
        ...     now[0] += 0.5
        ...     return 3
        >>> timed = TimedCalls(clock=lambda: now[0])
        >>> timed.run(work), timed.run(work), timed.calls, timed.seconds
        (3, 3, 2, 1.0)
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.calls = 0
        self.seconds = 0.0

    def run(self, action: Callable[[], T]) -> T:
        """``action()``, timed; its exception propagates and the call is not counted."""
        start = self.clock()
        result = action()
        self.seconds += self.clock() - start
        self.calls += 1
        return result


class CollectionSchedule:
    """Which garbage-collector generation to collect at an optimizer step, if any: the same answer on every rank.

    A collection runs every ``every_n_steps`` optimizer steps (``generation``), and a full one (generation 2) every
    ``full_every_n_steps`` in its place; never at step 0 and once per step (gradient accumulation asks per
    micro-batch).

    Example:
        >>> schedule = CollectionSchedule(every_n_steps=2, generation=1, full_every_n_steps=3)
        >>> [schedule.generation_at(step) for step in (0, 1, 2, 2, 3, 4, 6)]
        [None, None, 1, None, 2, 1, 2]
    """

    def __init__(self, every_n_steps: int, generation: int, full_every_n_steps: int | None) -> None:
        self.every_n_steps = every_n_steps
        self.generation = generation
        self.full_every_n_steps = full_every_n_steps
        self.last_step = -1

    def generation_at(self, step: int) -> int | None:
        """The generation to collect at ``step``, or ``None``; a step that gets one is not asked about again."""
        full = self.full_every_n_steps
        if step == self.last_step or step == 0 or (step % self.every_n_steps and (full is None or step % full)):
            return None
        self.last_step = step
        return 2 if full is not None and step % full == 0 else self.generation
