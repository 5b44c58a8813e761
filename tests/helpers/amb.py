"""AutoMicroBatch test stand-ins: a model with a simulated memory budget, its data, and a short fit."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tests.helpers.lightning import pl
from tests.helpers.trainer import make_trainer

__all__ = ["N_SAMPLES", "BackwardBudget", "Data", "Net", "ddp_trainer", "fit", "weights"]

N_SAMPLES = 64


class BackwardBudget(torch.autograd.Function):
    """Identity whose backward runs out of memory when it sees more than ``limit`` samples."""

    @staticmethod
    def forward(ctx, x, limit):
        ctx.n, ctx.limit = x.shape[0], limit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.limit is not None and ctx.n > ctx.limit:
            raise torch.OutOfMemoryError(f"simulated: backward of {ctx.n} samples, budget {ctx.limit}")
        return grad, None


class Data(Dataset):
    def __init__(self, kind="tuple"):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(N_SAMPLES, 4, generator=g), torch.randn(N_SAMPLES, generator=g)
        self.kind = kind

    def __len__(self):
        return N_SAMPLES

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


class Net(pl.LightningModule):
    """A linear model plus a per-sample probe: ``probe.grad[i] * N * accumulate`` counts how often sample i was used."""

    def __init__(
        self,
        forward_budget=None,
        backward_budget=None,
        optimizer="sgd",
        batch_size=16,
        accumulate=1,
        budget_from_batch=0,
    ):
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 3)
        self.head = nn.Linear(3, 1)
        self.probe = nn.Parameter(torch.zeros(N_SAMPLES))
        self.forward_budget, self.backward_budget = forward_budget, backward_budget
        self.budget_from_batch = budget_from_batch
        self.optimizer, self.batch_size, self.accumulate = optimizer, batch_size, accumulate
        self.seen_sizes: list[int] = []
        self.counts: list[torch.Tensor] = []

    def unpack(self, batch):
        return batch

    def training_step(self, batch, batch_idx):
        x, y, idx = self.unpack(batch)
        self.seen_sizes.append(x.shape[0])
        active = batch_idx >= self.budget_from_batch
        if active and self.forward_budget is not None and x.shape[0] > self.forward_budget:
            raise torch.OutOfMemoryError(f"simulated: forward of {x.shape[0]} samples")
        h = BackwardBudget.apply(self.layer(x), self.backward_budget if active else None)
        out = self.head(torch.tanh(h)).squeeze(1)
        loss = nn.functional.mse_loss(out, y) + self.probe[idx].mean()
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.counts.append(self.probe.grad.detach().clone())

    def configure_optimizers(self):
        if self.optimizer == "adamw":
            opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(Data(), batch_size=self.batch_size, shuffle=False)


def weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fit(tmp_path, model, callbacks=(), accumulate=1, max_steps=4, **kwargs):
    trainer = make_trainer(
        tmp_path,
        callbacks=list(callbacks),
        accumulate_grad_batches=accumulate,
        max_steps=max_steps,
        limit_train_batches=None,
        limit_val_batches=0,
        **kwargs,
    )
    trainer.fit(model)
    return trainer


def ddp_trainer(callbacks: list, strategy: Any = "ddp", **kwargs: Any) -> pl.Trainer:
    """The 2-process CPU DDP Trainer of the worker scripts: 3 steps, the script's own sampler, nothing written."""
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 2,
        "strategy": strategy,
        "max_steps": 3,
        "use_distributed_sampler": False,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
        "default_root_dir": ".",
    }
    return pl.Trainer(**{**defaults, **kwargs}, callbacks=callbacks)
