"""A 2-process CPU DDP fit that logs StreamingRetrievalMetric with the documented call; each rank writes JSON.

Usage: ``python retrieval_lightning_ddp.py``; writes ``rank{0,1}.json`` with the warnings seen, the values computed
and the values logged.
"""

from __future__ import annotations

import json
import warnings

import torch
from torch.utils.data import DataLoader, Dataset

from lightning_memopt import StreamingRetrievalMetric
from tests.helpers.lightning import pl


class Pairs(Dataset):
    # 7 pairs: DistributedSampler pads to 8 over 2 processes, repeating one sample
    def __len__(self):
        return 7

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(4, generator=g), i


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)
        self.retrieval = StreamingRetrievalMetric(top_k=(1, 5))
        self.computed = []

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        x, ids = batch
        with torch.no_grad():
            self.retrieval.update(self.layer(x), x, text_ids=ids)  # no sample_ids: padding repeats count twice

    def on_validation_epoch_end(self):
        values = self.retrieval.compute()
        self.computed.append({k: v.item() for k, v in values.items()})
        self.log_dict(values, sync_dist=True, reduce_fx="max")  # the documented call
        self.retrieval.reset()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(Pairs(), batch_size=2)

    def val_dataloader(self):
        return DataLoader(Pairs(), batch_size=2)


if __name__ == "__main__":
    model = Model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy="ddp",
            max_epochs=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=".",
        )
        trainer.fit(model)
    logged = {k: v.item() for k, v in trainer.callback_metrics.items()}
    out = {"warnings": [str(w.message) for w in caught], "computed": model.computed, "logged": logged}
    with open(f"rank{trainer.global_rank}.json", "w") as f:
        json.dump(out, f)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
