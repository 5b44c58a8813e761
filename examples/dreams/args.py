"""The command line of ``examples/dreams/train.py``: DreaMS-style flags plus the memory flags of lightning-memopt."""

from __future__ import annotations

import argparse

from examples.dreams.model import MODEL_PRESETS

__all__ = ["DEFAULT_BATCH_SIZE", "DESCRIPTION", "MEMORY_PRESETS", "build_parser", "check_args"]

DESCRIPTION = "DreaMS-style fine-tuning with lightning-memopt: a transformer over MS/MS spectra, on synthetic data."
#: ``auto`` picks the preset from the GPU's size (``MemoryPreset.for_device``), ``balanced`` without a GPU;
#: ``none`` uses no preset, only the explicit flags.
MEMORY_PRESETS = ("auto", "max-savings", "balanced", "max-speed", "none")
DEFAULT_BATCH_SIZE = 32  # the DataLoader batch without --batch_size or --effective_batch_size


def _int_or_float(text: str) -> int | float:
    """``"10"`` -> 10 batches, ``"0.25"`` or ``"1.0"`` -> a fraction, as Lightning reads these arguments."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def build_parser() -> argparse.ArgumentParser:
    """The command line: DreaMS-style flags plus the memory flags of this package."""
    p = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument(
        "--data_path", default="outputs/data/dreams_synthetic.hdf5", help="HDF5 spectra file (generated if missing)"
    )
    g.add_argument("--num_spectra", type=int, default=4000, help="spectra to generate when --data_path is missing")
    g.add_argument("--max_peaks_n", type=int, default=100, help="most intense peaks kept per spectrum")
    g.add_argument("--num_workers_data", type=int, default=0, help="DataLoader workers (each opens the HDF5 lazily)")
    g.add_argument("--in_mem", action="store_true", help="read the data into RAM instead of lazily")
    g.add_argument(
        "--dynamic_padding",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pad each batch to its longest spectrum (--no-dynamic_padding: always to max_peaks_n)",
    )
    g.add_argument(
        "--peaks_budget",
        type=int,
        default=None,
        help="batch the training set by peaks: at most N padded peak tokens a batch, spectra of similar peak counts"
        " together (TokenBudgetBatchSampler); default: batches of --batch_size",
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--model_preset",
        choices=tuple(MODEL_PRESETS),
        default="tiny",
        help="model size: tiny (~0.2M parameters, CPU), small (~3.5M), dreams-base (~95M, DreaMS's size)",
    )
    g.add_argument("--d_fourier", type=int, default=None, help="override the preset's Fourier width")
    g.add_argument("--d_peak", type=int, default=None, help="override the preset's peak-MLP width")
    g.add_argument("--n_layers", type=int, default=None, help="override the preset's encoder layers")
    g.add_argument("--n_heads", type=int, default=None, help="override the preset's attention heads")
    g.add_argument("--dropout", type=float, default=None, help="override the preset's dropout")
    g.add_argument(
        "--pre_trained_pth",
        default=None,
        help="checkpoint to load the backbone from (a checkpoint of this script or a backbone state_dict)",
    )
    g.add_argument(
        "--unfreeze_backbone_at_epoch",
        type=int,
        default=0,
        help="train only the head before this epoch (0: never frozen)",
    )
    g = p.add_argument_group("training")
    g.add_argument(
        "--batch_size",
        type=int,
        default=None,
        help=f"micro-batch size per device (default {DEFAULT_BATCH_SIZE}; with --effective_batch_size and"
        " no --batch_size the memory preset picks it)",
    )
    g.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (after a 20-step warm-up)")
    g.add_argument("--head_lr_scale", type=float, default=10.0, help="the fresh head learns at lr x this")
    g.add_argument("--max_epochs", type=int, default=3)
    g.add_argument("--max_steps", type=int, default=-1, help="stop after this many optimizer steps (-1: no limit)")
    g.add_argument(
        "--limit_train_batches",
        type=_int_or_float,
        default=None,
        help="train batches per epoch: a number (10) or a fraction (0.5)",
    )
    g.add_argument(
        "--val_check_interval",
        type=_int_or_float,
        default=None,
        help="validate every N train batches (or a fraction of the epoch)",
    )
    g.add_argument(
        "--limit_val_batches",
        type=_int_or_float,
        default=None,
        help="validation batches: a number (10) or a fraction (0.5)",
    )
    g.add_argument("--num_sanity_val_steps", type=int, default=None, help="validation batches run before training")
    g.add_argument("--save_top_k", type=int, default=1, help="best checkpoints kept (by val_loss)")
    g.add_argument(
        "--every_n_train_steps",
        type=int,
        default=None,
        help="also keep a checkpoint every N optimizer steps (step=<n>.ckpt), next to the best and last",
    )
    g.add_argument(
        "--num_devices",
        type=int,
        default=1,
        help="devices; DDP when > 1 (CPU processes with gloo without a GPU; run it as a script)",
    )
    g.add_argument("--accelerator", default="auto", help="cpu, gpu or auto")
    g.add_argument(
        "--cpu_threads",
        type=int,
        default=None,
        help="torch intra-op threads when training on CPU (default 1: tiny models gain nothing from more"
        " and lose a lot when cores are shared); restored at the end",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--output_dir",
        default="outputs/dreams",
        help="each run writes to <output_dir>/version_<n>: checkpoints, metrics.csv, memory logs and plot",
    )
    g.add_argument(
        "--progress_bar",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show Lightning's progress bar (default: only on a terminal; otherwise one line per validation)",
    )
    g.add_argument("--no_wandb", action="store_true", help="accepted for DreaMS compatibility; logs go to CSV")
    g = p.add_argument_group("memory")
    g.add_argument(
        "--preset",
        choices=MEMORY_PRESETS,
        default="auto",
        help="memory preset: decides precision and gradient accumulation ('auto': by GPU size, 'balanced'"
        " without a GPU; 'none': only the explicit flags)",
    )
    g.add_argument(
        "--train_precision",
        default=None,
        help="precision (32, 64, 16-mixed, bf16-mixed, ...); overrides the preset's choice",
    )
    g.add_argument(
        "--effective_batch_size",
        type=int,
        default=None,
        help="samples per optimizer step over all devices; accumulation is derived from it",
    )
    g.add_argument("--accumulate_grad_batches", type=int, default=None, help="micro-batches per optimizer step")
    g.add_argument("--gradient_checkpointing", action="store_true", help="recompute encoder activations in backward")
    g.add_argument(
        "--auto_micro_batch",
        action="store_true",
        help="the DataLoader yields the whole per-device batch and AutoMicroBatch splits it into"
        " micro-batches (from --batch_size), halving them on out-of-memory with the same effective"
        " batch; no Lightning accumulation",
    )
    g.add_argument("--memory_log_every_n_steps", type=int, default=5, help="memory reading interval")
    g.add_argument("--no_memory_callbacks", action="store_true", help="run without the package's callbacks")
    return p


def check_args(args: argparse.Namespace) -> None:
    for name in ("batch_size", "effective_batch_size", "accumulate_grad_batches", "peaks_budget"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"error: `--{name}` must be a positive int, got {value}.")
    for name in ("max_peaks_n", "num_devices", "num_spectra", "memory_log_every_n_steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: `--{name}` must be a positive int, got {getattr(args, name)}.")
    if args.every_n_train_steps is not None and args.every_n_train_steps < 1:
        raise SystemExit(f"error: `--every_n_train_steps` must be a positive int, got {args.every_n_train_steps}.")
    if args.num_workers_data < 0:
        raise SystemExit(f"error: `--num_workers_data` must be >= 0, got {args.num_workers_data}.")
    if args.unfreeze_backbone_at_epoch < 0:
        raise SystemExit(f"error: `--unfreeze_backbone_at_epoch` must be >= 0, got {args.unfreeze_backbone_at_epoch}.")
