"""Tiny models and data for callback tests (BoringModel-style)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tests.helpers.lightning import pl


class RandomDataset(Dataset):
    def __init__(self, size: int = 32, length: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randn(length, size, generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, idx: int) -> torch.Tensor:
        return self.data[idx]


class TinyModel(pl.LightningModule):
    """A linear layer on random data; every phase has a loop and a dataloader."""

    def __init__(self, in_features: int = 32, batch_size: int = 4, length: int = 64) -> None:
        super().__init__()
        self.layer = nn.Linear(in_features, 2)
        self.in_features = in_features
        self.batch_size = batch_size
        self.length = length

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        return self(batch).pow(2).mean()

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        return {"loss": loss}

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), batch_size=len(batch))

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch), batch_size=len(batch))

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self(batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def _loader(self) -> DataLoader:
        return DataLoader(RandomDataset(self.in_features, self.length), batch_size=self.batch_size)

    def train_dataloader(self):
        return self._loader()

    def val_dataloader(self):
        return self._loader()

    def test_dataloader(self):
        return self._loader()

    def predict_dataloader(self):
        return self._loader()


def linear_module_class(namespace):
    """A one-layer LightningModule class of ``namespace`` (``lightning.pytorch`` or ``pytorch_lightning``): 8 random
    samples of 4 features in batches of 4, SGD; its step's loss stays float32 under any autocast."""

    class LinearModule(namespace.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch).float().pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(torch.randn(8, 4), batch_size=4)

    return LinearModule


def fit_linear_module(namespace, root, **trainer_kwargs):
    """Fit :func:`linear_module_class` of ``namespace`` for 2 steps on the CPU with a quiet Trainer of that namespace
    (``trainer_kwargs``: ``plugins=...``, ...); the Trainer."""
    trainer = namespace.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
        **trainer_kwargs,
    )
    trainer.fit(linear_module_class(namespace)())
    return trainer
