"""DreaMS-style fine-tuning with lightning-memopt: a transformer over MS/MS spectra, on synthetic data.

Run from the repository root (CPU, about a minute on 2 cores):

    python examples/dreams/train.py

Each run gets its own directory ``<output_dir>/version_<n>`` (default ``outputs/dreams``) holding the checkpoints,
``metrics.csv`` and ``memory/`` (one ``memory_rank<r>.jsonl`` per rank and ``memory_timeline.png``). At the end it
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

Each part of lightning-memopt is wired in one function below: ``preset_trainer_kwargs`` (``MemoryPreset``:
precision and accumulation), ``memory_callbacks`` (every callback of the package) and ``report`` (the summary and
plot of the memory logs).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from examples.dreams.model import MODEL_PRESETS
from examples.dreams.module import SpectraDataModule, SpectraFineTuner

__all__ = [
    "MEMORY_PRESETS",
    "build_parser",
    "main",
    "memory_callbacks",
    "memory_trainer_kwargs",
    "preset_trainer_kwargs",
    "report",
]

#: ``auto`` picks the preset from the GPU's size (``MemoryPreset.for_device``), ``balanced`` without a GPU;
#: ``none`` uses no preset, only the explicit flags.
MEMORY_PRESETS = ("auto", "max-savings", "balanced", "max-speed", "none")
DEFAULT_BATCH_SIZE = 32


def _int_or_float(text: str) -> int | float:
    """``"10"`` -> 10 batches, ``"0.25"`` or ``"1.0"`` -> a fraction, as Lightning reads these arguments."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def build_parser() -> argparse.ArgumentParser:
    """The command line: DreaMS-style flags plus the memory flags of this package."""
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
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


def _check_args(args: argparse.Namespace) -> None:
    for name in ("batch_size", "effective_batch_size", "accumulate_grad_batches"):
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


def _precision_mode(train_precision: str | int | None) -> str | None:
    from lightning_memopt.functional.presets import normalize_precision

    if train_precision is None:
        return None
    try:  # Lightning's names: 16 -> 16-mixed, bf16 -> bf16-mixed, 32 -> 32-true, 64 -> 64-true
        return normalize_precision(train_precision, "--train_precision")
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None


def preset_trainer_kwargs(
    preset: str = "auto",
    batch_size: int | None = None,
    num_devices: int = 1,
    effective_batch_size: int | None = None,
    accumulate_grad_batches: int | None = None,
    train_precision: str | int | None = None,
    gradient_checkpointing: bool = False,
    accelerator: str = "auto",
    auto_micro_batch: bool = False,
) -> tuple[dict[str, Any], int, str]:
    """Wiring point of ``MemoryPreset``: the Trainer kwargs that decide precision and accumulation.

    The preset keeps the effective batch (``effective_batch_size``) and splits it into ``batch_size``-sample
    micro-batches and accumulation steps; without ``batch_size`` it picks the micro-batch itself (``max-savings``
    aims at 4 accumulation steps, ``balanced`` at 2). It picks the precision (``MemoryPrecision``: bf16/fp16 AMP on
    GPUs, fp32 on CPU), TF32, allocator settings and gradient checkpointing. An explicit ``train_precision`` wins
    over the preset's choice. The preset's monitoring callbacks are left out here: :func:`memory_callbacks` adds
    them with this script's settings.

    With ``auto_micro_batch`` the effective batch is the same, but the DataLoader yields the whole per-device batch,
    ``accumulate_grad_batches`` is 1 and ``AutoMicroBatch`` (``MemoryPreset(auto_micro_batch=True)``) splits each
    batch into micro-batches, starting at the micro-batch the run would have used (the whole batch when the preset
    would have picked it) and halving on out-of-memory.

    Returns:
        The Trainer kwargs (``plugins`` or ``precision``, ``accumulate_grad_batches``, ``callbacks`` and
        ``gradient_clip_val``), the DataLoader's batch size per device (the micro-batch, or the whole per-device
        batch with ``auto_micro_batch``), and the preset's name.
    """
    from lightning_memopt import AutoMicroBatch, GradientCheckpointing, MemoryPreset

    precision = _precision_mode(train_precision)
    if effective_batch_size is not None:
        if accumulate_grad_batches is not None and batch_size is not None:
            implied = batch_size * num_devices * accumulate_grad_batches
            if implied != effective_batch_size:
                raise SystemExit(
                    f"error: `--accumulate_grad_batches` {accumulate_grad_batches} x --batch_size {batch_size} x"
                    f" --num_devices {num_devices} = {implied} contradicts --effective_batch_size"
                    f" {effective_batch_size}. Pass one of them."
                )
        elif accumulate_grad_batches is not None:
            if effective_batch_size % (num_devices * accumulate_grad_batches):
                raise SystemExit(
                    f"error: `--effective_batch_size` {effective_batch_size} is not a multiple of --num_devices x"
                    f" --accumulate_grad_batches = {num_devices * accumulate_grad_batches}."
                )
            batch_size = effective_batch_size // (num_devices * accumulate_grad_batches)
    if preset == "none":
        batch_size = batch_size or (effective_batch_size // num_devices if effective_batch_size else DEFAULT_BATCH_SIZE)
        accumulate = accumulate_grad_batches or 1
        if effective_batch_size is not None:
            if effective_batch_size % (batch_size * num_devices):
                raise SystemExit(
                    f"error: `--effective_batch_size` {effective_batch_size} is not a multiple of --batch_size x"
                    f" --num_devices = {batch_size * num_devices}. Pick an effective batch that is, or change"
                    " --batch_size."
                )
            accumulate = effective_batch_size // (batch_size * num_devices)
        callbacks: list[Callback] = [GradientCheckpointing()] if gradient_checkpointing else []
        if auto_micro_batch:  # no preset: AutoMicroBatch directly, with the same effective batch
            callbacks.append(AutoMicroBatch(micro_batch_size=batch_size))
            batch_size, accumulate = batch_size * accumulate, 1
        return (
            {"accumulate_grad_batches": accumulate, "precision": precision or "32-true", "callbacks": callbacks},
            batch_size,
            "none",
        )
    if effective_batch_size is None:
        batch_size = batch_size or DEFAULT_BATCH_SIZE
        effective_batch_size = batch_size * num_devices * (accumulate_grad_batches or 1)
    overrides: dict[str, Any] = {
        "monitor": False,
        "cache_clean_on_phase_end": False,
        "gc_every_n_steps": 0,
        "effective_batch_size": effective_batch_size,
        "micro_batch_size": batch_size,
        "devices": num_devices,
        "auto_micro_batch": auto_micro_batch,
    }
    if gradient_checkpointing:
        overrides["gradient_checkpointing"] = True
    if precision is not None and precision != "64-true":
        overrides["precision"] = precision
    on_gpu = accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available()
    try:  # a split of the effective batch that does not divide: the message names valid sizes
        if preset == "auto" and on_gpu:
            memory_preset = MemoryPreset.for_device(**overrides)  # by the GPU's size
        else:
            memory_preset = MemoryPreset.from_name("balanced" if preset == "auto" else preset, **overrides)
        kwargs = memory_preset.trainer_kwargs()
    except ValueError as err:
        raise SystemExit(f"error: {err}") from err
    for key in ("devices", "num_nodes"):  # the script passes these itself (same values)
        kwargs.pop(key, None)
    if precision == "64-true":  # not a MemoryPrecision mode: plain Lightning precision instead of the plugin
        kwargs["plugins"] = [p for p in kwargs.get("plugins", []) if not isinstance(p, pl.plugins.Precision)]
        kwargs["precision"] = precision
    name = memory_preset.name + (f" (tier {memory_preset.tier})" if memory_preset.tier else "")
    return kwargs, int(memory_preset.batch_size or batch_size or DEFAULT_BATCH_SIZE), name


def memory_trainer_kwargs(args: argparse.Namespace) -> dict[str, Any]:
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
    )
    args.batch_size = batch_size
    args.preset_name = name
    return kwargs


def memory_callbacks(args: argparse.Namespace) -> list[Callback]:
    """Wiring point of the package's callbacks (all on by default; ``--no_memory_callbacks`` removes them).

    They write to ``<run directory>/memory`` (``memory_rank<r>.jsonl``; OOM reports too, if one happens).
    """
    if args.no_memory_callbacks:
        return []
    import lightning_memopt as lm

    return [
        lm.MemoryMonitor(log_every_n_steps=args.memory_log_every_n_steps),
        lm.CacheCleaner(every_n_train_batches=50),
        lm.GarbageCollector(every_n_steps=25, generation=1),
        lm.OOMReporter(),
        lm.MemoryAudit(),
    ]


class ValidationPrinter(Callback):
    """One line per validation on rank zero (used when the progress bar is off, e.g. output to a file)."""

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        m = trainer.callback_metrics
        if "val_loss" in m and "val_baseline_loss" in m:
            val, base = float(m["val_loss"]), float(m["val_baseline_loss"])
            print(
                f"epoch {trainer.current_epoch} step {trainer.global_step}: val_loss {val:.4f}"
                f" (mean-prediction baseline {base:.4f}, ratio {val / base:.2f})",
                flush=True,
            )


def _auto_micro_batch(trainer: pl.Trainer) -> Any:
    from lightning_memopt import AutoMicroBatch

    return next((cb for cb in trainer.callbacks if isinstance(cb, AutoMicroBatch)), None)


def _memory_dir(trainer: pl.Trainer) -> Path | None:
    from lightning_memopt import MemoryMonitor

    for cb in trainer.callbacks:
        if isinstance(cb, MemoryMonitor) and cb.path is not None:
            return cb.path.parent
    return None


def _plot_hint(device: str) -> str:
    if device.startswith("cpu"):
        what = (
            "the process's host memory (RSS) over time: a CPU gives no allocator figures. The climb in the first"
            " seconds is the data, model, optimizer state and first batches arriving; a flat line afterwards means"
            " nothing accumulates from step to step"
        )
    else:
        what = (
            "allocated, reserved and peak device memory over time per rank (device total dashed or noted in the"
            " title); allocated is what tensors use, reserved what the caching allocator holds"
        )
    return f"the plot shows {what}. Shaded spans are the train and validation phases."


def _python() -> str:
    """This interpreter, relative to the working directory when it lies below it (``.venv/bin/python``)."""
    exe = Path(sys.executable)
    try:
        return str(exe.relative_to(Path.cwd()))
    except ValueError:
        return str(exe)


def report(trainer: pl.Trainer, checkpoint: ModelCheckpoint | None = None) -> str:
    """Wiring point of ``lightning_memopt.analysis``: the text printed at the end (rank zero).

    Summarises the memory logs of every rank, writes ``memory_timeline.png`` next to them, and says where the
    checkpoints, metrics and memory files are.
    """
    # Not trainer.log_dir: that is a collective under DDP, and this runs on rank zero only.
    run_dir = trainer.logger.log_dir if trainer.logger is not None else trainer.default_root_dir
    lines = ["", f"run directory: {run_dir}"]
    metrics = trainer.callback_metrics
    if "val_loss" in metrics and "val_baseline_loss" in metrics:
        val, base = float(metrics["val_loss"]), float(metrics["val_baseline_loss"])
        verdict = "it learned" if val <= 0.5 * base else "not yet at half the baseline"
        lines.append(
            f"validation loss {val:.4f} vs mean-prediction baseline {base:.4f} (ratio {val / base:.2f}: {verdict})"
        )
    if checkpoint is not None and checkpoint.dirpath:
        lines.append(f"checkpoints:   {checkpoint.dirpath} (best: {Path(checkpoint.best_model_path).name or 'none'})")
    if trainer.logger is not None and trainer.logger.log_dir:
        lines.append(f"metrics:       {Path(trainer.logger.log_dir) / 'metrics.csv'}")
    auto = _auto_micro_batch(trainer)
    if auto is not None and auto.micro_batch_size is not None:
        lines.append(
            f"micro-batch:   {auto.micro_batch_size} at the end ({auto.retries} halving(s) after out-of-memory)"
        )
    memory_dir = _memory_dir(trainer)
    logs = sorted(memory_dir.glob("memory_rank*.jsonl")) if memory_dir is not None else []
    if logs:
        from lightning_memopt.analysis import analyze_memory_logs

        plot = memory_dir / "memory_timeline.png"
        lines.append(f"memory log:    {', '.join(str(p) for p in logs)}")
        try:
            summaries, text = analyze_memory_logs(logs, plot=plot)
            lines.append(f"memory plot:   {plot}")
            hint = _plot_hint(next((s.device for s in summaries if s.device), "cpu"))
            lines.extend(textwrap.wrap(hint, width=116, initial_indent="  ", subsequent_indent="  "))
        except ImportError:
            _, text = analyze_memory_logs(logs)
            lines.append("memory plot:   none (install matplotlib: pip install matplotlib)")
        text = text.split("\nplot: ")[0]
        lines.append("memory summary:")
        lines.append(text)
        lines.append(
            f"re-run the analysis: {_python()} -m lightning_memopt.cli analyze {memory_dir}/memory_rank*.jsonl"
            f" --plot {plot}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> pl.Trainer:
    """Parse ``argv``, train, and print the report on rank zero. Returns the trainer."""
    args = build_parser().parse_args(argv)
    _check_args(args)
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


def _run(args: argparse.Namespace) -> pl.Trainer:
    pl.seed_everything(args.seed, workers=True, verbose=False)
    out = Path(args.output_dir)
    trainer_kwargs = memory_trainer_kwargs(args)
    datamodule = SpectraDataModule(
        data_path=args.data_path,
        num_spectra=args.num_spectra,
        batch_size=args.batch_size,
        max_peaks_n=args.max_peaks_n,
        num_workers_data=args.num_workers_data,
        in_mem=args.in_mem,
        dynamic_padding=args.dynamic_padding,
        seed=args.seed,
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
    # dirpath=None: <run directory>/checkpoints, the same directory on every rank.
    checkpoint = ModelCheckpoint(monitor="val_loss", mode="min", save_top_k=args.save_top_k, save_last=True)
    periodic = (
        []
        if not args.every_n_train_steps
        else [
            ModelCheckpoint(
                every_n_train_steps=args.every_n_train_steps,
                save_top_k=-1,
                filename="step={step}",
                auto_insert_metric_name=False,
            )
        ]
    )
    progress_bar = sys.stdout.isatty() if args.progress_bar is None else args.progress_bar
    extra_callbacks = trainer_kwargs.pop("callbacks", [])
    optional = {
        k: v
        for k, v in {
            "limit_train_batches": args.limit_train_batches,
            "limit_val_batches": args.limit_val_batches,
            "val_check_interval": args.val_check_interval,
            "num_sanity_val_steps": args.num_sanity_val_steps,
        }.items()
        if v is not None
    }
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.num_devices,
        strategy=_strategy(args),
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
        default_root_dir=str(out),
        logger=CSVLogger(str(out), name=""),
        callbacks=[
            checkpoint,
            *periodic,
            *memory_callbacks(args),
            *extra_callbacks,
            *([] if progress_bar else [ValidationPrinter()]),
        ],
        log_every_n_steps=10,
        enable_model_summary=False,
        enable_progress_bar=progress_bar,
        **optional,
        **trainer_kwargs,
    )
    if trainer.is_global_zero:
        n_params = sum(p.numel() for p in model.parameters())
        auto = _auto_micro_batch(trainer)
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
