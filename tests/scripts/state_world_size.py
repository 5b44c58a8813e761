"""AutoMicroBatch and MemoryMonitor on two DDP processes (gloo), rank 1 short of memory; the checkpoint is written to
``ddp.ckpt`` for a one-process run to resume from (run by tests/callbacks/test_state_world_size.py)."""

import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_memopt import MemoryMonitor
from lightning_memopt.callbacks.auto_micro_batch import AutoMicroBatch
from tests.helpers.amb import Data, Net, ddp_trainer


class RankBudget(Net):
    # only rank 1 has a memory budget

    def training_step(self, batch, batch_idx):
        if self.global_rank != 1:
            self.forward_budget = None
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        sampler = DistributedSampler(Data(), shuffle=False)
        return DataLoader(Data(), batch_size=self.batch_size, sampler=sampler)


if __name__ == "__main__":
    trainer = ddp_trainer([AutoMicroBatch(), MemoryMonitor(log_every_n_steps=1)])
    trainer.fit(RankBudget(batch_size=8, forward_budget=2))
    trainer.save_checkpoint("ddp.ckpt")  # every rank calls it; rank 0 writes
    # Lightning keeps the process group; one left to interpreter exit sometimes aborts there (gloo's threads)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
