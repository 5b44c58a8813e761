"""The DreaMS-style fine-tuning run from a LightningCLI YAML config (the same run as ``train.py``).

Run from the repository root:

    python examples/dreams/cli.py fit --config examples/dreams/config.yaml
    python examples/dreams/cli.py fit --config examples/dreams/config.yaml --trainer.max_epochs 1 \\
        --memory.name max-savings --memory.effective_batch_size 128

The YAML lists every callback of the package by class path under ``trainer.callbacks``. Its ``memory:`` section is
a :class:`~lightning_memopt.MemoryPreset` (added by :class:`~lightning_memopt.MemoryPresetCLI`): ``memory.name``,
``memory.effective_batch_size``, ``memory.micro_batch_size``, ``memory.precision``,
``memory.gradient_checkpointing`` and ``memory.auto_micro_batch`` decide precision, accumulation and the DataLoader
batch (``data.batch_size`` is set by the preset), as ``train.py``'s ``--preset``, ``--effective_batch_size``,
``--batch_size``, ``--train_precision``, ``--gradient_checkpointing`` and ``--auto_micro_batch`` do. The callbacks
under ``trainer.callbacks`` replace the preset's of the same type. After ``fit`` it prints the same report: where
the checkpoints, memory logs and plot are, and the memory summary.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from lightning.pytorch.cli import ArgsType, LightningCLI

from examples.dreams.module import SpectraDataModule, SpectraFineTuner
from examples.dreams.report import report
from lightning_memopt import MemoryPresetCLI

__all__ = ["CONFIG", "DreamsCLI", "cli_main"]

#: The example's YAML config.
CONFIG = Path(__file__).with_name("config.yaml")


class DreamsCLI(MemoryPresetCLI, LightningCLI):
    """``LightningCLI`` with a ``memory:`` section whose ``MemoryPreset`` sets precision, accumulation and the batch.

    ``memory.name`` is ``max-savings``, ``balanced`` or ``max-speed``. The micro-batch is ``memory.micro_batch_size``;
    with ``memory.effective_batch_size`` the accumulation is derived from it and ``trainer.devices``. The preset's
    DataLoader batch goes to ``data.batch_size``: with ``memory.auto_micro_batch: true`` that is the whole per-device
    batch, and ``AutoMicroBatch`` splits it into micro-batches from ``memory.micro_batch_size``, halving them on
    out-of-memory with the same effective batch.
    """

    memory_batch_size_target = "data.batch_size"


def cli_main(args: ArgsType = None, run: bool = True) -> DreamsCLI:
    """Run the CLI (``args`` as on the command line; ``None`` reads ``sys.argv``) and print the report after ``fit``.

    Without a CUDA GPU torch uses one intra-op thread (restored at the end): tiny models gain nothing from more.
    """
    threads = torch.get_num_threads()
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    try:
        cli = DreamsCLI(SpectraFineTuner, SpectraDataModule, args=args, run=run, save_config_kwargs={"overwrite": True})
        trainer = cli.trainer
        if run and cli.subcommand == "fit":
            if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.barrier()  # every rank's memory log is complete before rank zero reads them
            if trainer.is_global_zero:
                print(report(trainer, trainer.checkpoint_callback), flush=True)
        return cli
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    cli_main()
