"""A checkpoint value that fails its check is shown cut to a few items and levels, never dumped whole."""

from __future__ import annotations

import pytest

from lightning_memopt.utilities.state import state_error


def _shown(value):
    message = str(state_error("GarbageCollector", "steps", "an int", value))
    assert message.startswith("GarbageCollector: the checkpoint's state key 'steps' must be an int, got ")
    return message.split("got ", 1)[1].rsplit(f" ({type(value).__name__})", 1)[0]


@pytest.mark.parametrize(
    ("value", "cut"),
    [
        ([[[7]]], "[[[...]]]"),  # two levels shown, the third elided
        (list(range(10)), "[0, 1, 2, 3, ...]"),  # four items shown
    ],
)
def test_a_bad_value_is_shown_two_levels_deep_and_four_items_wide(value, cut):
    assert _shown(value) == cut


def test_a_long_string_is_cut_to_forty_characters():
    shown = _shown("x" * 100)
    assert "..." in shown and len(shown) <= 40 + len("''")


def test_a_large_value_keeps_the_message_short():
    message = str(state_error("Metric", "ids", "a list of tensors", {str(i): list(range(1000)) for i in range(1000)}))
    assert len(message) < 400 and message.count("...") >= 2
