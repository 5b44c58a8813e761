"""TokenBudgetBatchSampler: every sample once, every batch within its budget on every axis, equal batch counts on
every rank for every world size and epoch, resuming mid-epoch, and Lightning's single-process loop."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_memopt.data import TokenBudgetBatchSampler
from lightning_memopt.functional.batching import padded_tokens
from tests.helpers.lightning import pl
from tests.helpers.trainer import make_trainer


def _seq2seq_lengths(n: int = 400, seed: int = 0) -> list[tuple[int, int]]:
    """Long-tailed source lengths (median about 107, at most 512) and targets up to 96, drawn independently."""
    rng = random.Random(seed)
    return [(min(512, max(1, int(rng.lognormvariate(4.67, 0.7)))), rng.randint(1, 96)) for _ in range(n)]


def _assert_every_sample_once(batches, n):
    seen = sorted(i for batch in batches for i in batch)
    assert seen == list(range(n))


def test_every_sample_once_every_batch_within_the_budget_on_every_axis_little_padding():
    lengths = _seq2seq_lengths()
    sampler = TokenBudgetBatchSampler(lengths, max_tokens=(4096, 768), seed=3)
    batches = list(sampler)
    _assert_every_sample_once(batches, len(lengths))
    for batch in batches:
        for axis, limit in enumerate((4096, 768)):
            assert len(batch) * max(lengths[i][axis] for i in batch) <= limit
    real = sum(sum(lengths[i]) for i in range(len(lengths)))
    padded = sum(padded_tokens(batch, lengths) for batch in batches)
    fixed = sum(padded_tokens(list(range(k, min(k + 8, len(lengths)))), lengths) for k in range(0, len(lengths), 8))
    assert padded < fixed  # padding to the longest of a fixed batch of 8 in dataset order wastes more
    assert real / padded > 0.6


def test_a_budget_on_one_axis_of_two_is_refused_and_both_axes_bound_short_sources_with_long_targets():
    # the counter-example: many short sources with long targets; a source-only budget let 136 of them in one batch
    lengths = [(30, 94)] * 200 + [(512, 8)] * 20
    with pytest.raises(ValueError, match=r"`max_tokens` is 4096 but the samples have 2 length axes"):
        TokenBudgetBatchSampler(lengths, max_tokens=4096)
    batches = list(TokenBudgetBatchSampler(lengths, max_tokens=(4096, 768)))
    assert max(len(b) for b in batches) == 768 // 94  # the target axis bounds the short sources: 8, not 136


def test_a_table_and_a_function_as_the_budget():
    lengths = [64] * 10 + [100] * 10 + [500] * 3
    table = TokenBudgetBatchSampler(lengths, budget={64: 6, 128: 4, 512: 2}, shuffle=False)
    assert [len(b) for b in table] == [6, 4, 4, 4, 2, 2, 1]  # 4 of length 64 join the 100s: 4 fit at 128
    function = TokenBudgetBatchSampler(lengths, budget=lambda length: 1000 // length, shuffle=False)
    assert all(len(b) * max(lengths[i] for i in b) <= 1000 for b in function)
    pairs = TokenBudgetBatchSampler([(64, 8), (64, 90)], budget={(64, 16): 2, (64, 96): 1}, shuffle=False)
    assert list(pairs) == [[0], [1]]  # no entry covers both in one batch of two


def test_a_sample_no_batch_holds_is_named_at_construction():
    with pytest.raises(ValueError, match=r"Sample 2 has lengths \(513,\), which no batch of the budget table holds"):
        TokenBudgetBatchSampler([10, 20, 513], budget={512: 2})
    with pytest.raises(ValueError, match=r"Sample 0 has lengths \(9, 1\)"):
        TokenBudgetBatchSampler([(9, 1)], max_tokens=(8, 8))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of `max_tokens`"),
        ({"max_tokens": 8, "budget": {8: 1}}, "exactly one of `max_tokens`"),
        ({"budget": {}}, "empty table"),
        ({"budget": 3}, "must be a table"),
        ({"max_tokens": 0}, r"max_tokens\[0\]"),
        ({"max_tokens": 8, "num_replicas": 2, "rank": 2}, r"`rank` \(2\) must be below `num_replicas` \(2\)"),
        ({"max_tokens": 8, "seed": -1}, "seed"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        len(TokenBudgetBatchSampler([3, 4], **kwargs))


def test_bad_lengths_are_named():
    with pytest.raises(ValueError, match=r"`lengths\[1\]` is \(3,\): every sample needs 2 positive int"):
        TokenBudgetBatchSampler([(1, 2), (3,)], max_tokens=(8, 8))
    with pytest.raises(ValueError, match="`lengths` is empty"):
        TokenBudgetBatchSampler([], max_tokens=8)


@pytest.mark.parametrize("drop_last", [False, True])
def test_every_rank_gets_as_many_batches_for_every_world_size_and_epoch(drop_last):
    lengths = _seq2seq_lengths(203)
    for world in range(1, 9):
        for epoch in range(4):
            shares = []
            for rank in range(world):
                sampler = TokenBudgetBatchSampler(
                    lengths, max_tokens=(2048, 512), num_replicas=world, rank=rank, drop_last=drop_last
                )
                sampler.set_epoch(epoch)
                shares.append(list(sampler))
                assert len(sampler) == len(shares[-1])
            assert len({len(share) for share in shares}) == 1, (world, epoch)
            batches = sampler.batches()
            if drop_last:  # whole batches dropped, none repeated
                kept = [b for share in shares for b in share]
                assert len(kept) == len(batches) - len(batches) % world
            else:  # every sample at least once, the list filled up from its start
                covered = {i for share in shares for b in share for i in b}
                assert covered == set(range(len(lengths)))


def test_the_order_follows_the_seed_and_the_epoch():
    lengths = _seq2seq_lengths(100)
    a, b = (TokenBudgetBatchSampler(lengths, max_tokens=(1024, 256), seed=1) for _ in range(2))
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    fixed = TokenBudgetBatchSampler(lengths, max_tokens=(1024, 256), shuffle=False)
    fixed.set_epoch(5)
    assert list(fixed) == list(TokenBudgetBatchSampler(lengths, max_tokens=(1024, 256), shuffle=False))


def test_longest_first_puts_the_costliest_batch_first_on_every_rank():
    lengths = _seq2seq_lengths(300)
    world = 4
    costs = sorted(padded_tokens(b, lengths) for b in TokenBudgetBatchSampler(lengths, max_tokens=(2048, 512)))
    for rank in range(world):
        sampler = TokenBudgetBatchSampler(
            lengths, max_tokens=(2048, 512), longest_first=True, num_replicas=world, rank=rank
        )
        assert padded_tokens(next(iter(sampler)), lengths) >= costs[-world]


def test_a_sampler_that_loads_the_state_hands_out_the_rest_of_the_epoch():
    lengths = _seq2seq_lengths(150)
    sampler = TokenBudgetBatchSampler(lengths, max_tokens=(1024, 256), num_replicas=2, rank=1)
    sampler.set_epoch(2)
    it = iter(sampler)
    taken = [next(it) for _ in range(3)]
    rest = list(it)
    state = sampler.state_dict(batches_done=3)
    assert state == {"epoch": 2, "batches_done": 3, "seed": 0, "samples": 150}
    resumed = TokenBudgetBatchSampler(lengths, max_tokens=(1024, 256), num_replicas=2, rank=1)
    resumed.load_state_dict(state)
    assert list(resumed) == rest
    assert list(resumed) == taken + rest  # the next pass is the whole epoch again
    assert sampler.state_dict()["batches_done"] == len(taken) + len(rest)  # handed out, by default
    with pytest.raises(ValueError, match="of 150 samples with seed 0 cannot resume a sampler of 10 samples"):
        TokenBudgetBatchSampler(lengths[:10], max_tokens=(1024, 256)).load_state_dict(state)


class _Tokens(Dataset):
    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return torch.ones(self.lengths[i])


def _pad(samples):
    return torch.nn.utils.rnn.pad_sequence(samples, batch_first=True)


class _Model(pl.LightningModule):
    def __init__(self, lengths):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.lengths = lengths
        self.shapes: list[tuple[int, ...]] = []
        self.sampler = TokenBudgetBatchSampler(lengths, max_tokens=64)

    def training_step(self, batch, batch_idx):
        self.shapes.append(tuple(batch.shape))
        return self.layer(batch.unsqueeze(-1)).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(_Tokens(self.lengths), batch_sampler=self.sampler, collate_fn=_pad)


def test_a_lightning_fit_takes_its_batches_and_sets_its_epoch(tmp_path):
    lengths = [random.Random(i).randint(1, 32) for i in range(40)]
    model = _Model(lengths)
    trainer = make_trainer(tmp_path, max_epochs=2, limit_train_batches=None, limit_val_batches=0, max_steps=-1)
    trainer.fit(model)
    per_epoch = len(model.sampler)
    assert len(model.shapes) == 2 * per_epoch
    assert all(n * longest <= 64 for n, longest in model.shapes)
    assert model.sampler.epoch == 1  # Lightning called set_epoch


def test_several_axes_are_sorted_in_runs_so_every_axis_pads_little():
    lengths = _seq2seq_lengths(2000)  # targets drawn independently of the sources

    def padding(batches, axes):
        real = sum(lengths[i][k] for b in batches for i in b for k in axes)
        return 1 - real / sum(len(b) * max(lengths[i][k] for i in b) for b in batches for k in axes)

    grouped = list(TokenBudgetBatchSampler(lengths, max_tokens=(4096, 768)))
    first = list(TokenBudgetBatchSampler(lengths, max_tokens=(4096, 768), group_size=None))
    _assert_every_sample_once(grouped, len(lengths))
    assert len(grouped) < 0.9 * len(first)  # fewer, fuller batches
    assert padding(grouped, (0, 1)) < 0.7 * padding(first, (0, 1))  # less padding in all
    assert padding(first, (0,)) < padding(grouped, (0,)) < 0.08  # the first axis alone pads least sorted alone
