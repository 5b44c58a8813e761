"""AutoMicroBatch evaluation stand-ins: a model whose evaluation steps run out of memory above a budget of samples,
after they logged and updated a metric (so that a failed micro-batch leaves something to put back)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader
from torchmetrics import MeanSquaredError

from tests.helpers.amb import Data
from tests.helpers.lightning import pl

__all__ = ["EvalNet"]


class EvalNet(pl.LightningModule):
    """A linear model; ``eval_budget`` caps the samples of an evaluation step, checked after its logs and updates.

    Records what the hooks see: ``ends[stage]`` the ``(batch_idx, outputs)`` of each ``on_*_batch_end`` call, and
    ``step_sizes`` the samples of each step call.
    """

    def __init__(self, eval_budget=None, batch_size=16, eval_batch_size=16, sync_dist=False, budget_rank=None):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)
        self.dropout = nn.Dropout(0.5)
        self.mse = MeanSquaredError()
        self.eval_budget, self.batch_size, self.eval_batch_size = eval_budget, batch_size, eval_batch_size
        self.sync_dist, self.budget_rank = sync_dist, budget_rank
        self.ends: dict[str, list] = {"validate": [], "test": [], "predict": []}
        self.step_sizes: list[int] = []

    def _over_budget(self, n):
        applies = self.budget_rank is None or self.global_rank == self.budget_rank
        if applies and self.eval_budget is not None and n > self.eval_budget:
            raise torch.OutOfMemoryError(f"simulated: evaluation of {n} samples, budget {self.eval_budget}")

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        loss = nn.functional.mse_loss(self.layer(x).squeeze(1), y)
        self.log("train_loss", loss, sync_dist=self.sync_dist)
        return loss

    def _eval_step(self, batch, prefix):
        x, y, idx = batch
        self.step_sizes.append(x.shape[0])
        out = self.layer(x).squeeze(1)
        loss = nn.functional.mse_loss(out, y)
        self.log(f"{prefix}_loss", loss, on_step=False, on_epoch=True, sync_dist=self.sync_dist)
        if self.sync_dist:  # a collective inside the step, before the point where memory runs out
            self.log(f"{prefix}_step_loss", loss, on_step=True, on_epoch=False, sync_dist=True)
        self.mse.update(out, y)
        self.log(f"{prefix}_mse", self.mse, on_step=False, on_epoch=True)
        self._over_budget(x.shape[0])
        return {"loss": loss, "preds": out, "idx": idx, "correct": int((out - y).abs().lt(1.0).sum())}

    def validation_step(self, batch, batch_idx):
        return self._eval_step(batch, "val")

    def test_step(self, batch, batch_idx):
        return self._eval_step(batch, "test")

    def predict_step(self, batch, batch_idx):
        x, _, idx = batch
        self.step_sizes.append(x.shape[0])
        out = self.dropout(self.layer(x)).squeeze(1) + torch.rand(x.shape[0])  # random numbers drawn per sample
        self._over_budget(x.shape[0])
        return {"preds": out, "idx": idx}

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.ends["validate"].append((batch_idx, outputs))

    def on_test_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.ends["test"].append((batch_idx, outputs))

    def on_predict_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self.ends["predict"].append((batch_idx, outputs))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        return DataLoader(Data(), batch_size=self.batch_size)

    def _eval_loader(self):
        return DataLoader(Data(), batch_size=self.eval_batch_size)

    def val_dataloader(self):
        return self._eval_loader()

    def test_dataloader(self):
        return self._eval_loader()

    def predict_dataloader(self):
        return self._eval_loader()
