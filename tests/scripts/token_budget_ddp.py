"""TokenBudgetBatchSampler in a 2-process DDP fit (gloo), two epochs: made in ``train_dataloader`` with Lightning's
``use_distributed_sampler=True`` (Lightning re-creates it with its distributed sampler, whose rank and epoch it takes),
and made before the fit with ``use_distributed_sampler=False`` (rank from the process group, epoch through
``set_epoch``). Each rank writes ``<name>_rank<r>.pt``: the sample indices of its batches per epoch and the length it
reported. Run by tests/data/test_token_budget_ddp.py."""

from __future__ import annotations

import os
import random
import sys
from datetime import timedelta

import torch
from torch.utils.data import DataLoader, Dataset

from lightning_memopt.data import TokenBudgetBatchSampler
from tests.helpers.lightning import pl

N = 101
LENGTHS = [random.Random(i).randint(1, 40) for i in range(N)]


class Tokens(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.ones(LENGTHS[i]), i


def collate(samples):
    tokens = torch.nn.utils.rnn.pad_sequence([t for t, _ in samples], batch_first=True)
    return tokens, torch.tensor([i for _, i in samples])


class Model(pl.LightningModule):
    def __init__(self, in_hook: bool) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.in_hook = in_hook
        self.sampler = None if in_hook else TokenBudgetBatchSampler(LENGTHS, max_tokens=120)
        self.seen: dict[int, list[list[int]]] = {}
        self.lengths: dict[int, int] = {}
        self.inner = ""

    def training_step(self, batch, batch_idx):
        tokens, idx = batch
        self.seen.setdefault(self.current_epoch, []).append(idx.tolist())
        return self.layer(tokens.unsqueeze(-1)).mean()

    def on_train_epoch_start(self):
        self.lengths[self.current_epoch] = len(self.trainer.train_dataloader)
        self.inner = type(self.trainer.train_dataloader.batch_sampler.sampler).__name__

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        sampler = TokenBudgetBatchSampler(LENGTHS, max_tokens=120) if self.in_hook else self.sampler
        return DataLoader(Tokens(), batch_sampler=sampler, collate_fn=collate)


def run(name: str, in_hook: bool) -> None:
    model = Model(in_hook)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=pl.strategies.DDPStrategy(timeout=timedelta(seconds=60)),  # a hang ends as an error
        max_epochs=2,
        use_distributed_sampler=in_hook,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        default_root_dir=".",
    )
    trainer.fit(model)
    saved = {"seen": model.seen, "lengths": model.lengths, "inner": model.inner}
    torch.save(saved, f"{name}_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    run("lightning", in_hook=True)
    run("own", in_hook=False)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # every result is on disk (gloo's threads sometimes abort in the interpreter's teardown)
