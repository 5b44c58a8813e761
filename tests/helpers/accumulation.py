"""A small regression model, its data and a plain-torch reference for the accumulation tests (one process or DDP)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers.lightning import pl

N_FEATURES = 6


def data(n):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, N_FEATURES, generator=g), torch.randn(n, 1, generator=g)


class Regression(pl.LightningModule):
    def __init__(self, batch_size, n):
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(N_FEATURES, 8), nn.Tanh(), nn.Linear(8, 1))
        self.batch_size, self.n = batch_size, n

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(*data(self.n)), batch_size=self.batch_size, shuffle=False)


class GradRecorder(pl.Callback):
    def __init__(self):
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append([p.grad.detach().clone() for p in pl_module.parameters()])


def reference(windows, n):
    """Plain torch: one SGD step per window (list of sample counts) on the mean loss of the window.

    Windows run through the ``n`` samples in order, epoch after epoch when they add up to more than ``n``.
    """
    model = Regression(1, n).net
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data(n)
    epochs = -(-sum(windows) // n)
    x, y = x.repeat(epochs, 1), y.repeat(epochs, 1)
    grads, start = [], 0
    for size in windows:
        opt.zero_grad()
        nn.functional.mse_loss(model(x[start : start + size]), y[start : start + size]).backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
        start += size
    return grads, [p.detach().clone() for p in model.parameters()]


def close(a, b):
    return all(torch.allclose(x, y, atol=1e-6, rtol=0) for x, y in zip(a, b))
