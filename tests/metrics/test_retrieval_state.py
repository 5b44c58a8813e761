"""A StreamingRetrievalMetric's saved states are checked on load: a mangled one is an error naming the metric, the
state and the value (losing evaluation rows is not harmless), never a failure in a later update or compute."""

from __future__ import annotations

import pytest
import torch

from lightning_memopt.metrics import StreamingRetrievalMetric
from tests.helpers.retrieval import make_data

STATES = ["video_features", "text_features", "row_text_ids", "sample_ids", "unique_text_ids"]
MANGLED = [None, "x", -1, [1, 2], {"a": torch.zeros(2)}, [None]]


def _saved():
    video, text, ids = make_data(n=6, d=4, n_captions=3, seed=8)
    metric = StreamingRetrievalMetric(top_k=(1,))
    metric.persistent(True)
    metric.update(video, text, text_ids=ids, sample_ids=torch.arange(6))
    return metric, metric.state_dict()


def _fresh():
    metric = StreamingRetrievalMetric(top_k=(1,))
    metric.persistent(True)
    return metric


@pytest.mark.parametrize("key", STATES)
@pytest.mark.parametrize("value", [*MANGLED, "wrong shape", "wrong dtype"], ids=repr)
def test_a_mangled_metric_state_is_an_error_naming_the_metric_and_state(key, value):
    _, state = _saved()
    if value == "wrong shape":  # features as 1-D, ids as 2-D float
        value = [torch.zeros(3)] if key.endswith("features") else [torch.zeros(2, 2, dtype=torch.int64)]
    if value == "wrong dtype":  # integer features, float ids
        value = [torch.zeros(2, 4, dtype=torch.int64)] if key.endswith("features") else [torch.zeros(3)]
    state[key] = value
    with pytest.raises(ValueError) as info:
        _fresh().load_state_dict(state)
    message = str(info.value)
    assert message.startswith(f"StreamingRetrievalMetric: the checkpoint's state key {key!r} must be a list of ")
    assert "got " in message and "checkpoint" in message


def test_a_valid_state_loads_and_computes_the_same():
    saved, state = _saved()
    expected = saved.compute()
    loaded = _fresh()
    loaded.load_state_dict(state)
    assert loaded.compute() == expected


def test_a_state_saved_as_one_tensor_per_state_loads_and_computes_the_same():
    """A state may be saved concatenated (one tensor, as a sync leaves it); a state without rows as an empty one."""
    saved, state = _saved()
    expected = saved.compute()
    joined = {key: torch.cat(value) if value else torch.zeros(0, dtype=torch.int64) for key, value in state.items()}
    loaded = _fresh()
    loaded.load_state_dict(joined)
    assert loaded.compute() == expected
    assert loaded.video_ids == [] and [t.shape for t in loaded.video_features] == [(6, 4)]
    video, text, ids = make_data(n=6, d=4, n_captions=3, seed=8)
    loaded.update(video, text, text_ids=ids, sample_ids=torch.arange(6))  # the same rows again: counted once
    assert loaded.compute() == expected
