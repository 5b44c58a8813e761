"""A healthy 2-process DDP fit (gloo, CPU) with MemoryMonitor and GarbageCollector (tests/callbacks/test_ddp_run.py).

Writes, in the working directory: ``mem/memory_rank{r}.jsonl`` (the monitor's logs), ``logged_rank{r}.jsonl`` (what
reached the logger on each rank) and ``gc_steps_rank{r}.json`` (the global step of each collection on each rank).
"""

from __future__ import annotations

import json
from typing import Any

from lightning.pytorch.loggers import Logger


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


class FileLogger(Logger):
    """Appends every ``log_metrics`` call to ``logged_rank{rank}.jsonl``."""

    name = "f"
    version = 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        with open(f"logged_rank{_rank()}.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")


class Probe:
    """Stands in for the `gc` module inside GarbageCollector: records the global step of each collection."""

    def __init__(self, real: Any, step: Any) -> None:
        self.real, self.step, self.steps = real, step, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def collect(self, generation: int = 2) -> int:
        self.steps.append(self.step())
        return self.real.collect(generation)


def main() -> None:
    import lightning.pytorch as pl

    from lightning_memopt import GarbageCollector, MemoryMonitor
    from lightning_memopt.callbacks import garbage_collector as gcmod
    from tests.helpers.models import TinyModel

    callbacks = [
        MemoryMonitor(dirpath="mem", log_every_n_steps=1, cross_rank_every_n_train_steps=2),
        GarbageCollector(every_n_train_steps=2),
    ]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_steps=4,
        limit_train_batches=4,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=FileLogger(),
        default_root_dir=".",
        callbacks=callbacks,
    )
    gcmod.gc = probe = Probe(gcmod.gc, lambda: trainer.global_step)
    trainer.fit(TinyModel())
    with open(f"gc_steps_rank{trainer.global_rank}.json", "w") as f:
        json.dump(probe.steps, f)


if __name__ == "__main__":
    main()
