"""Two processes (gloo, CPU) of FSDP2 under Lightning's ``ModelParallelStrategy``, with every memory callback.

Usage: ``python fsdp2_callbacks.py`` in an empty directory (run by ``tests/callbacks/test_fsdp2.py``). The
LightningModule builds two more blocks and applies ``fully_shard`` to each block and to the root in
``configure_model``; the fit runs ``MemoryMonitor`` (with its cross-rank exchange every step), ``CacheCleaner``,
``GarbageCollector``, ``MemoryAudit``, ``GradientCheckpointing`` twice (one for the blocks built in ``__init__``,
wrapped at setup before ``fully_shard``; one for the blocks ``configure_model`` builds, wrapped at fit start after
it) and ``OOMReporter``. After the second optimizer step, each rank writes what it saw to ``seen_rank{r}.json``;
the package's log goes to ``log_rank{r}.txt``. A validation of two batches follows. At the fourth step rank 1
alone raises ``torch.OutOfMemoryError`` inside the third block's forward (rank 0 then waits in the next unit's
all-gather until Lightning ends it), so rank 1 writes its out-of-memory report and ``caught_rank1.json``.
Lightning re-launches this file for rank 1, so it must be a file of its own.
"""

from __future__ import annotations

import json
from datetime import timedelta

import torch
from torch import nn

from tests.helpers.lightning import pl
from tests.helpers.models import RandomDataset

WIDTH = 32
NUM_BLOCKS = 4
OOM_STEP = 3  # global step (optimizer steps done) at which rank 1 fails


class Block(nn.Module):
    """A residual MLP block that counts its forwards (a checkpointed block runs twice per step)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)
        self.calls = 0
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.fail:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (rank 1 only, in a block)")
        return x + self.fc2(torch.relu(self.fc1(x)))


class EarlyBlock(Block):
    """Built in ``__init__``: there when callbacks' ``setup`` runs."""


class LateBlock(Block):
    """Built in ``configure_model``, right before ``fully_shard``."""


class ShardedModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(*[EarlyBlock(WIDTH) for _ in range(NUM_BLOCKS // 2)], nn.Linear(WIDTH, 2))
        self.wrapped_at_shard: list[bool] = []

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        from lightning_memopt.functional.checkpointing import is_checkpointed

        if getattr(self.model, "_sharded", False):
            return
        for i in range(NUM_BLOCKS // 2, NUM_BLOCKS):
            self.model.insert(i, LateBlock(WIDTH))
        mesh = self.device_mesh["data_parallel"]
        for block in self.model[:NUM_BLOCKS]:
            self.wrapped_at_shard.append(is_checkpointed(block))  # GradientCheckpointing's setup ran before
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.model._sharded = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        if self.global_step == OOM_STEP and self.global_rank == 1:
            self.model[2].fail = True
        return self(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self(batch).pow(2).mean(), sync_dist=True)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(RandomDataset(WIDTH, 64), batch_size=4)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(RandomDataset(WIDTH, 16, seed=1), batch_size=4)


class Observer(pl.Callback):
    """Writes ``seen_rank{r}.json`` after the second optimizer step: what the sharded fit looks like on this rank."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != 2:
            return
        import gc

        from torch.distributed.tensor import DTensor

        from lightning_memopt.functional.checkpointing import is_checkpointed

        audit = next(cb for cb in trainer.callbacks if type(cb).__name__ == "MemoryAudit")
        logger = trainer.loggers[0]
        seen = {
            "strategy": type(trainer.strategy).__name__,
            "world_size": trainer.world_size,
            "all_dtensor": all(isinstance(p, DTensor) for p in pl_module.parameters()),
            "wrapped_at_shard": pl_module.wrapped_at_shard,
            "checkpointed": [is_checkpointed(b) for b in pl_module.model[:NUM_BLOCKS]],
            "block_calls": [b.calls for b in pl_module.model[:NUM_BLOCKS]],
            "last_audit": audit.last_audit,
            "duplicates_warned": audit._session.warn_duplicates,
            "gc_enabled": gc.isenabled(),
            "logged_keys": sorted({key for _, metrics in getattr(logger, "calls", []) for key in metrics}),
        }
        with open(f"seen_rank{trainer.global_rank}.json", "w") as f:
            json.dump(seen, f, default=str)


def main() -> None:
    import gc
    import logging
    import os

    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_memopt import (
        CacheCleaner,
        GarbageCollector,
        GradientCheckpointing,
        MemoryAudit,
        MemoryMonitor,
        OOMReporter,
    )
    from tests.helpers.monitor_loggers import RecordingLogger
    from tests.helpers.trainer import make_trainer

    package_log = logging.getLogger("lightning_memopt")
    package_log.setLevel(logging.INFO)
    package_log.addHandler(logging.FileHandler(f"log_rank{os.environ.get('LOCAL_RANK', '0')}.txt"))
    callbacks = [
        MemoryMonitor(dirpath="memopt", cross_rank_every_n_train_steps=1),
        CacheCleaner(every_n_train_steps=1),
        GarbageCollector(every_n_train_steps=1),
        MemoryAudit(dirpath="memopt", leak_every_n_train_steps=1, leak_window=3),
        GradientCheckpointing(checkpoint_modules=[EarlyBlock]),
        GradientCheckpointing(checkpoint_modules=[LateBlock]),
        OOMReporter(dirpath="memopt"),
        Observer(),
    ]
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=timedelta(seconds=600))
    trainer = make_trainer(
        ".",
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=6,
        limit_train_batches=6,
        limit_val_batches=2,
        val_check_interval=2,  # a validation (no-grad forwards of the sharded model) after step 2, before the OOM
        callbacks=callbacks,
        logger=RecordingLogger(),
    )
    torch.manual_seed(0)
    try:
        trainer.fit(ShardedModel())
    except BaseException as err:
        if trainer.global_rank == 1:
            with open("caught_rank1.json", "w") as f:
                caught = {"type": type(err).__name__, "is_oom": isinstance(err, torch.OutOfMemoryError)}
                json.dump({**caught, "gc_enabled": gc.isenabled()}, f)
        raise


if __name__ == "__main__":
    main()
