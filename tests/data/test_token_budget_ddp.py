"""TokenBudgetBatchSampler in a 2-process DDP fit (gloo): both ways Lightning can meet it, no hang, equal batch
counts, every sample on some rank each epoch, a new order each epoch. Reads one run of
``tests/scripts/token_budget_ddp.py``."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.subprocess_run import run_script_once
from tests.scripts.token_budget_ddp import LENGTHS, N


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return run_script_once(tmp_path_factory, "token_budget_ddp.py")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lightning", "own"])
def test_two_ranks_share_every_epoch_in_equal_counts_within_the_budget(ddp_run, name):
    ranks = [torch.load(ddp_run / f"{name}_rank{r}.pt", weights_only=False) for r in (0, 1)]
    # Lightning re-created the sampler made in its hook with its distributed sampler inside; the other kept its own
    assert ranks[0]["inner"] == ("DistributedSampler" if name == "lightning" else "_EpochRelay")
    for epoch in (0, 1):
        shares = [rank["seen"][epoch] for rank in ranks]
        assert len(shares[0]) == len(shares[1]) == ranks[0]["lengths"][epoch] == ranks[1]["lengths"][epoch]
        assert {i for share in shares for batch in share for i in batch} == set(range(N))
        extra = sum(len(batch) for share in shares for batch in share) - N
        assert 0 <= extra <= max(len(batch) for share in shares for batch in share)  # one batch filled up at most
        for share in shares:
            assert all(len(batch) * max(LENGTHS[i] for i in batch) <= 120 for batch in share)
    assert ranks[0]["seen"][0] != ranks[0]["seen"][1]  # the epoch reached the sampler: a new order
