"""AutoMicroBatch on two DDP processes (gloo) where only rank 1 has a memory budget, in forward, then in backward; each
fit's checkpoint (``forward.ckpt``, ``backward.ckpt``) is there for a one-process run to resume from. Then the same
with a collective inside the step (``self.log(..., sync_dist=True, on_step=True)``) that rank 1 never reaches: a fit
(``sync_log``) and a validation (``validate``). Run by tests/callbacks/test_auto_micro_batch_ddp.py."""

import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_memopt import MemoryMonitor
from lightning_memopt.callbacks.auto_micro_batch import AutoMicroBatch
from tests.helpers.amb import Data, Net, ddp_trainer
from tests.helpers.amb_eval import EvalNet


class RankBudget(Net):
    # only rank 1 has a memory budget

    def training_step(self, batch, batch_idx):
        if self.global_rank != 1:
            self.forward_budget = self.backward_budget = None
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        sampler = DistributedSampler(Data(), shuffle=False)
        return DataLoader(Data(), batch_size=self.batch_size, sampler=sampler)


class SyncLog(RankBudget):
    # rank 0 reaches a synced step log that rank 1, out of memory in forward, never reaches

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_step_loss", loss, on_step=True, on_epoch=False, sync_dist=True)
        return loss


def sync_runs():
    model, callback = SyncLog(optimizer="adamw", batch_size=8, forward_budget=2), AutoMicroBatch()
    trainer = ddp_trainer([callback])
    trainer.fit(model)
    rank = trainer.global_rank
    torch.save({"weights": model.state_dict(), "micro": callback.micro_batch_size}, f"sync_log_rank{rank}.pt")
    model, callback = EvalNet(eval_budget=4, sync_dist=True, budget_rank=1), AutoMicroBatch()
    trainer = ddp_trainer([callback], use_distributed_sampler=True, limit_val_batches=None)
    results = trainer.validate(model)
    saved = {"results": results, "micro": callback.eval_micro_batch_sizes, "sizes": model.step_sizes}
    torch.save(saved, f"validate_rank{rank}.pt")


if __name__ == "__main__":
    for where in ("forward", "backward"):
        budget = {"forward_budget": 2} if where == "forward" else {"backward_budget": 2}
        model = RankBudget(optimizer="adamw", batch_size=8, **budget)
        callback = AutoMicroBatch()
        trainer = ddp_trainer([callback, MemoryMonitor(dirpath=where, log_every_n_steps=1)])
        trainer.fit(model)
        trainer.save_checkpoint(f"{where}.ckpt")  # every rank calls it; rank 0 writes
        torch.save(
            {
                "weights": model.state_dict(),
                "micro": callback.micro_batch_size,
                "retries": callback.retries,
                "step": trainer.global_step,
                "sizes": model.seen_sizes,
            },
            f"{where}_rank{trainer.global_rank}.pt",
        )
    sync_runs()
    # Lightning keeps the process group; one left to interpreter exit sometimes aborts there (gloo's threads)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
