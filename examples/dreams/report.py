"""What ``examples/dreams/train.py`` and ``cli.py`` print: one line per validation and the report at the end."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from typing_extensions import override

__all__ = ["ValidationPrinter", "auto_micro_batch_of", "report"]


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


def auto_micro_batch_of(trainer: pl.Trainer) -> Any:
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
    auto = auto_micro_batch_of(trainer)
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
