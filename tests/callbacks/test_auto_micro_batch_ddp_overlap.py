"""AutoMicroBatch under DDP keeps the all-reduces inside the backward of a batch that runs whole, and a rank that runs
out of memory there leaves no rank waiting; with a TokenBudgetBatchSampler's batches (of different sizes on the two
ranks) both ways Lightning can meet the sampler end without a hang. All tests read one run of
``tests/scripts/amb_ddp_overlap.py``."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.amb import fit
from tests.helpers.subprocess_run import run_script_once
from tests.scripts.amb_ddp_overlap import LENGTHS, N, Reentrant


@pytest.fixture(scope="module")
def overlap_run(tmp_path_factory):
    return run_script_once(tmp_path_factory, "amb_ddp_overlap.py")


def _ranks(directory, name):
    return [torch.load(directory / f"{name}_rank{r}.pt", weights_only=False) for r in (0, 1)]


def _assert_same_weights(a, b, exact=True):
    assert a.keys() == b.keys()
    for name, value in a.items():
        if exact:
            assert torch.equal(value, b[name]), name
        else:
            assert torch.allclose(value, b[name], atol=1e-6), name


def _as_the_reducer(directory, name, reducer_name):
    """Both ranks of run ``name`` against DDP's reducer's run: the same weights bitwise, and the same parameters with
    a gradient (one no rank uses keeps none, one only rank 0 uses gets the average); ``(reducer, run)``."""
    reducer, run = _ranks(directory, reducer_name), _ranks(directory, name)
    for rank in (0, 1):
        _assert_same_weights(run[rank]["weights"], reducer[rank]["weights"])
        assert run[rank]["has_grad"] == reducer[rank]["has_grad"]
    return reducer, run


@pytest.mark.slow
def test_without_out_of_memory_the_buckets_all_reduce_inside_backward_and_equal_ddps_reducer_bitwise(overlap_run):
    reducer, overlap = _as_the_reducer(overlap_run, "overlap", "reducer")
    assert [rank["sizes"] for rank in overlap] == [[8, 8, 8]] * 2
    assert reducer[0]["has_grad"][0] == [True, False, True, True, True, True, True]  # probe, unused, rank0_only, ...
    # 6 buckets, last parameter first: the head, the layer's bias, its weight, rank0_only, unused, the probe. A bucket
    # starts from backward once its gradients and the buckets before it are in, the last one always after backward:
    # 4 a step on rank 0 (the unused one waits for the end of backward), 3 on rank 1 (which never uses rank0_only)
    assert (overlap[0]["launched"], overlap[1]["launched"]) == (3 * 4, 3 * 3)


@pytest.mark.slow
@pytest.mark.parametrize("phase", ["backward", "forward"])
def test_a_rank_out_of_memory_inside_or_before_the_overlapped_backward_leaves_no_rank_waiting(overlap_run, phase):
    reducer, ranks = _ranks(overlap_run, "reducer"), _ranks(overlap_run, phase)
    for rank in ranks:  # both halved together and made their three steps (8 -> 4, then two micro-batches a batch)
        assert rank["micro"] == 4 and rank["step"] == 3
        assert rank["sizes"] == [8, 4, 4, 4, 4, 4, 4]
    _assert_same_weights(ranks[0]["weights"], ranks[1]["weights"])
    _assert_same_weights(ranks[0]["weights"], reducer[0]["weights"], exact=False)  # the whole batch's mean
    if phase == "backward":  # rank 1 had started buckets from its backward before it ran out of memory
        assert (ranks[0]["launched"], ranks[1]["launched"]) == (4, 1)  # rank 1: the head's bucket
    else:  # rank 0 learned of it at its window's point and started none
        assert ranks[0]["launched"] == ranks[1]["launched"] == 0


@pytest.mark.slow
def test_a_gradient_that_comes_in_after_its_bucket_started_is_averaged_too(overlap_run, tmp_path):
    ranks = _ranks(overlap_run, "reentrant")
    for rank in ranks:
        assert rank["late"] == 3  # every step: the shared layer's second gradient came after its all-reduce started
        assert rank["launched"] == 3 * 5  # the last bucket (the probe) starts after backward
    _assert_same_weights(ranks[0]["weights"], ranks[1]["weights"])
    reference = Reentrant(batch_size=16)  # one process, the global batch
    fit(tmp_path, reference, max_steps=3)
    _assert_same_weights(ranks[0]["weights"], reference.state_dict(), exact=False)


@pytest.mark.slow
def test_a_rank_whose_step_returns_none_still_takes_part_in_the_reduction(overlap_run):
    ranks = _ranks(overlap_run, "skip")
    for rank in ranks:  # no out-of-memory error: three whole batches
        assert rank["step"] == 3 and rank["micro"] == 8
    _assert_same_weights(ranks[0]["weights"], ranks[1]["weights"])
    # the first step's gradients: rank 0's halved (rank 1 had none), so the weights differ from the reducer run's
    reducer = _ranks(overlap_run, "reducer")
    assert not torch.equal(ranks[0]["weights"]["layer.weight"], reducer[0]["weights"]["layer.weight"])
    # rank 1 all-reduced its (absent) gradients after its step; rank 0 from backward, as in every later step
    assert (ranks[0]["launched"], ranks[1]["launched"]) == (3 * 4, 2 * 3)


@pytest.mark.slow
def test_with_lightnings_accumulation_the_stepping_batch_overlaps_and_equals_the_reducer_bitwise(overlap_run):
    _, overlap = _as_the_reducer(overlap_run, "overlap_accumulate", "reducer_accumulate")
    assert all(rank["step"] == 3 and rank["sizes"] == [8] * 6 for rank in overlap)  # 2 batches a step
    # only the batch that steps reduces: 3 of 6 batches, 4 buckets from backward on rank 0, 3 on rank 1
    assert (overlap[0]["launched"], overlap[1]["launched"]) == (3 * 4, 3 * 3)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sampler_lightning", "sampler_own"])
def test_a_token_budget_sampler_shares_every_epoch_in_equal_counts_within_the_budget(overlap_run, name):
    ranks = _ranks(overlap_run, name)
    # Lightning re-created the sampler made in its hook with its distributed sampler inside; the other kept its own
    assert ranks[0]["inner"] == ("DistributedSampler" if name == "sampler_lightning" else "_EpochRelay")
    for epoch in (0, 1):
        shares = [rank["seen"][epoch] for rank in ranks]
        assert len(shares[0]) == len(shares[1]) == ranks[0]["lengths"][epoch] == ranks[1]["lengths"][epoch]
        assert {i for share in shares for batch in share for i in batch} == set(range(N))
        extra = sum(len(batch) for share in shares for batch in share) - N
        assert 0 <= extra <= max(len(batch) for share in shares for batch in share)  # one batch filled up at most
        for share in shares:
            assert all(len(batch) * max(LENGTHS[i] for i in batch) <= 120 for batch in share)
    assert ranks[0]["seen"][0] != ranks[0]["seen"][1]  # the epoch reached the sampler: a new order
