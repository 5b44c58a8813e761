"""Quickstart: a short training run with MemoryMonitor, CacheCleaner and GarbageCollector.

Trains a small MLP regressor for a few hundred steps (CPU or GPU), then prints the memory summary
that `lightning-memopt analyze` gives and where the JSONL log and the timeline plot are (the plot needs
matplotlib: `pip install 'lightning-memopt[plot]'`; without it the plot is skipped with a note).

    python examples/quickstart.py [--accelerator gpu] [--max_steps 300] [--root outputs/quickstart]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_memopt import CacheCleaner, GarbageCollector, MemoryMonitor
from lightning_memopt.analysis import analyze_memory_logs


class Regressor(pl.LightningModule):
    def __init__(self, width: int = 256, lr: float = 1e-3) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(32, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1)
        )
        self.lr = lr

    def _loss(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def make_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    w = torch.randn(32, 1, generator=g)
    return TensorDataset(x, torch.sin(x @ w) + 0.05 * torch.randn(n, 1, generator=g))


def _has_matplotlib() -> bool:
    """Whether the timeline plot can be drawn: matplotlib is an extra (``lightning-memopt[plot]``)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--max_steps", type=int, default=300)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--width", type=int, default=256, help="hidden width (4096 gives ~17M parameters)")
    parser.add_argument("--root", default="outputs/quickstart")
    args = parser.parse_args()

    pl.seed_everything(0, verbose=False)
    root = Path(args.root)
    monitor = MemoryMonitor(log_every_n_steps=10)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=args.max_steps,
        val_check_interval=min(100, args.max_steps),
        limit_val_batches=10,
        logger=CSVLogger(root),
        default_root_dir=str(root),
        enable_progress_bar=False,
        callbacks=[monitor, CacheCleaner(), GarbageCollector()],
    )
    train = DataLoader(make_data(args.max_steps * args.batch_size, 0), batch_size=args.batch_size, shuffle=True)
    val = DataLoader(make_data(10 * args.batch_size, 1), batch_size=args.batch_size)
    trainer.fit(Regressor(width=args.width), train, val)

    plot = None
    if _has_matplotlib():
        plot = monitor.path.with_suffix(".png")
    _, summary = analyze_memory_logs([monitor.path], plot=plot)
    print("\nMemory summary (lightning-memopt analyze):")
    print(summary)
    print(f"\nmemory log: {monitor.path}")
    if plot is None:
        print("timeline plot: skipped, matplotlib is not installed (pip install 'lightning-memopt[plot]')")
    else:
        print(f"timeline plot: {plot}")
    print(f"metrics (incl. memory/*): {Path(trainer.logger.log_dir) / 'metrics.csv'}")


if __name__ == "__main__":
    main()
