"""AutoMicroBatch under DDP on two processes (gloo) while batches run whole: the gradient all-reduces overlap the
backward (small buckets, so that several start inside it), and a rank that runs out of memory inside that backward
leaves no rank waiting. Run by tests/callbacks/test_auto_micro_batch_ddp_overlap.py.

Each run writes ``<name>_rank<r>.pt`` (weights, which gradients existed at each optimizer step, buckets all-reduced
from backward, micro-batch sizes):

* ``reducer``: Lightning's DDP without the callback (DDP's reducer), ``find_unused_parameters=True``;
* ``overlap``: the same with ``AutoMicroBatch()``, nothing out of memory;
* ``backward``: rank 1 alone runs out of memory in the first batch's backward, after the gradients of the last layers
  came in (their buckets' all-reduces started); a synced log in ``on_after_backward``;
* ``forward``: rank 1 alone runs out of memory in the first batch's forward, after rank 0 reached its backward;
* ``reducer_accumulate`` / ``overlap_accumulate``: both with Lightning's ``accumulate_grad_batches=2``;
* ``sampler_lightning`` / ``sampler_own``: two epochs of batches from a ``TokenBudgetBatchSampler`` (ranks hold
  batches of different sizes), with ``AutoMicroBatch()``: made in ``train_dataloader`` with Lightning's
  ``use_distributed_sampler=True`` (Lightning re-creates it with its distributed sampler, whose rank and epoch it
  takes) and made before the fit with ``use_distributed_sampler=False`` (rank from the process group); each writes
  its batches' sample indices per epoch and the length it reported;
* ``skip``: rank 1's ``training_step`` returns ``None`` in the first batch (no backward there), rank 0's does not;
* ``reentrant``: a layer whose gradient comes in twice per backward (two reentrant checkpoints), nothing out of memory.
"""

from __future__ import annotations

import os
import random
import sys
from datetime import timedelta

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_memopt.callbacks.auto_micro_batch import AutoMicroBatch
from lightning_memopt.data import TokenBudgetBatchSampler
from tests.helpers.amb import BackwardBudget, Data, Net, ddp_trainer
from tests.helpers.lightning import pl

BATCH = 8
#: 16-byte buckets: the probe, the head, the first layer's bias and its weight each all-reduce on their own
BUCKET_MB = 16 / 2**20


class Overlapped(Net):
    """``Net`` with a parameter no rank uses and one only rank 0 uses; rank 1 may run out of memory in the first
    batch (``phase``); ``on_after_backward`` logs with ``sync_dist=True``."""

    def __init__(self, phase: str | None = None) -> None:
        super().__init__(optimizer="adamw", batch_size=BATCH)
        self.unused = nn.Parameter(torch.ones(3))
        self.rank0_only = nn.Parameter(torch.ones(2))
        self.phase = phase
        self.has_grad: list[list[bool]] = []
        self.launched = 0

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.seen_sizes.append(x.shape[0])
        hit = self.phase is not None and self.global_rank == 1 and batch_idx == 0 and x.shape[0] > BATCH // 2
        if hit and self.phase == "skip":
            return None  # no backward on rank 1: its window opens and closes all the same
        if hit and self.phase == "forward":
            raise torch.OutOfMemoryError(f"simulated: forward of {x.shape[0]} samples on rank 1")
        h = BackwardBudget.apply(self.layer(x), BATCH // 2 if hit else None)
        out = self.head(torch.tanh(h)).squeeze(1)
        loss = nn.functional.mse_loss(out, y) + self.probe[idx].mean()
        if self.global_rank == 0:
            loss = loss + self.rank0_only.sum()
        return loss

    def on_after_backward(self):
        if self.phase == "skip":  # rank 1 runs no backward in the first batch: a synced log there would wait for it
            return
        self.log("after_backward", torch.tensor(1.0), on_step=True, on_epoch=False, sync_dist=True)

    def on_before_optimizer_step(self, optimizer):
        self.has_grad.append([p.grad is not None for p in self.parameters()])

    def on_train_end(self):  # before AutoMicroBatch gives the Trainer's loop back
        overlap = getattr(self.trainer.fit_loop.epoch_loop.automatic_optimization, "overlap", None)
        self.launched = 0 if overlap is None else overlap.launched_in_backward

    def train_dataloader(self):
        return DataLoader(Data(), batch_size=self.batch_size, sampler=DistributedSampler(Data(), shuffle=False))


class Reentrant(Net):
    """A layer used twice, each time inside a reentrant checkpoint: its gradient comes in twice per backward, the
    second time after its bucket's all-reduce started."""

    def __init__(self, batch_size: int = BATCH) -> None:
        super().__init__(optimizer="adamw", batch_size=batch_size)
        self.shared = nn.Linear(4, 4)
        self.has_grad: list[list[bool]] = []
        self.launched = self.late = 0

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        h = torch.utils.checkpoint.checkpoint(self.shared, x.requires_grad_(), use_reentrant=True)
        h = torch.utils.checkpoint.checkpoint(self.shared, torch.tanh(h), use_reentrant=True)
        out = self.head(torch.tanh(self.layer(h))).squeeze(1)
        return nn.functional.mse_loss(out, y) + self.probe[idx].mean()

    def on_train_end(self):
        overlap = getattr(self.trainer.fit_loop.epoch_loop.automatic_optimization, "overlap", None)
        if overlap is not None:
            self.launched, self.late = overlap.launched_in_backward, overlap.late_windows

    def train_dataloader(self):
        if self.trainer.world_size == 1:
            return DataLoader(Data(), batch_size=self.batch_size)
        return DataLoader(Data(), batch_size=self.batch_size, sampler=DistributedSampler(Data(), shuffle=False))


def run(name: str, model: Overlapped | Reentrant, callbacks: list, accumulate: int = 1) -> None:
    strategy = pl.strategies.DDPStrategy(
        timeout=timedelta(seconds=300), bucket_cap_mb=BUCKET_MB, find_unused_parameters=True
    )  # a hang ends as an error
    trainer = ddp_trainer(callbacks, strategy=strategy, accumulate_grad_batches=accumulate)
    trainer.fit(model)
    callback = next(iter(callbacks), None)
    saved = {
        "weights": model.state_dict(),
        "has_grad": model.has_grad,
        "launched": model.launched,
        "late": getattr(model, "late", None),
        "sizes": model.seen_sizes,
        "micro": getattr(callback, "micro_batch_size", None),
        "step": trainer.global_step,
    }
    torch.save(saved, f"{name}_rank{trainer.global_rank}.pt")


N = 101
LENGTHS = [random.Random(i).randint(1, 40) for i in range(N)]


class Tokens(Dataset):
    """Samples of 1 to 40 tokens and their index."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.ones(LENGTHS[i]), i


def collate(samples):
    tokens = torch.nn.utils.rnn.pad_sequence([t for t, _ in samples], batch_first=True)
    return tokens, torch.tensor([i for _, i in samples])


class SamplerModel(pl.LightningModule):
    """Batches from a TokenBudgetBatchSampler: made in `train_dataloader` (`in_hook`) or before the fit."""

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


def run_sampler(name: str, in_hook: bool) -> None:
    model = SamplerModel(in_hook)
    trainer = ddp_trainer(
        [AutoMicroBatch()],
        strategy=pl.strategies.DDPStrategy(timeout=timedelta(seconds=300)),  # a hang ends as an error
        max_epochs=2,
        max_steps=-1,
        use_distributed_sampler=in_hook,
    )
    trainer.fit(model)
    saved = {"seen": model.seen, "lengths": model.lengths, "inner": model.inner}
    torch.save(saved, f"{name}_rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    run("reducer", Overlapped(), [])
    run("overlap", Overlapped(), [AutoMicroBatch()])
    for phase in ("backward", "forward", "skip"):
        run(phase, Overlapped(phase), [AutoMicroBatch()])
    run("reentrant", Reentrant(), [AutoMicroBatch()])
    run("reducer_accumulate", Overlapped(), [], accumulate=2)
    run("overlap_accumulate", Overlapped(), [AutoMicroBatch()], accumulate=2)
    run_sampler("sampler_lightning", in_hook=True)
    run_sampler("sampler_own", in_hook=False)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # every result is on disk (gloo's threads sometimes abort in the interpreter's teardown)
