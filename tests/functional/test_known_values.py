"""KnownValues: real values beside fake tensors that depend on no data, dropped as soon as data reaches them."""

from __future__ import annotations

import contextlib
import sys
import types

import pytest
import torch
from torch._subclasses import fake_tensor

from lightning_memopt.functional.planning.counter import LiveBytes
from lightning_memopt.functional.planning.known_values import KnownValues


@pytest.fixture
def mode():
    return fake_tensor.FakeTensorMode()


@contextlib.contextmanager
def following(mode, **kwargs):
    """The fake mode, and a counter that runs every operator through a KnownValues (as an estimate does)."""
    known = KnownValues(mode, **kwargs)
    with mode, LiveBytes(run=known.run), known.library_checks():
        yield known


def test_tensors_made_from_shapes_are_known_and_their_views_too(mode):
    with following(mode) as known:
        positions = torch.arange(12).view(3, 4)
        row = positions[1]  # a view of a known storage
        doubled = row * 2
        assert known.value(row).tolist() == [4, 5, 6, 7]
        assert doubled.sum().item() == 44
        assert torch.equal(positions.t()[0], torch.tensor([0, 4, 8]))


def test_data_reaching_a_tensor_makes_it_unknown_and_its_check_fails_as_before(mode):
    with following(mode) as known:
        weight = torch.empty(4)  # no values: as a parameter's fake twin
        mask = torch.ones(4)
        view = mask[:2]
        mask.mul_(weight)  # an unknown value written in place: the storage (and its views) unknown
        assert known.value(mask) is None and known.value(view) is None
        with pytest.raises(fake_tensor.DataDependentOutputException):
            mask.sum().item()
        mask.fill_(3.0)  # a whole overwrite by a known value: known again
        assert mask.sum().item() == 12.0


def test_random_numbers_stay_unknown_and_the_generator_is_not_used(mode):
    state = torch.get_rng_state()
    with following(mode) as known:
        noise = torch.rand(8)
        kept = torch.ones(8) * (noise > 0.5)
        assert known.value(noise) is None and known.value(kept) is None
    assert torch.equal(torch.get_rng_state(), state)


def test_a_data_sized_output_gets_its_real_shape(mode):
    with following(mode):
        mask = torch.tensor([True, False, True, True])
        where = mask.nonzero()
        assert where.shape == (3, 1) and isinstance(where, fake_tensor.FakeTensor)
        assert where.flatten().tolist() == [0, 2, 3]


def test_a_tensor_over_the_limit_is_left_unknown(mode):
    with following(mode, numel_limit=100) as known:
        small, large = torch.ones(10, 10), torch.ones(11, 10)
        assert known.value(small) is not None and known.value(large) is None


def test_the_given_tensor_is_copied_never_written(mode):
    given = torch.tensor([1, 2, 3])
    with following(mode) as known:
        twin = mode.from_tensor(given)
        known.remember(twin, given)
        twin.add_(10)
        assert twin.tolist() == [11, 12, 13]
    assert given.tolist() == [1, 2, 3]


def test_hugging_face_s_fake_check_answers_false_for_known_tensors_and_is_put_back(mode, monkeypatch):
    """Hugging Face's ``is_tracing`` asks ``is_fake_tensor`` before a data-dependent shortcut; a stand-in module
    keeps the test independent of the installed transformers."""
    module = types.ModuleType("transformers.utils.import_utils")

    def is_fake_tensor(value):
        return isinstance(value, fake_tensor.FakeTensor)

    module.is_fake_tensor = is_fake_tensor
    monkeypatch.setitem(sys.modules, "transformers.utils.import_utils", module)
    with following(mode):
        known, unknown = torch.ones(3), torch.empty(3)
        assert module.is_fake_tensor(known) is False and module.is_fake_tensor(unknown) is True
        assert module.is_fake_tensor(3) is False
    assert module.is_fake_tensor is is_fake_tensor
