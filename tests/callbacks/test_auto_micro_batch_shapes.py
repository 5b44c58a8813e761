"""AutoMicroBatch with batches of varying shapes: what fits is learned in tensor elements, not samples.

A small first batch pins nothing, a size that fitted short sequences is not reused for long ones (and grows back for
short ones), in training and in evaluation.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_memopt.callbacks.auto_micro_batch import AutoMicroBatch
from tests.helpers.lightning import pl
from tests.helpers.trainer import make_trainer


def _batch(samples, length, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(samples, length, generator=g), torch.randn(samples, generator=g)


class Lengths(pl.LightningModule):
    """Batches of given (samples, length); a step runs out of memory above ``budget`` input elements."""

    def __init__(self, shapes, budget=None):
        super().__init__()
        self.layer = nn.Linear(1, 1)
        self.batches = [_batch(n, length, i) for i, (n, length) in enumerate(shapes)]
        self.budget = budget
        self.sizes = []

    def _step(self, batch):
        x, y = batch
        self.sizes.append(x.shape[0])
        if self.budget is not None and x.numel() > self.budget:
            raise torch.OutOfMemoryError(f"simulated: {x.numel()} elements")
        return nn.functional.mse_loss(self.layer(x.mean(1, keepdim=True)).squeeze(1), y)

    def training_step(self, batch, batch_idx):
        return self._step(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._step(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def _loader(self):
        return DataLoader(self.batches, batch_size=None)

    def train_dataloader(self):
        return self._loader()

    def val_dataloader(self):
        return self._loader()


def _fit(tmp_path, model, callback):
    steps = len(model.batches)
    make_trainer(tmp_path, callbacks=[callback], max_steps=steps, limit_train_batches=None, limit_val_batches=0).fit(
        model
    )


def test_a_small_first_batch_pins_nothing(tmp_path):
    model, callback = Lengths([(1, 8), (12, 8), (12, 8)]), AutoMicroBatch()
    _fit(tmp_path, model, callback)
    assert model.sizes == [1, 12, 12] and callback.retries == 0  # was 1, then 1 x 12, 1 x 12


def test_a_size_that_fitted_short_sequences_is_not_reused_for_long_ones(tmp_path):
    # 64 input elements fit: 16 x 8 -> 8 x 8 fits (8 samples of 9 elements: 8 inputs and the target), then
    # length 32: 72 // 33 = 2 samples at once, no second out-of-memory error; length 4 grows back to 72 // 5 = 14
    model, callback = Lengths([(16, 8), (16, 32), (16, 4)], budget=64), AutoMicroBatch()
    _fit(tmp_path, model, callback)
    assert model.sizes == [16, 8, 8] + [2] * 8 + [14, 2]
    assert callback.retries == 1


def test_evaluation_learns_in_elements_too(tmp_path):
    model, callback = Lengths([(16, 8), (16, 32), (16, 4)], budget=64), AutoMicroBatch()
    make_trainer(tmp_path, callbacks=[callback], limit_val_batches=None).validate(model)
    assert model.sizes == [16, 8, 8] + [2] * 8 + [14, 2]
    assert callback.eval_micro_batch_sizes["validate"] == 8
