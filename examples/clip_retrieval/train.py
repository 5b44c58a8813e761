"""CLIP-style multitask video-text retrieval with lightning-memopt, on synthetic clips and repeated captions.

Run from the repository root (CPU, under a minute):

    python examples/clip_retrieval/train.py

A video tower (per-frame MLP + pooling) and a text tower (mean of token embeddings + MLP) are trained with a
symmetric InfoNCE loss and a learned temperature, plus a caption-category head on the video embedding. Validation
ranks every validation clip against every distinct caption with ``StreamingRetrievalMetric`` and logs R@1/5/10,
MedR and MeanR in both directions. At the end the script prints the retrieval numbers next to chance, how much
memory the similarity matrix would have needed, what the metric really used, and where the logs are.

The metric at the scale of the run this example is modelled on (117,120 clips, 23,592 distinct captions): a short
training (200 steps) and validation over every clip, i.e. 117,120 x 23,592 scores that are never held at once
(about a minute on a 2-core CPU; the dense float32 matrix would need 10.3 GiB, 51.1 GiB without caption
deduplication):

    python examples/clip_retrieval/train.py --num_samples 117120 --num_unique_texts 23592 --max_epochs 1 \
        --max_steps 200 --limit_train_batches 200 --metric_budget_bytes 67108864

Memory flags: ``--preset`` (precision and gradient accumulation through ``MemoryPreset``),
``--effective_batch_size``, ``--metric_budget_bytes`` (the metric's ``memory_budget_bytes``). Every callback of
the package is on by default (``--no_memory_callbacks`` removes them).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

from examples.clip_retrieval.data import chance_recall_at_k
from examples.clip_retrieval.module import ClipRetrievalDataModule, ClipRetrievalModule

__all__ = ["build_parser", "main", "memory_callbacks", "memory_trainer_kwargs", "naive_matrix_bytes", "report"]

MEMORY_PRESETS = ("max-savings", "balanced", "max-speed", "none")
TOP_K = (1, 5, 10)
#: Blocks recomputed in backward when the preset turns gradient checkpointing on (``max-savings``): the per-frame
#: MLP holds the largest activations (batch x frames x hidden).
CHECKPOINT_MODULES = ("video_tower.frame_mlp", "text_tower.mlp")
_PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}


def build_parser() -> argparse.ArgumentParser:
    """The command line: data, model, training and memory flags."""
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    g = p.add_argument_group("data")
    g.add_argument("--num_samples", type=int, default=10_000, help="validation clips (rows); all are evaluated")
    g.add_argument("--num_unique_texts", type=int, default=2000, help="distinct captions shared by the rows")
    g.add_argument("--num_train_samples", type=int, default=None, help="training clips (default: --num_samples)")
    g.add_argument("--max_frames", type=int, default=8, help="frames kept per clip (raw clips have 1-24)")
    g.add_argument("--frame_dim", type=int, default=48, help="features per frame")
    g.add_argument("--max_tokens", type=int, default=16, help="longest caption, in tokens")
    g.add_argument("--vocab_size", type=int, default=1000, help="token vocabulary (id 0 is padding)")
    g.add_argument("--latent_dim", type=int, default=32, help="size of the hidden vector behind each caption")
    g.add_argument("--num_categories", type=int, default=10, help="caption categories (the second task)")
    g.add_argument("--noise_std", type=float, default=1.0, help="per-frame noise (the signal has about unit scale)")
    g.add_argument("--distractor_prob", type=float, default=0.2, help="probability that a frame is noise only")
    g.add_argument("--num_workers", type=int, default=0, help="DataLoader workers")
    g = p.add_argument_group("model")
    g.add_argument("--pooling", choices=("mean", "attention"), default="mean", help="frame pooling of the video tower")
    g.add_argument("--hidden_dim", type=int, default=128, help="width of both towers")
    g.add_argument("--embed_dim", type=int, default=64, help="size of the shared embedding")
    g.add_argument("--category_weight", type=float, default=0.5, help="weight of the category loss")
    g.add_argument("--temperature", type=float, default=0.07, help="initial contrastive temperature (learned)")
    g = p.add_argument_group("training")
    g.add_argument("--batch_size", type=int, default=256, help="micro-batch size per device")
    g.add_argument("--val_batch_size", type=int, default=None, help="validation batch (default: max(batch, 512))")
    g.add_argument("--lr", type=float, default=2e-3)
    g.add_argument("--max_epochs", type=int, default=3)
    g.add_argument("--max_steps", type=int, default=-1, help="stop after this many optimizer steps (-1: no limit)")
    g.add_argument("--limit_train_batches", type=float, default=None, help="fraction or number of train batches")
    g.add_argument(
        "--limit_val_batches",
        type=float,
        default=None,
        help="fraction or number of val batches (default: all, i.e. the full retrieval problem)",
    )
    g.add_argument("--eval_only", action="store_true", help="skip training: validate the freshly built model")
    g.add_argument("--num_devices", type=int, default=1, help="devices (DDP when > 1; CPU processes without a GPU)")
    g.add_argument("--accelerator", default="auto", help="cpu, gpu or auto")
    g.add_argument(
        "--cpu_threads",
        type=int,
        default=None,
        help="torch intra-op threads when running on CPU (default 1: these tiny towers gain nothing from"
        " more and lose a lot when cores are shared); restored at the end",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the data and of the model")
    g.add_argument("--root", default="runs/clip_retrieval", help="logs and memory logs go here")
    g = p.add_argument_group("memory")
    g.add_argument(
        "--preset",
        choices=MEMORY_PRESETS,
        default="balanced",
        help="memory preset: decides precision and gradient accumulation ('none': plain fp32)",
    )
    g.add_argument("--precision", default=None, help="32, 16-mixed, bf16-mixed, ...; overrides the preset's choice")
    g.add_argument(
        "--effective_batch_size",
        type=int,
        default=None,
        help="samples per optimizer step over all devices; accumulation is derived from it",
    )
    g.add_argument(
        "--metric_budget_bytes",
        type=int,
        default=2**31,
        help="working-set budget of one block of the retrieval metric (its `memory_budget_bytes`)",
    )
    g.add_argument("--memory_log_every_n_steps", type=int, default=10, help="memory reading interval")
    g.add_argument("--no_memory_callbacks", action="store_true", help="run without the package's callbacks")
    g.add_argument(
        "--plot",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="draw the memory timeline (needs matplotlib)",
    )
    g.add_argument("--progress_bar", action=argparse.BooleanOptionalAction, default=True, help="show progress bars")
    return p


def _check_args(args: argparse.Namespace) -> None:
    for name in (
        "num_samples",
        "num_unique_texts",
        "batch_size",
        "num_devices",
        "max_frames",
        "frame_dim",
        "max_tokens",
        "embed_dim",
        "hidden_dim",
        "metric_budget_bytes",
        "memory_log_every_n_steps",
    ):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: `--{name}` must be a positive int, got {getattr(args, name)}.")
    if args.num_samples < args.num_unique_texts:
        raise SystemExit(
            f"error: `--num_samples` {args.num_samples} is smaller than `--num_unique_texts` "
            f"{args.num_unique_texts}; every caption needs at least one clip."
        )
    if args.num_workers < 0:
        raise SystemExit(f"error: `--num_workers` must be >= 0, got {args.num_workers}.")


def _accumulation(args: argparse.Namespace) -> int:
    per_step = args.batch_size * args.num_devices
    if args.effective_batch_size is None:
        return 1
    if args.effective_batch_size % per_step:
        raise SystemExit(
            f"error: `--effective_batch_size` {args.effective_batch_size} is not a multiple of --batch_size x "
            f"--num_devices = {per_step}. Pick an effective batch that is, or change --batch_size."
        )
    return args.effective_batch_size // per_step


def memory_trainer_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Wiring point of ``MemoryPreset``: the Trainer kwargs that decide precision and gradient accumulation.

    The preset keeps the effective batch (``--effective_batch_size``) while the micro-batch is ``--batch_size`` and
    picks the precision (``MemoryPrecision``: bf16/fp16 AMP on GPUs, fp32 on CPU) and, with ``max-savings``,
    checkpoints ``CHECKPOINT_MODULES``. ``--precision`` wins over the preset's choice. The preset's own monitoring
    callbacks are left out: ``memory_callbacks`` adds them with this script's settings.
    """
    from lightning_memopt import MemoryPreset

    accumulate = _accumulation(args)
    precision = None if args.precision is None else _PRECISION_ALIASES.get(str(args.precision), str(args.precision))
    if args.preset == "none":
        return {"accumulate_grad_batches": accumulate, "precision": precision or "32-true"}
    overrides: dict[str, Any] = {
        "monitor": False,
        "cache_clean_on_phase_end": False,
        "gc_every_n_steps": 0,
        "checkpoint_modules": CHECKPOINT_MODULES,
    }
    if precision is not None:
        overrides["precision"] = precision
    try:
        effective = args.batch_size * args.num_devices * accumulate
        preset = MemoryPreset.from_name(
            args.preset,
            effective_batch_size=effective,
            micro_batch_size=args.batch_size,
            devices=args.num_devices,
            **overrides,
        )
    except ValueError as err:
        raise SystemExit(f"error: {err}") from err
    kwargs = preset.trainer_kwargs()
    for key in ("devices", "num_nodes"):  # the script passes these itself (same values)
        kwargs.pop(key, None)
    return kwargs


def memory_callbacks(args: argparse.Namespace, memory_dir: Path) -> list[Callback]:
    """Wiring point of the package's callbacks (all on by default; ``--no_memory_callbacks`` removes them)."""
    if args.no_memory_callbacks:
        return []
    import lightning_memopt as lm

    return [
        lm.MemoryMonitor(dirpath=memory_dir, log_every_n_steps=args.memory_log_every_n_steps),
        lm.CacheCleaner(every_n_train_batches=50),
        lm.GarbageCollector(every_n_steps=25, generation=1),
        lm.OOMReporter(dirpath=memory_dir),
        lm.MemoryAudit(dirpath=memory_dir),
    ]


def naive_matrix_bytes(num_videos: int, num_texts: int, bytes_per_score: int = 4) -> int:
    """Bytes of a dense ``num_videos x num_texts`` score matrix (float32 by default).

    Example:
        >>> naive_matrix_bytes(117_120, 117_120) / 2**30 > 51
        True
    """
    return num_videos * num_texts * bytes_per_score


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _fraction(x: float) -> str:
    return f"{x:.1e}" if 0 < x < 1e-3 else f"{x:.4f}"


def _chance(datamodule: ClipRetrievalDataModule) -> dict[str, float]:
    """Expected R@K of a random ranking under the metric's protocol (deduplicated captions)."""
    assert datamodule.val_set is not None
    captions = datamodule.val_set.caption_ids
    n_videos, n_texts = captions.size, int(np.unique(captions).size)
    per_text = np.bincount(captions)
    per_text = per_text[per_text > 0]
    out = {}
    for k in TOP_K:
        out[f"v2t/R@{k}"] = chance_recall_at_k(np.ones(n_videos), n_texts, k)
        out[f"t2v/R@{k}"] = chance_recall_at_k(per_text, n_videos, k)
    return out


def report(summary: dict[str, Any]) -> str:
    """The text printed at the end (rank zero): retrieval vs chance, matrix sizes vs measured memory, paths."""
    lines = [""]
    metrics, chance, cost = summary["metrics"], summary["chance"], summary["metric_compute"]
    if cost:
        lines.append(f"retrieval on {cost['num_videos']:,} clips x {cost['num_unique_texts']:,} distinct captions:")
    for direction in ("v2t", "t2v"):
        parts = [
            f"R@{k} {metrics.get(f'val/{direction}/R@{k}', float('nan')):.4f} "
            f"(chance {_fraction(chance.get(f'{direction}/R@{k}', float('nan')))})"
            for k in TOP_K
        ]
        parts += [
            f"MedR {metrics.get(f'val/{direction}/MedR', float('nan')):.0f}",
            f"MeanR {metrics.get(f'val/{direction}/MeanR', float('nan')):.1f}",
        ]
        lines.append(f"  {direction}: " + ", ".join(parts))
    if "val/category_acc" in metrics:
        lines.append(f"  category accuracy (second task): {metrics['val/category_acc']:.4f}")
    if cost:
        n, u = cost["num_videos"], cost["num_unique_texts"]
        lines.append("similarity matrix if materialised (float32):")
        lines.append(f"  {n:,} x {n:,} (captions not deduplicated): {_size(summary['naive_matrix_bytes'])}")
        lines.append(f"  {n:,} x {u:,} (deduplicated captions):     {_size(summary['naive_dedup_matrix_bytes'])}")
        bv, bt = cost["block_sizes"]
        lines.append(
            f"StreamingRetrievalMetric.compute(): {cost['seconds']:.1f} s, blocks of {bv} x {bt}, budget "
            f"{_size(cost['budget_bytes'])} (planned working set {_size(cost['planned_working_set_bytes'])})"
        )
        growth = cost["rss_growth_bytes"]
        ratio = (
            f"; {summary['naive_dedup_matrix_bytes'] / growth:.0f}x less than the deduplicated matrix"
            if growth >= 2**20
            else ""
        )
        lines.append(
            f"  features held on CPU: {_size(cost['stored_feature_bytes_this_rank'])}; peak RSS growth during "
            f"compute: {_size(growth)} (RSS {_size(cost['rss_start_bytes'])} -> peak "
            f"{_size(cost['rss_peak_bytes'])}){ratio}"
        )
    lines.append(f"logs:         {summary['log_dir']}")
    logs = [Path(p) for p in summary["memory_logs"]]
    if logs:
        from lightning_memopt.analysis import analyze_memory_logs

        plot = logs[0].parent / "memory_timeline.png" if summary["plot"] else None
        lines.append(f"memory log:   {', '.join(str(p) for p in logs)}")
        try:
            _, text = analyze_memory_logs(logs, plot=plot)
        except ImportError:
            _, text = analyze_memory_logs(logs)
            text += "\n(no plot: install matplotlib)"
        lines.append("memory summary:")
        lines.append(text.replace("\nplot: ", "\nmemory plot:  "))
    lines.append(f"wall time:    {summary['wall_seconds']:.1f} s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse ``argv``, train, validate and print the report on rank zero.

    Returns:
        A summary: ``metrics`` (every logged value as a float, e.g. ``val/t2v/R@5``), ``chance`` (R@K of a random
        ranking), ``metric_compute`` (sizes, seconds and memory of the last retrieval ``compute``),
        ``naive_matrix_bytes`` / ``naive_dedup_matrix_bytes`` (the dense float32 score matrix without / with caption
        deduplication), ``memory_logs``, ``log_dir``, ``root``, ``wall_seconds`` and ``trainer``.
    """
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


def _run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    pl.seed_everything(args.seed, workers=True, verbose=False)
    root = Path(args.root)
    memory_dir = root / "memory"
    datamodule = ClipRetrievalDataModule(
        num_samples=args.num_samples,
        num_unique_texts=args.num_unique_texts,
        num_train_samples=args.num_train_samples,
        batch_size=args.batch_size,
        val_batch_size=args.val_batch_size,
        num_workers=args.num_workers,
        max_frames=args.max_frames,
        frame_dim=args.frame_dim,
        max_tokens=args.max_tokens,
        vocab_size=args.vocab_size,
        latent_dim=args.latent_dim,
        num_categories=args.num_categories,
        noise_std=args.noise_std,
        distractor_prob=args.distractor_prob,
        seed=args.seed,
    )
    model = ClipRetrievalModule(
        frame_dim=args.frame_dim,
        vocab_size=args.vocab_size,
        num_categories=args.num_categories,
        hidden_dim=args.hidden_dim,
        embed_dim=args.embed_dim,
        pooling=args.pooling,
        lr=args.lr,
        category_weight=args.category_weight,
        init_temperature=args.temperature,
        metric_budget_bytes=args.metric_budget_bytes,
        top_k=TOP_K,
    )
    trainer_kwargs = memory_trainer_kwargs(args)
    extra_callbacks = trainer_kwargs.pop("callbacks", [])
    optional = {
        k: v
        for k, v in {
            "limit_train_batches": args.limit_train_batches,
            "limit_val_batches": args.limit_val_batches,
        }.items()
        if v is not None
    }
    for k, v in optional.items():
        optional[k] = int(v) if float(v).is_integer() and v >= 1 else float(v)
    logger = CSVLogger(str(root), name="logs")
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=args.num_devices,
        strategy="ddp" if args.num_devices > 1 else "auto",
        max_epochs=args.max_epochs,
        max_steps=args.max_steps,
        default_root_dir=str(root),
        logger=logger,
        callbacks=[*memory_callbacks(args, memory_dir), *extra_callbacks],
        log_every_n_steps=10,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=args.progress_bar,
        **optional,
        **trainer_kwargs,
    )
    if trainer.is_global_zero:
        n_params = sum(p.numel() for p in model.parameters())
        print(
            f"{n_params / 1e6:.2f}M parameters; precision {trainer.precision}; micro-batch {args.batch_size} x "
            f"{trainer.accumulate_grad_batches} accumulation x {trainer.world_size} devices; "
            f"{args.num_samples:,} validation clips over {args.num_unique_texts:,} captions",
            flush=True,
        )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        if not args.eval_only:
            trainer.fit(model, datamodule=datamodule)
        if args.eval_only or model.last_eval_step != trainer.global_step:  # training stopped between validations
            trainer.validate(model, datamodule=datamodule, verbose=False)
    if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()  # every rank's memory log is complete before rank zero reads them
    cost = model.retrieval_compute
    n_videos = cost.get("num_videos", 0)
    summary: dict[str, Any] = {
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1},
        "chance": _chance(datamodule),
        "metric_compute": cost,
        "naive_matrix_bytes": naive_matrix_bytes(n_videos, n_videos),
        "naive_dedup_matrix_bytes": naive_matrix_bytes(n_videos, cost.get("num_unique_texts", 0)),
        "memory_logs": [str(p) for p in sorted(memory_dir.glob("memory_rank*.jsonl"))],
        "log_dir": logger.log_dir,
        "root": str(root),
        "plot": args.plot,
        "trainer": trainer,
    }
    summary["wall_seconds"] = time.perf_counter() - started
    if trainer.is_global_zero:
        print(report(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
