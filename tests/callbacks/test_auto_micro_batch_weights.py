"""AutoMicroBatch with a loss that is a mean over tokens, not samples (the Hugging Face default): ``weight_fn``.

Split by samples, each micro-batch's token mean counts as its share of samples and the update is off the whole
batch's; weighted by tokens (``weight_fn`` counting the batch's non-padded tokens), it is the whole batch's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt.callbacks.auto_micro_batch import AutoMicroBatch
from tests.helpers.lightning import pl
from tests.helpers.trainer import make_trainer

N, LENGTH = 32, 12


def tokens(batch):
    return batch[2].sum()  # the non-padded positions


class TokenMean(pl.LightningModule):
    """A per-token regression whose loss is the mean over non-padded tokens; lengths 1..12, long and short mixed."""

    def __init__(self, budget=None, empty=False):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)
        self.budget = budget
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(1, LENGTH + 1, (N,), generator=g)
        mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).float()
        if empty:  # samples 4-7 are all padding: their micro-batch's token mean is 0 / 0
            mask[4:8] = 0.0
        self.data = TensorDataset(torch.randn(N, LENGTH, 4, generator=g), torch.randn(N, LENGTH, generator=g), mask)
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y, mask = batch
        if self.budget is not None and x.shape[0] > self.budget:
            raise torch.OutOfMemoryError("simulated")
        err = (self.layer(x).squeeze(-1) - y) ** 2
        return (err * mask).sum() / mask.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=16)


def _weights(tmp_path, callbacks=(), budget=None, empty=False):
    model = TokenMean(budget, empty)
    make_trainer(tmp_path, callbacks=list(callbacks), max_steps=2, limit_train_batches=None).fit(model)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_a_token_mean_loss_split_with_token_weights_gives_the_whole_batch_update(tmp_path):
    whole = _weights(tmp_path / "whole")
    by_tokens = _weights(tmp_path / "tokens", [AutoMicroBatch(weight_fn=tokens)], budget=4)
    by_samples = _weights(tmp_path / "samples", [AutoMicroBatch()], budget=4)
    assert torch.allclose(by_tokens, whole, atol=1e-6, rtol=0)
    assert not torch.allclose(by_samples, whole, atol=1e-4, rtol=0)  # the silent error weight_fn removes


def test_a_micro_batch_with_no_tokens_runs_no_backward_and_bad_weights_are_refused(tmp_path):
    whole = _weights(tmp_path / "whole", empty=True)
    split = _weights(tmp_path / "split", [AutoMicroBatch(weight_fn=tokens)], budget=4, empty=True)
    assert torch.isfinite(split).all() and torch.allclose(split, whole, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"`weight_fn` must return a non-negative, finite number .* got -1"):
        _weights(tmp_path / "bad", [AutoMicroBatch(weight_fn=lambda b: -1)])
    with pytest.raises(ValueError, match="`weight_fn` must be a function or None"):
        AutoMicroBatch(weight_fn=3)
