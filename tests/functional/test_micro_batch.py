"""The first-batch check of the slicer (functional/micro_batch/slicing.py): refuse what cannot be split, say what is
split."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler

from lightning_memopt.functional.micro_batch.slicing import check_first_batch, loader_batch_size


class Opaque:
    """A batch element the default slicer cannot split."""


def test_an_element_the_slicer_cannot_split_is_refused_by_its_place_and_the_fix():
    batch = {"x": torch.zeros(8, 3), "meta": Opaque()}
    with pytest.raises(TypeError, match=r"cannot split `batch\['meta'\]`.*split_batch_fn=fn"):
        check_first_batch(batch, 8)


def test_a_tensor_whose_first_dim_is_not_the_batch_size_is_refused():
    with pytest.raises(TypeError, match=r"cannot split `batch\[1\]`: a tensor of shape \(4, 8\)"):
        check_first_batch((torch.zeros(8, 2), torch.zeros(4, 8)), 8)


def test_a_split_batch_fn_whose_one_sample_counts_as_more_is_refused():
    def split(batch, start, stop):
        return batch  # ignores start and stop

    with pytest.raises(ValueError, match="counts as 8 samples"):
        check_first_batch(torch.zeros(8, 2), 8, split_batch_fn=split)


def test_a_batch_of_one_and_a_good_split_batch_fn_pass():
    calls = []

    def split(batch, start, stop):
        calls.append((start, stop))
        return batch[start:stop]

    assert check_first_batch(torch.zeros(8, 2), 8, split_batch_fn=split, expected_size=4) is None  # the user's split
    assert calls == [(0, 1)]
    assert check_first_batch({"x": torch.zeros(1, 2), "meta": Opaque()}, 1) is None  # nothing to split


def test_a_time_major_batch_is_named_with_the_dim_being_split():
    tokens, mask = torch.zeros(20, 8, 5), torch.zeros(20, 8)  # (T, B, F): T = 20 time steps, B = 8 samples
    warning = check_first_batch({"tokens": tokens, "mask": mask}, 20, expected_size=8)
    assert "first dim of `batch['tokens']` (20 samples" in warning and "batch_size is 8" in warning
    assert check_first_batch({"tokens": torch.zeros(8, 20, 5)}, 8, expected_size=8) is None


def test_the_batch_size_of_a_loader_or_its_batch_sampler():
    assert loader_batch_size(DataLoader(range(10), batch_size=3)) == 3
    sampler = BatchSampler(SequentialSampler(range(10)), batch_size=5, drop_last=False)
    assert loader_batch_size(DataLoader(range(10), batch_sampler=sampler)) == 5
    assert loader_batch_size({"a": DataLoader(range(10))}) is None
