"""TokenBudgetBatchSampler with AutoMicroBatch: batches of very different shapes, a token-mean loss. The micro-batch
follows each batch's shape (learned in elements: one halving for the whole fit), and the token weights give the
whole batches' update."""

from __future__ import annotations

import random

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_memopt import AutoMicroBatch, TokenBudgetBatchSampler
from tests.helpers.lightning import pl
from tests.helpers.trainer import make_trainer

LENGTHS = [random.Random(i).choice([2, 3, 5, 30, 31, 60]) for i in range(96)]


class Tokens(Dataset):
    def __len__(self):
        return len(LENGTHS)

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(LENGTHS[i], 4, generator=g), torch.randn(LENGTHS[i], generator=g)


def pad(samples):
    xs, ys = zip(*samples)
    x = nn.utils.rnn.pad_sequence(list(xs), batch_first=True)
    y = nn.utils.rnn.pad_sequence(list(ys), batch_first=True, padding_value=float("nan"))
    return x, y


class TokenModel(pl.LightningModule):
    """A token-mean loss over the non-padded targets; a step runs out of memory above ``budget`` input elements."""

    def __init__(self, budget=None):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)
        self.budget = budget
        self.shapes = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.shapes.append(tuple(x.shape[:2]))
        if self.budget is not None and x.numel() > self.budget:
            raise torch.OutOfMemoryError(f"simulated: {x.numel()} elements")
        real = ~torch.isnan(y)
        return ((self.layer(x).squeeze(-1) - torch.nan_to_num(y)) ** 2)[real].mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        sampler = TokenBudgetBatchSampler(LENGTHS, max_tokens=240, shuffle=False)
        return DataLoader(Tokens(), batch_sampler=sampler, collate_fn=pad)


def tokens(batch):
    return (~torch.isnan(batch[1])).sum()


def _fit(tmp_path, model, callbacks):
    trainer = make_trainer(tmp_path, callbacks=callbacks, max_epochs=1, max_steps=-1, limit_train_batches=None)
    trainer.fit(model)
    return trainer


def test_the_micro_batch_follows_each_batchs_shape_and_token_weights_give_the_whole_batches_update(tmp_path):
    whole = TokenModel()
    _fit(tmp_path / "whole", whole, [])
    split, callback = TokenModel(budget=240), AutoMicroBatch(weight_fn=tokens)
    _fit(tmp_path / "split", split, [callback])
    # the sampler's batches hold up to 240 padded tokens (48 x 5 ... 4 x 60), 4 features a token: the first batch runs
    # out of memory twice (48 -> 24 -> 12 samples of 5); the size learned in elements then fits every later shape at
    # once (2 samples of 30, 1 of 31 or 60), and no other batch runs out of memory
    over = [shape for shape in split.shapes if shape[0] * shape[1] * 4 > 240]
    assert over == [(48, 5), (24, 5)] and callback.retries == 2
    assert {shape for shape in split.shapes[2:]} == {(12, 5), (2, 30), (1, 31), (1, 60)}
    for name, value in whole.state_dict().items():
        assert torch.allclose(value, split.state_dict()[name], atol=1e-6), name
