"""AutoMicroBatch on two DDP processes (gloo) with a DDP communication hook registered; rank 1 alone runs out of memory.

Usage: ``python amb_ddp_hooks.py`` in an empty directory (run by
``tests/callbacks/test_auto_micro_batch_ddp_hooks.py``). Each fit registers a counting hook on the DDP module in
``on_fit_start`` and writes ``<name>_rank<r>.pt`` (weights, hook calls, micro-batch size, retries, steps):

* ``ref_<hook>``: Lightning's own DDP accumulation, 4 micro-batches of 2 per step (``accumulate_grad_batches=4``);
* ``ours_none_<hook>``: AutoMicroBatch at micro-batches of 2 of a batch of 8, no out-of-memory error;
* ``ours_<phase>_<which>_<hook>``: AutoMicroBatch where rank 1 alone runs out of memory in ``phase`` (forward or
  backward) of the ``which`` (first or last) micro-batch of a batch while micro-batches hold more than 2 samples.

``<hook>`` is ``fp16`` (torch's ``fp16_compress_hook``) or ``powersgd`` (PowerSGD, compressing from its second
iteration, with error feedback: a hook whose state changes with every call). Lightning re-launches this file for
rank 1, so it must be a file of its own.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.utils.data import DataLoader, DistributedSampler

from lightning_memopt.callbacks.auto_micro_batch import AutoMicroBatch
from tests.helpers.amb import BackwardBudget, Data, Net, ddp_trainer
from tests.helpers.lightning import pl

BATCH, MICRO = 8, 2


def hook_of(kind: str, calls: list, trainer_of):
    """A comm hook that records ``(global step, bucket index, is last)`` and runs torch's hook of ``kind``."""
    state = None
    if kind == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, min_compression_rate=1.0
        )

    def counting_hook(state, bucket):
        calls.append((trainer_of().global_step, bucket.index(), bucket.is_last()))
        if kind == "powersgd":
            return powerSGD_hook.powerSGD_hook(state, bucket)
        return default_hooks.fp16_compress_hook(state, bucket)

    return state, counting_hook


class RankOneOOM(Net):
    """Rank 1 runs out of memory in ``phase`` of the first or last micro-batch of a batch larger than 2 samples."""

    def __init__(self, batch_size, hook, phase=None, which=None):
        super().__init__(optimizer="adamw", batch_size=batch_size)
        self.phase, self.which, self.hook = phase, which, hook
        self.calls: list = []
        self.hook_state = None

    def on_fit_start(self):
        self.hook_state, hook = hook_of(self.hook, self.calls, lambda: self.trainer)
        self.trainer.strategy.model.register_comm_hook(self.hook_state, hook)

    def _hit(self, idx, batch_idx) -> bool:
        # rank r holds samples r, r + 2, ... (DistributedSampler, no shuffle): batch b's first and last sample
        first = self.global_rank + 2 * BATCH * batch_idx
        target = first if self.which == "first" else first + 2 * (BATCH - 1)
        return self.global_rank == 1 and idx.shape[0] > MICRO and bool((idx == target).any())

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        self.seen_sizes.append(x.shape[0])
        hit = self.phase is not None and self._hit(idx, batch_idx)
        if hit and self.phase == "forward":
            raise torch.OutOfMemoryError(f"simulated: forward of {x.shape[0]} samples on rank 1")
        h = BackwardBudget.apply(self.layer(x), 0 if hit and self.phase == "backward" else None)
        out = self.head(torch.tanh(h)).squeeze(1)
        return torch.nn.functional.mse_loss(out, y) + self.probe[idx].mean()

    def train_dataloader(self):
        return DataLoader(Data(), batch_size=self.batch_size, sampler=DistributedSampler(Data(), shuffle=False))


def run(name, model, callbacks=(), accumulate=1):
    trainer = ddp_trainer(
        list(callbacks),
        strategy=pl.strategies.DDPStrategy(timeout=timedelta(seconds=300)),  # a hang ends as an error
        accumulate_grad_batches=accumulate,
    )
    trainer.fit(model)
    callback = next(iter(callbacks), None)
    torch.save(
        {
            "weights": model.state_dict(),
            "calls": model.calls,
            "micro": getattr(callback, "micro_batch_size", None),
            "retries": getattr(callback, "retries", 0),
            "step": trainer.global_step,
            "sizes": model.seen_sizes,
            # PowerSGD: the iterations it counted, the numbers it compressed and what it sent for them
            "powersgd": None
            if model.hook_state is None
            else (
                model.hook_state.iter,
                model.hook_state.total_numel_before_compression,
                model.hook_state.total_numel_after_compression,
            ),
        },
        f"{name}_rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    for hook in ("fp16", "powersgd"):
        run(f"ref_{hook}", RankOneOOM(MICRO, hook), accumulate=BATCH // MICRO)
        run(f"ours_none_{hook}", RankOneOOM(BATCH, hook), [AutoMicroBatch(micro_batch_size=MICRO)])
        cases = [("forward", "first"), ("forward", "last"), ("backward", "first"), ("backward", "last")]
        for phase, which in cases if hook == "fp16" else [("backward", "last")]:
            # starting at 4: the first and the last micro-batch of a batch differ ([0, 4) and [4, 8))
            model = RankOneOOM(BATCH, hook, phase, which)
            run(f"ours_{phase}_{which}_{hook}", model, [AutoMicroBatch(micro_batch_size=4)])
    # Lightning keeps the process group; one left to interpreter exit sometimes aborts there (gloo's threads)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # Every result is on disk: leave without the interpreter's teardown, where gloo's threads still abort now and
    # then ("terminate called without an active exception", seen once in 4 runs on a loaded 2-core machine).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
