"""CollectionSchedule: which generation GarbageCollector collects at an optimizer step."""

from __future__ import annotations

from lightning_memopt.functional.collection import CollectionSchedule


def test_the_schedule_answers_once_per_optimizer_step():
    schedule = CollectionSchedule(every_n_train_steps=25, generation=1, full_every_n_train_steps=None)
    assert [schedule.generation_at(s) for s in (0, 25, 25, 30, 50)] == [None, 1, None, None, 1]


def test_a_full_collection_takes_the_place_of_the_regular_one():
    schedule = CollectionSchedule(every_n_train_steps=4, generation=0, full_every_n_train_steps=6)
    due = {step: schedule.generation_at(step) for step in range(1, 13)}
    assert {step: generation for step, generation in due.items() if generation is not None} == {4: 0, 6: 2, 8: 0, 12: 2}
