"""The project's classes and its CLI (see the package docstring)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt import MemoryPresetCLI
from tests.helpers.lightning import lightning_module, pl

__all__ = ["CONFIG", "CONFIG_FIXED", "ZooBlock", "ZooCLI", "ZooClassifier", "ZooDataModule", "main"]

#: The config in the ``class_path`` style (the CLI in subclass mode).
CONFIG = Path(__file__).with_name("config.yaml")
#: The config for a CLI given the classes (``model:`` and ``data:`` hold init args only).
CONFIG_FIXED = Path(__file__).with_name("config_fixed.yaml")


class ZooBlock(nn.Module):
    """A residual MLP block with dropout (what ``memory.checkpoint_modules`` names)."""

    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(F.gelu(self.linear(x)))


class ZooClassifier(pl.LightningModule):
    """An MLP classifier: ``depth`` :class:`ZooBlock` s, dropout, AdamW with weight decay."""

    def __init__(
        self,
        features: int = 16,
        hidden: int = 32,
        depth: int = 2,
        classes: int = 4,
        dropout: float = 0.1,
        lr: float = 1e-2,
        weight_decay: float = 0.01,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.stem = nn.Linear(features, hidden)
        self.blocks = nn.Sequential(*(ZooBlock(hidden, dropout) for _ in range(depth)))
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, batch_size=len(x))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


class ZooDataModule(pl.LightningDataModule):
    """``samples`` seeded random samples in a fixed order; the DataLoader batch is ``batch_size``."""

    def __init__(self, batch_size: int = 8, samples: int = 32, features: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size
        generator = torch.Generator().manual_seed(0)
        self.dataset = TensorDataset(
            torch.randn(samples, features, generator=generator),
            torch.randint(0, classes, (samples,), generator=generator),
        )

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.batch_size, shuffle=False)


def _cli_class() -> Any:
    class ZooCLI(MemoryPresetCLI, lightning_module("cli").LightningCLI):
        """The project's CLI: LightningCLI with a ``memory:`` section."""

    return ZooCLI


#: ``class ZooCLI(MemoryPresetCLI, LightningCLI)`` in the namespace the tests run against.
ZooCLI = _cli_class()


def main(
    args: list[str] | None = None, *, subclass_mode: bool = True, run: bool = True, cli: Any = None, **kwargs: Any
) -> Any:
    """The project's entry point: ``cli`` (default ``ZooCLI``) over the classes by ``class_path``, or given to it
    (``subclass_mode=False``)."""
    cli = cli or ZooCLI
    if subclass_mode:
        return cli(
            pl.LightningModule,
            pl.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=args,
            run=run,
            **kwargs,
        )
    return cli(ZooClassifier, ZooDataModule, args=args, run=run, **kwargs)
