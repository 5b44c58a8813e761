"""DreaMS-style fine-tuning with lightning-memopt: a transformer over MS/MS spectra, on synthetic data.

Run from the repository root (CPU, about a minute):

    python examples/dreams/train.py

At the end it prints where the memory log, the memory plot and the checkpoints are, and the memory summary.
On a GPU, the DreaMS-sized model with the package's strongest memory savings at an effective batch of 256:

    python examples/dreams/train.py --model_preset dreams-base --preset max-savings --batch_size 32 \
        --effective_batch_size 256 --max_steps 50

Flags are named as DreaMS users know them (``--batch_size``, ``--max_peaks_n``, ``--train_precision``,
``--num_devices``, ``--lr``, ``--max_epochs``, ``--val_check_interval``, ``--save_top_k``, ``--num_workers_data``,
...) plus the memory ones (``--preset``, ``--effective_batch_size``, ``--accumulate_grad_batches``,
``--limit_val_batches``, ``--every_n_train_steps``, ``--gradient_checkpointing``, ``--dynamic_padding``).

Each part of lightning-memopt is wired in exactly one function below: ``memory_trainer_kwargs`` (the preset:
precision and accumulation), ``memory_callbacks`` (every callback of the package) and ``report`` (the summary
and plot of the memory log).
"""

from __future__ import annotations

import argparse
import sys
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

from examples.dreams.model import MODEL_PRESETS
from examples.dreams.module import SpectraDataModule, SpectraFineTuner

__all__ = ["build_parser", "main", "memory_callbacks", "memory_trainer_kwargs", "report"]

MEMORY_PRESETS = ("max-savings", "balanced", "max-speed", "none")


def build_parser() -> argparse.ArgumentParser:
    """The command line: DreaMS-style flags plus the memory flags of this package."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--data_path", default="data/dreams_synthetic.hdf5", help="HDF5 spectra file (generated if missing)")
    g.add_argument("--num_spectra", type=int, default=4000, help="spectra to generate when --data_path is missing")
    g.add_argument("--max_peaks_n", type=int, default=100, help="most intense peaks kept per spectrum")
    g.add_argument("--num_workers_data", type=int, default=0, help="DataLoader workers (each opens the HDF5 lazily)")
    g.add_argument("--in_mem", action="store_true", help="read the data into RAM instead of lazily")
    g.add_argument("--dynamic_padding", action=argparse.BooleanOptionalAction, default=True,
                   help="pad each batch to its longest spectrum (--no-dynamic_padding: always to max_peaks_n)")
    g = p.add_argument_group("model")
    g.add_argument("--model_preset", choices=tuple(MODEL_PRESETS), default="tiny", help="model size")
    g.add_argument("--d_fourier", type=int, default=None, help="override the preset's Fourier width")
    g.add_argument("--d_peak", type=int, default=None, help="override the preset's peak-MLP width")
    g.add_argument("--n_layers", type=int, default=None, help="override the preset's encoder layers")
    g.add_argument("--n_heads", type=int, default=None, help="override the preset's attention heads")
    g.add_argument("--dropout", type=float, default=None, help="override the preset's dropout")
    g.add_argument("--pre_trained_pth", default=None, help="checkpoint to load the backbone from")
    g.add_argument("--unfreeze_backbone_at_epoch", type=int, default=0, help="train only the head before this epoch")
    g = p.add_argument_group("training")
    g.add_argument("--batch_size", type=int, default=32, help="micro-batch size per device")
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--max_epochs", type=int, default=3)
    g.add_argument("--max_steps", type=int, default=-1, help="stop after this many optimizer steps (-1: no limit)")
    g.add_argument("--limit_train_batches", type=float, default=None, help="fraction or number of train batches")
    g.add_argument("--val_check_interval", type=float, default=None,
                   help="validate every N train batches (or fraction)")
    g.add_argument("--limit_val_batches", type=float, default=None, help="fraction or number of val batches")
    g.add_argument("--save_top_k", type=int, default=1, help="best checkpoints kept (by val_loss)")
    g.add_argument("--every_n_train_steps", type=int, default=None, help="also checkpoint every N optimizer steps")
    g.add_argument("--num_devices", type=int, default=1, help="devices (DDP when > 1; CPU processes without a GPU)")
    g.add_argument("--accelerator", default="auto", help="cpu, gpu or auto")
    g.add_argument("--cpu_threads", type=int, default=None,
                   help="torch intra-op threads when training on CPU (default 1: tiny models gain nothing from more"
                        " and lose a lot when cores are shared); restored at the end")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--output_dir", default="runs/dreams", help="logs, memory logs, plot and checkpoints go here")
    g.add_argument("--no_wandb", action="store_true", help="accepted for DreaMS compatibility; logs go to CSV")
    g = p.add_argument_group("memory")
    g.add_argument("--preset", choices=MEMORY_PRESETS, default="balanced",
                   help="memory preset: decides precision and gradient accumulation ('none': only explicit flags)")
    g.add_argument("--train_precision", default=None,
                   help="precision (32, 64, 16-mixed, bf16-mixed, ...); overrides the preset's choice")
    g.add_argument("--effective_batch_size", type=int, default=None,
                   help="samples per optimizer step over all devices; accumulation is derived from it")
    g.add_argument("--accumulate_grad_batches", type=int, default=None, help="micro-batches per optimizer step")
    g.add_argument("--gradient_checkpointing", action="store_true", help="recompute encoder activations in backward")
    g.add_argument("--memory_log_every_n_steps", type=int, default=5, help="memory reading interval")
    g.add_argument("--no_memory_callbacks", action="store_true", help="run without the package's callbacks")
    return p


def _check_args(args: argparse.Namespace) -> None:
    for name in ("batch_size", "max_peaks_n", "num_devices", "num_spectra", "memory_log_every_n_steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: `--{name}` must be a positive int, got {getattr(args, name)}.")
    if args.num_workers_data < 0:
        raise SystemExit(f"error: `--num_workers_data` must be >= 0, got {args.num_workers_data}.")


def _accumulation(args: argparse.Namespace) -> int:
    """Micro-batches per optimizer step from ``--effective_batch_size`` or ``--accumulate_grad_batches``."""
    per_step = args.batch_size * args.num_devices
    if args.effective_batch_size is None:
        return args.accumulate_grad_batches or 1
    if args.effective_batch_size % per_step:
        raise SystemExit(
            f"error: `--effective_batch_size` {args.effective_batch_size} is not a multiple of --batch_size x "
            f"--num_devices = {per_step}. Pick an effective batch that is, or change --batch_size.")
    accumulate = args.effective_batch_size // per_step
    if args.accumulate_grad_batches not in (None, accumulate):
        raise SystemExit(
            f"error: `--accumulate_grad_batches` {args.accumulate_grad_batches} contradicts --effective_batch_size "
            f"{args.effective_batch_size} / (--batch_size x --num_devices = {per_step}) = {accumulate}. Pass one.")
    return accumulate


_PRECISION_ALIASES = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed"}


def memory_trainer_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Wiring point of ``MemoryPreset``: the Trainer kwargs that decide precision and accumulation.

    The preset keeps the effective batch (``--effective_batch_size``) while the micro-batch is ``--batch_size``,
    picks the precision (``MemoryPrecision``: bf16/fp16 AMP on GPUs, fp32 on CPU), TF32, allocator settings and
    gradient checkpointing. An explicit ``--train_precision`` wins over the preset's precision. The preset's
    monitoring callbacks are left out here: ``memory_callbacks`` adds them with this script's settings.
    """
    from lightning_memopt import MemoryPreset

    accumulate = _accumulation(args)
    precision = None if args.train_precision is None else _PRECISION_ALIASES.get(str(args.train_precision),
                                                                                  str(args.train_precision))
    if args.preset == "none":
        return {"accumulate_grad_batches": accumulate, "precision": precision or "32-true",
                "callbacks": _gradient_checkpointing(args)}
    overrides: dict[str, Any] = {"monitor": False, "cache_clean_on_phase_end": False, "gc_every_n_steps": 0}
    if args.gradient_checkpointing:
        overrides["gradient_checkpointing"] = True
    if precision is not None and precision != "64-true":
        overrides["precision"] = precision
    preset = MemoryPreset.from_name(args.preset, effective_batch_size=args.batch_size * args.num_devices * accumulate,
                                    micro_batch_size=args.batch_size, devices=args.num_devices, **overrides)
    kwargs = preset.trainer_kwargs()
    for key in ("devices", "num_nodes"):  # the script passes these itself (same values)
        kwargs.pop(key, None)
    if precision == "64-true":  # not a MemoryPrecision mode: plain Lightning precision instead of the plugin
        kwargs["plugins"] = [p for p in kwargs.get("plugins", []) if not isinstance(p, pl.plugins.Precision)]
        kwargs["precision"] = precision
    args.gradient_checkpointing = bool(preset.gradient_checkpointing)
    return kwargs


def _gradient_checkpointing(args: argparse.Namespace) -> list[Callback]:
    from lightning_memopt import GradientCheckpointing

    return [GradientCheckpointing()] if args.gradient_checkpointing else []


def memory_callbacks(args: argparse.Namespace, memory_dir: Path) -> list[Callback]:
    """Wiring point of the package's callbacks (all on by default; ``--no_memory_callbacks`` removes them)."""
    if args.no_memory_callbacks:
        return []
    import lightning_memopt as lm

    callbacks: list[Callback] = [
        lm.MemoryMonitor(dirpath=memory_dir, log_every_n_steps=args.memory_log_every_n_steps),
        lm.CacheCleaner(every_n_train_batches=50),
        lm.GarbageCollector(every_n_steps=25, generation=1),
        lm.OOMReporter(dirpath=memory_dir),
        lm.MemoryAudit(dirpath=memory_dir),
    ]
    return callbacks


def report(trainer: pl.Trainer, memory_dir: Path, checkpoint: ModelCheckpoint | None) -> str:
    """Wiring point of ``lightning_memopt.analysis``: the text printed at the end (rank zero)."""
    lines = [""]
    metrics = trainer.callback_metrics
    if "val_loss" in metrics and "val_baseline_loss" in metrics:
        val, base = float(metrics["val_loss"]), float(metrics["val_baseline_loss"])
        lines.append(f"validation loss {val:.4f} vs mean-prediction baseline {base:.4f} (ratio {val / base:.2f})")
    if checkpoint is not None:
        lines.append(f"checkpoints:  {checkpoint.dirpath} (best: {checkpoint.best_model_path or 'none yet'})")
    logs = sorted(memory_dir.glob("memory_rank*.jsonl"))
    if logs:
        from lightning_memopt.analysis import analyze_memory_logs

        plot = memory_dir / "memory_timeline.png"
        lines.append(f"memory log:   {', '.join(str(p) for p in logs)}")
        try:
            _, text = analyze_memory_logs(logs, plot=plot)
        except ImportError:
            _, text = analyze_memory_logs(logs)
            text += "\n(no plot: install matplotlib)"
        text = text.replace("\nplot: ", "\nmemory plot:  ")
        lines.append("memory summary:")
        lines.append(text)
        lines.append(f"re-run the analysis: python -m lightning_memopt.cli analyze {memory_dir}/memory_rank*.jsonl "
                     f"--plot {plot}")
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


def _run(args: argparse.Namespace) -> pl.Trainer:
    pl.seed_everything(args.seed, workers=True, verbose=False)
    out = Path(args.output_dir)
    memory_dir = out / "memory"
    datamodule = SpectraDataModule(data_path=args.data_path, num_spectra=args.num_spectra, batch_size=args.batch_size,
                                   max_peaks_n=args.max_peaks_n, num_workers_data=args.num_workers_data,
                                   in_mem=args.in_mem, dynamic_padding=args.dynamic_padding, seed=args.seed)
    trainer_kwargs = memory_trainer_kwargs(args)
    model = SpectraFineTuner(model_preset=args.model_preset, d_fourier=args.d_fourier, d_peak=args.d_peak,
                             n_layers=args.n_layers, n_heads=args.n_heads, dropout=args.dropout, lr=args.lr,
                             pre_trained_pth=args.pre_trained_pth,
                             unfreeze_backbone_at_epoch=args.unfreeze_backbone_at_epoch,
                             gradient_checkpointing=args.gradient_checkpointing)
    checkpoint = ModelCheckpoint(dirpath=out / "checkpoints", monitor="val_loss", mode="min",
                                 save_top_k=args.save_top_k, save_last=True,
                                 every_n_train_steps=args.every_n_train_steps)
    extra_callbacks = trainer_kwargs.pop("callbacks", [])
    optional = {k: v for k, v in {"limit_train_batches": args.limit_train_batches,
                                  "limit_val_batches": args.limit_val_batches,
                                  "val_check_interval": args.val_check_interval}.items() if v is not None}
    for k, v in optional.items():
        optional[k] = int(v) if float(v).is_integer() and v >= 1 else float(v)
    strategy = "ddp" if args.num_devices > 1 else "auto"
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=args.num_devices, strategy=strategy, max_epochs=args.max_epochs,
        max_steps=args.max_steps, default_root_dir=str(out), logger=CSVLogger(str(out), name="logs"),
        callbacks=[checkpoint, *memory_callbacks(args, memory_dir), *extra_callbacks], log_every_n_steps=10,
        enable_model_summary=False, **optional, **trainer_kwargs,
    )
    if trainer.is_global_zero:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"model {args.model_preset}: {n_params / 1e6:.2f}M parameters; precision {trainer.precision}; "
              f"micro-batch {args.batch_size} x {trainer.accumulate_grad_batches} accumulation x {trainer.world_size} "
              f"devices = effective batch {args.batch_size * trainer.accumulate_grad_batches * trainer.world_size}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.fit(model, datamodule=datamodule)
    if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank's memory log is complete before rank zero reads them
    if trainer.is_global_zero:
        print(report(trainer, memory_dir, checkpoint), flush=True)
    return trainer


if __name__ == "__main__":
    main()
