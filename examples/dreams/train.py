"""DreaMS-style fine-tuning with lightning-memopt: a transformer over MS/MS spectra, on synthetic data.

Run from the repository root (CPU, about a minute on 2 cores):

    python examples/dreams/train.py

Each run gets its own directory ``<output_dir>/version_<n>`` (default ``outputs/dreams``) holding the checkpoints,
``metrics.csv`` and ``memopt/`` (one ``memory_rank<r>.jsonl`` per rank and ``memory_timeline.png``). At the end it
prints where they are, the validation loss against the mean-prediction baseline, and the memory summary.

On a GPU, the DreaMS-sized model with the package's strongest memory savings at an effective batch of 256 (the
preset keeps the effective batch and picks the micro-batch and accumulation):

    python examples/dreams/train.py --model_preset dreams-base --preset max-savings --effective_batch_size 256 \\
        --max_steps 50

Two CPU processes with DDP (gloo), one memory log per rank:

    python examples/dreams/train.py --num_devices 2 --accelerator cpu

Surviving out-of-memory: the DataLoader yields the whole per-device batch and ``AutoMicroBatch`` splits it into
micro-batches (from ``--batch_size``), halving them on out-of-memory with the same effective batch and step count:

    python examples/dreams/train.py --model_preset dreams-base --effective_batch_size 256 --auto_micro_batch

Fine-tuning from a backbone checkpoint, with the backbone frozen for the first epoch:

    python examples/dreams/train.py --pre_trained_pth outputs/dreams/version_0/checkpoints/last.ckpt \\
        --unfreeze_backbone_at_epoch 1

Flags are named as DreaMS users know them (``--batch_size``, ``--max_peaks_n``, ``--train_precision``,
``--num_devices``, ``--lr``, ``--max_epochs``, ``--val_check_interval``, ``--save_top_k``, ``--num_workers_data``,
``--dropout``, ``--d_fourier``, ``--d_peak``, ``--n_layers``, ``--n_heads``, ``--pre_trained_pth``,
``--unfreeze_backbone_at_epoch``, ``--seed``, ``--no_wandb``) plus the memory ones (``--preset``,
``--effective_batch_size``, ``--accumulate_grad_batches``, ``--auto_micro_batch``, ``--limit_val_batches``,
``--every_n_train_steps``, ``--gradient_checkpointing``, ``--dynamic_padding``). ``examples/dreams/cli.py`` does
the same from a LightningCLI YAML config (``examples/dreams/config.yaml``).

Each part of lightning-memopt is wired in one place: ``preset_trainer_kwargs`` (``examples/dreams/memory.py``:
``MemoryPreset.merge_trainer_config`` decides precision, accumulation and its callbacks), ``memory_callbacks`` (every
callback of the package, replacing the preset's of the same type) and ``report`` (``examples/dreams/report.py``: the
summary and plot of the memory logs). The flags are defined in ``examples/dreams/args.py``.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy

from examples.dreams.args import MEMORY_PRESETS, build_parser, check_args
from examples.dreams.memory import memory_callbacks, preset_trainer_kwargs
from examples.dreams.module import SpectraDataModule, SpectraFineTuner
from examples.dreams.report import ValidationPrinter, auto_micro_batch_of, report

__all__ = [
    "MEMORY_PRESETS",
    "build_parser",
    "main",
    "memory_callbacks",
    "memory_trainer_kwargs",
    "preset_trainer_kwargs",
    "report",
]


def memory_trainer_kwargs(args: argparse.Namespace, trainer_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """:func:`preset_trainer_kwargs` from the command line; sets ``args.batch_size`` to the DataLoader's batch."""
    kwargs, batch_size, name = preset_trainer_kwargs(
        args.preset,
        args.batch_size,
        args.num_devices,
        args.effective_batch_size,
        args.accumulate_grad_batches,
        args.train_precision,
        args.gradient_checkpointing,
        args.accelerator,
        args.auto_micro_batch,
        trainer_config=trainer_config,
        monitoring=not args.no_memory_callbacks,
    )
    args.batch_size = batch_size
    args.preset_name = name
    return kwargs


def main(argv: Sequence[str] | None = None) -> pl.Trainer:
    """Parse ``argv``, train, and print the report on rank zero. Returns the trainer."""
    args = build_parser().parse_args(argv)
    check_args(args)
    threads = torch.get_num_threads()
    on_cpu = args.accelerator == "cpu" or (args.accelerator == "auto" and not torch.cuda.is_available())
    if on_cpu:
        torch.set_num_threads(args.cpu_threads or 1)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _strategy(args: argparse.Namespace) -> str | DDPStrategy:
    if args.num_devices == 1:
        return "auto"
    # A frozen backbone gives no gradients to its parameters for a while: DDP must be told to look for them.
    return DDPStrategy(find_unused_parameters=args.unfreeze_backbone_at_epoch > 0)


def _trainer_config(args: argparse.Namespace, checkpoint: ModelCheckpoint) -> dict[str, Any]:
    """The Trainer arguments of this script, before the memory preset adds its own."""
    out = Path(args.output_dir)
    progress_bar = sys.stdout.isatty() if args.progress_bar is None else args.progress_bar
    optional = {
        "limit_train_batches": args.limit_train_batches,
        "limit_val_batches": args.limit_val_batches,
        "val_check_interval": args.val_check_interval,
        "num_sanity_val_steps": args.num_sanity_val_steps,
    }
    return {
        "accelerator": args.accelerator,
        "devices": args.num_devices,
        "strategy": _strategy(args),
        "max_epochs": args.max_epochs,
        "max_steps": args.max_steps,
        "default_root_dir": str(out),
        "logger": CSVLogger(str(out), name=""),
        "callbacks": [
            checkpoint,
            *(
                [
                    ModelCheckpoint(
                        every_n_train_steps=args.every_n_train_steps,
                        save_top_k=-1,
                        filename="step={step}",
                        auto_insert_metric_name=False,
                    )
                ]
                if args.every_n_train_steps
                else []
            ),
            *memory_callbacks(args),
            *([] if progress_bar else [ValidationPrinter()]),
        ],
        "log_every_n_steps": 10,
        "enable_model_summary": False,
        "enable_progress_bar": progress_bar,
        **{k: v for k, v in optional.items() if v is not None},
    }


def _run(args: argparse.Namespace) -> pl.Trainer:
    pl.seed_everything(args.seed, workers=True, verbose=False)
    # dirpath=None: <run directory>/checkpoints, the same directory on every rank.
    checkpoint = ModelCheckpoint(monitor="val_loss", mode="min", save_top_k=args.save_top_k, save_last=True)
    trainer_kwargs = memory_trainer_kwargs(args, _trainer_config(args, checkpoint))
    datamodule = SpectraDataModule(
        data_path=args.data_path,
        num_spectra=args.num_spectra,
        batch_size=args.batch_size,
        max_peaks_n=args.max_peaks_n,
        num_workers_data=args.num_workers_data,
        in_mem=args.in_mem,
        dynamic_padding=args.dynamic_padding,
        seed=args.seed,
        peaks_budget=args.peaks_budget,
    )
    model = SpectraFineTuner(
        model_preset=args.model_preset,
        d_fourier=args.d_fourier,
        d_peak=args.d_peak,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        dropout=args.dropout,
        lr=args.lr,
        head_lr_scale=args.head_lr_scale,
        pre_trained_pth=args.pre_trained_pth,
        unfreeze_backbone_at_epoch=args.unfreeze_backbone_at_epoch,
    )
    trainer = pl.Trainer(**trainer_kwargs)
    if trainer.is_global_zero:
        n_params = sum(p.numel() for p in model.parameters())
        auto = auto_micro_batch_of(trainer)
        print(
            f"model {args.model_preset}: {n_params / 1e6:.2f}M parameters; memory preset {args.preset_name}:"
            f" precision {trainer.precision}, {'batch' if auto else 'micro-batch'} {args.batch_size}"
            f"{' per device' if auto else ''} x {trainer.accumulate_grad_batches}"
            f" accumulation x {trainer.world_size} device(s) = effective batch"
            f" {args.batch_size * trainer.accumulate_grad_batches * trainer.world_size}",
            flush=True,
        )
        if auto is not None:
            start = "the whole batch" if auto.start_micro_batch_size == "auto" else auto.start_micro_batch_size
            print(
                f"auto micro-batch: the DataLoader yields the whole per-device batch ({args.batch_size}) and"
                f" AutoMicroBatch splits it into micro-batches (from {start}), halving on out-of-memory with the"
                " same effective batch",
                flush=True,
            )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")
        trainer.fit(model, datamodule=datamodule)
    if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank's memory log is complete before rank zero reads them
    if trainer.is_global_zero:
        print(report(trainer, checkpoint), flush=True)
    return trainer


if __name__ == "__main__":
    main()
