"""The Trainer-free core of ``GarbageCollector``: which generation to collect at an optimizer step."""

from __future__ import annotations

__all__ = ["CollectionSchedule"]


class CollectionSchedule:
    """Which garbage-collector generation to collect at an optimizer step, if any: the same answer on every rank.

    A collection runs every ``every_n_train_steps`` optimizer steps (``generation``), and a full one (generation 2)
    every ``full_every_n_train_steps`` in its place; never at step 0 and once per step (gradient accumulation asks per
    micro-batch).

    Examples:
        >>> schedule = CollectionSchedule(every_n_train_steps=2, generation=1, full_every_n_train_steps=3)
        >>> [schedule.generation_at(step) for step in (0, 1, 2, 2, 3, 4, 6)]
        [None, None, 1, None, 2, 1, 2]
    """

    def __init__(self, every_n_train_steps: int, generation: int, full_every_n_train_steps: int | None) -> None:
        self.every_n_train_steps = every_n_train_steps
        self.generation = generation
        self.full_every_n_train_steps = full_every_n_train_steps
        self.last_step = -1

    def generation_at(self, step: int) -> int | None:
        """The generation to collect at ``step``, or ``None``; a step that gets one is not asked about again."""
        every, full = self.every_n_train_steps, self.full_every_n_train_steps
        if step == self.last_step or step == 0 or (step % every and (full is None or step % full)):
            return None
        self.last_step = step
        return 2 if full is not None and step % full == 0 else self.generation
