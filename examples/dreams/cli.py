"""The DreaMS-style fine-tuning run from a LightningCLI YAML config (the same run as ``train.py``).

Run from the repository root:

    python examples/dreams/cli.py fit --config examples/dreams/config.yaml
    python examples/dreams/cli.py fit --config examples/dreams/config.yaml --trainer.max_epochs 1 \\
        --memory.preset max-savings --memory.effective_batch_size 128

The YAML lists every callback of the package by class path under ``trainer.callbacks``. A ``memory:`` section
(added by :class:`DreamsCLI`) names the ``MemoryPreset`` that decides precision and gradient accumulation, exactly
as ``train.py``'s ``--preset``, ``--effective_batch_size``, ``--train_precision``, ``--gradient_checkpointing`` and
``--auto_micro_batch`` do. After ``fit`` it prints the same report: where the checkpoints, memory logs and plot are,
and the memory summary.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from typing_extensions import override

from examples.dreams.module import SpectraDataModule, SpectraFineTuner
from examples.dreams.train import preset_trainer_kwargs, report

__all__ = ["CONFIG", "DreamsCLI", "cli_main"]

#: The example's YAML config.
CONFIG = Path(__file__).with_name("config.yaml")


class DreamsCLI(LightningCLI):
    """``LightningCLI`` with a ``memory:`` section whose ``MemoryPreset`` sets precision and accumulation.

    ``memory.preset`` is one of ``auto`` (by GPU size; ``balanced`` without a GPU), ``max-savings``, ``balanced``,
    ``max-speed`` or ``none``. The micro-batch is ``data.batch_size``; with ``memory.effective_batch_size`` the
    accumulation is derived from it (``trainer.devices`` must then be an int). ``trainer.precision`` or
    ``memory.train_precision`` overrides the preset's precision. With ``memory.auto_micro_batch: true`` the DataLoader
    yields the whole per-device batch (the datamodule's ``batch_size`` is set to it) and ``AutoMicroBatch`` splits it
    into micro-batches from ``data.batch_size``, halving them on out-of-memory with the same effective batch.
    """

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--memory.preset",
            type=Literal["auto", "max-savings", "balanced", "max-speed", "none"],
            default="auto",
            help="memory preset: decides precision and gradient accumulation",
        )
        parser.add_argument(
            "--memory.effective_batch_size",
            type=int | None,
            default=None,
            help="samples per optimizer step over all devices; accumulation is derived from it",
        )
        parser.add_argument(
            "--memory.train_precision",
            type=str | None,
            default=None,
            help="precision (32, 64, 16-mixed, bf16-mixed, ...); overrides the preset's choice",
        )
        parser.add_argument(
            "--memory.gradient_checkpointing",
            type=bool,
            default=False,
            help="recompute encoder activations in backward",
        )
        parser.add_argument(
            "--memory.auto_micro_batch",
            type=bool,
            default=False,
            help="the DataLoader yields the whole per-device batch and AutoMicroBatch splits it,"
            " halving on out-of-memory with the same effective batch",
        )

    @override
    def instantiate_trainer(self, **kwargs: Any) -> Any:
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        trainer_cfg, memory = config["trainer"], config["memory"]
        devices = trainer_cfg.get("devices", "auto")
        if memory.effective_batch_size is not None and not isinstance(devices, int):
            raise SystemExit(f"error: `memory.effective_batch_size` needs an int `trainer.devices`, got {devices!r}.")
        accumulate = trainer_cfg.get("accumulate_grad_batches") or 1
        extra, batch_size, _ = preset_trainer_kwargs(
            preset=memory.preset,
            batch_size=self.datamodule.hparams.batch_size,
            num_devices=devices if isinstance(devices, int) else 1,
            effective_batch_size=memory.effective_batch_size,
            accumulate_grad_batches=None if accumulate == 1 else accumulate,
            train_precision=memory.train_precision or trainer_cfg.get("precision"),
            gradient_checkpointing=memory.gradient_checkpointing,
            accelerator=str(trainer_cfg.get("accelerator") or "auto"),
            auto_micro_batch=memory.auto_micro_batch,
        )
        self.datamodule.hparams.batch_size = batch_size  # the micro-batch, or the per-device batch to split
        extra["callbacks"] = [*(trainer_cfg.get("callbacks") or []), *extra.get("callbacks", [])]
        if "plugins" in extra:  # the preset's MemoryPrecision replaces a `precision` string
            extra["plugins"] = [*(trainer_cfg.get("plugins") or []), *extra["plugins"]]
            extra["precision"] = None
        return super().instantiate_trainer(**{**extra, **kwargs})


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
