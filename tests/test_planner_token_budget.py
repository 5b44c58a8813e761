"""plan_token_budget and longest_input: per length bucket the largest batch whose estimated step fits (one more does
not), every axis bounded, estimates reused across buckets, the sampler's worst batch within the budget, and the
estimate equal to a real CPU step's peak."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from torch import nn

from lightning_memopt.data import TokenBudgetBatchSampler
from lightning_memopt.planner import estimate_memory
from lightning_memopt.planner.token_budget import length_buckets, longest_input, plan_token_budget
from tests.helpers.measured_step import measured_peak

VOCAB, WIDTH = 64, 16
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


class TinySeq2Seq(nn.Module):
    """An encoder-decoder over token ids: the loss grows with the source (attention) and the target (logits)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.encoder = nn.TransformerEncoderLayer(WIDTH, 2, 32, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoderLayer(WIDTH, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, source, target):
        memory = self.encoder(self.embed(source))
        logits = self.head(self.decoder(self.embed(target), memory))
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def seq2seq_batch(n, lengths):
    source, target = lengths
    return torch.zeros(n, source, dtype=torch.long), torch.ones(n, target, dtype=torch.long)


def _needed(model, n, lengths):
    return estimate_memory(model, seq2seq_batch(n, lengths), optimizer=ADAMW, device="cpu").peak_bytes


BUDGET = 6 * 2**20


@pytest.fixture(scope="module")
def plan():
    return plan_token_budget(
        TinySeq2Seq(), seq2seq_batch, buckets=[(16, 8), (16, 32), (64, 8), (64, 32)], budget=BUDGET, margin=0.1,
        device="cpu", optimizer=ADAMW,
    )  # fmt: skip


def test_each_bucket_gets_the_largest_batch_that_fits_and_one_more_does_not(plan):
    model = TinySeq2Seq()
    assert plan.usable_bytes == int(BUDGET * 0.9)
    for row in plan.rows:
        assert row.batch_size > 1
        assert _needed(model, row.batch_size, row.lengths) == row.needed_bytes <= plan.usable_bytes
        assert _needed(model, row.batch_size + 1, row.lengths) == row.next_needed_bytes > plan.usable_bytes
    table = plan.table
    # every axis bounds the batch: longer targets at the same source fit fewer samples, and so do longer sources
    assert table[(16, 8)] > table[(16, 32)] > table[(64, 32)] and table[(16, 8)] > table[(64, 8)] > table[(64, 32)]
    assert "largest batch" in str(plan).lower() and "16,32" in str(plan)


def test_buckets_reuse_what_earlier_buckets_found(plan):
    assert plan.estimates <= 4 * len(plan.rows)  # a blind binary search over 1..4096 takes 12 a bucket


def test_the_samplers_costliest_batch_fits_the_budget_by_the_estimate(plan):
    rng = random.Random(0)
    lengths = [(rng.randint(1, 64), rng.randint(1, 32)) for _ in range(300)]
    sampler = TokenBudgetBatchSampler(lengths, budget=plan.table)
    model = TinySeq2Seq()
    worst = max(
        _needed(model, len(batch), (max(lengths[i][0] for i in batch), max(lengths[i][1] for i in batch)))
        for batch in sorted(sampler, key=len)[-3:]
    )
    assert worst <= plan.usable_bytes


def test_the_estimate_of_each_buckets_batch_is_a_real_cpu_steps_peak(plan):
    model = TinySeq2Seq()
    for row in plan.rows:
        batch = seq2seq_batch(row.batch_size, row.lengths)
        real = measured_peak(model, batch, optimizers=lambda m: [ADAMW(m.parameters())], loss=lambda m, b, i: m(*b))
        assert row.needed_bytes == pytest.approx(real, rel=0.02), row
        assert real <= BUDGET


def test_buckets_from_the_lengths_of_the_data():
    lengths = [(s, t) for s in (10, 20, 30, 40) for t in (2, 4, 6, 8)]
    assert length_buckets(lengths, 4) == [(20, 4), (20, 8), (40, 4), (40, 8)]
    with pytest.raises(ValueError, match=r"`buckets=16` needs the dataset's `lengths`"):
        plan_token_budget(TinySeq2Seq(), seq2seq_batch, budget=BUDGET, device="cpu")


def test_a_bucket_where_not_even_one_sample_fits_is_left_out_of_the_table():
    plan = plan_token_budget(
        TinySeq2Seq(), seq2seq_batch, buckets=[(8, 4), (4096, 8)], budget=2**20, margin=0.0, device="cpu",
        optimizer=ADAMW, max_batch_size=4,
    )  # fmt: skip
    assert [row.batch_size for row in plan.rows][1] == 0 and (4096, 8) not in plan.table


def test_the_longest_input_that_fits_at_a_batch():
    model = nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB))

    def batch(n, length):
        return torch.zeros(n, length, dtype=torch.long)

    longest = longest_input(model, batch, 4, 4096, budget=2**20, margin=0.0, device="cpu", optimizer=ADAMW)
    need = functools.partial(estimate_memory, model, optimizer=ADAMW, device="cpu")
    assert need(batch(4, longest)).peak_bytes <= 2**20 < need(batch(4, longest + 1)).peak_bytes


def test_a_table_for_one_rank_of_a_model_sharded_with_fsdp2():
    model = nn.Sequential(nn.Embedding(VOCAB, 64), nn.Linear(64, 64), nn.Linear(64, VOCAB))

    def batch(n, length):
        return torch.zeros(n, length, dtype=torch.long)

    kwargs = {"buckets": [64], "budget": 4 * 2**20, "margin": 0.0, "device": "cpu", "optimizer": ADAMW}
    kwargs["loss_fn"] = lambda m, b: m(b).float().mean()
    whole = plan_token_budget(model, batch, **kwargs)
    sharded = plan_token_budget(model, batch, world_size=2, **kwargs)
    row = sharded.rows[0]
    per_rank = estimate_memory(model, batch(row.batch_size, 64), optimizer=ADAMW, device="cpu",
                               loss_fn=kwargs["loss_fn"], world_size=2)  # fmt: skip
    assert per_rank.world_size == 2 and per_rank.peak_bytes == row.needed_bytes <= 4 * 2**20
    assert sharded.table[64] >= whole.table[64]  # a rank holds half the weights and states: room for more samples
    with pytest.raises(ValueError, match=r"`devices=2` \(DDP\) and `world_size=2` \(FSDP2\) both given"):
        plan_token_budget(model, batch, devices=2, world_size=2, **kwargs)


def test_a_bucket_s_first_try_is_where_the_fitted_bytes_per_sample_meet_the_budget():
    from lightning_memopt.planner.token_budget import _guess

    def per_sample(key):  # affine in each length: what the fit recovers
        return 1000 + 10 * key[0] + 30 * key[1]

    seen = [(k, per_sample(k)) for k in [(16, 8), (16, 32), (64, 8)]]
    usable, intercept = 10**6, 2 * 10**5
    assert _guess((64, 32), seen, intercept, usable, (40, 24)) == (usable - intercept) // per_sample((64, 32))
    # fewer buckets than lengths + 1: the batch before scaled by the padded tokens
    assert _guess((64, 32), seen[:2], intercept, usable, (40, 24)) == 40 * 24 // 96
    assert _guess((16, 8), [], None, usable, None) == 1  # the first bucket
