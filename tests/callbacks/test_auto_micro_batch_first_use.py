"""AutoMicroBatch when a failed attempt materialised a lazy module (its initialisation drew random numbers between
dropout draws): the reference is Lightning's own ``accumulate_grad_batches`` at the micro-batch that fits, weights and
buffers bitwise equal. (A BatchNorm first used by a retried batch: tests/functional/test_micro_batch_restore.py.)
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt.callbacks.auto_micro_batch import AutoMicroBatch
from tests.helpers.lightning import pl
from tests.helpers.trainer import make_trainer

N = 64


class FirstUse(pl.LightningModule):
    """Dropout, then a lazy layer (materialised by the first forward), a BatchNorm from batch ``bn_from`` on.

    Runs out of memory in forward above ``budget`` samples on batch ``oom_at``.
    """

    def __init__(self, batch_size, budget=None, oom_at=0, bn_from=0):
        super().__init__()
        torch.manual_seed(0)
        self.drop = nn.Dropout(0.5)
        self.lazy = nn.LazyLinear(3)
        self.bn = nn.BatchNorm1d(3)
        self.head = nn.Linear(3, 1)
        self.batch_size, self.budget, self.oom_at, self.bn_from = batch_size, budget, oom_at, bn_from
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.randn(N, 4, generator=g), torch.randn(N, generator=g))

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.lazy(self.drop(x))  # random numbers drawn before the lazy layer's initialisation
        if batch_idx >= self.bn_from:
            h = self.bn(h)
        if self.budget is not None and batch_idx == self.oom_at and x.shape[0] > self.budget:
            raise torch.OutOfMemoryError("simulated")
        return nn.functional.mse_loss(self.head(self.drop(h)).squeeze(1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _fit(tmp_path, model, callbacks=(), accumulate=1, steps=4):
    make_trainer(
        tmp_path,
        callbacks=list(callbacks),
        accumulate_grad_batches=accumulate,
        max_steps=steps,
        limit_train_batches=None,
    ).fit(model)
    return _state(model)


def _assert_equal(got, expected):
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value), (key, (got[key].float() - value.float()).abs().max())


def test_a_lazy_module_materialised_by_a_failed_attempt_draws_nothing_twice(tmp_path):
    split = _fit(tmp_path / "split", FirstUse(16, budget=4), [AutoMicroBatch()])
    reference = _fit(tmp_path / "ref", FirstUse(4), accumulate=4, steps=4)
    _assert_equal(split, reference)
