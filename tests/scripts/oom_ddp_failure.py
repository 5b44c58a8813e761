"""Two-process DDP (gloo, CPU) where rank 1 alone runs out of memory, with every exported callback at its defaults.

Usage: ``python oom_ddp_failure.py forward|backward`` in an empty directory (run by
``tests/callbacks/test_ddp_failures.py``). Rank 1 raises ``torch.OutOfMemoryError`` at batch 2, in forward or in
the first node of backward; what ``trainer.fit`` raised on rank 1 is written to ``caught_rank1.json``. Lightning
re-launches this file for rank 1, so it must be a file of its own.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch

from tests.helpers.models import TinyModel


def oom_message(where: str) -> str:
    """The message rank 1 raises.

    Example:
        >>> oom_message("forward")
        'CUDA out of memory. Tried to allocate 1.00 GiB (rank 1 only, in forward)'
    """
    return "CUDA out of memory. Tried to allocate 1.00 GiB (rank 1 only, in " + where + ")"


class _FailInBackward(torch.autograd.Function):
    message = ""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError(_FailInBackward.message)


class RankOneFails(TinyModel):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def forward(self, x):
        out = super().forward(x)
        if self.training and self.global_rank == 1 and self.trainer.fit_loop.batch_idx == 2:
            if self.where == "forward":
                raise torch.OutOfMemoryError(oom_message(self.where))
            _FailInBackward.message = oom_message(self.where)
            out = _FailInBackward.apply(out)  # the first node of backward: fails before any gradient exists
        return out


def main(where: str) -> None:
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_memopt import (
        CacheCleaner,
        GarbageCollector,
        GradientCheckpointing,
        MemoryAudit,
        MemoryMonitor,
        OOMReporter,
    )
    from tests.helpers.trainer import make_trainer

    callbacks = [
        MemoryMonitor(),
        CacheCleaner(),
        GarbageCollector(),
        OOMReporter(),
        MemoryAudit(),
        GradientCheckpointing(),
    ]
    # The process group's own timeout is far beyond the test's limit: only a run that ends by itself passes.
    trainer = make_trainer(
        ".",
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(timeout=timedelta(seconds=600)),
        max_steps=6,
        limit_train_batches=6,
        callbacks=callbacks,
        logger=CSVLogger("logs"),
    )
    try:
        trainer.fit(RankOneFails(where))
    except BaseException as err:
        if trainer.global_rank == 1:
            with open(f"caught_rank{trainer.global_rank}.json", "w") as f:
                caught = {"type": type(err).__name__, "message": str(err)}
                json.dump({**caught, "is_oom": isinstance(err, torch.OutOfMemoryError)}, f)
        raise


if __name__ == "__main__":
    main(sys.argv[1])
