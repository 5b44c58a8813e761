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
import torch
from lightning.pytorch.loggers import CSVLogger

from examples.clip_retrieval.chance import chance_recalls
from examples.clip_retrieval.cli import MEMORY_PRESETS, build_parser, check_args
from examples.clip_retrieval.module import ClipRetrievalDataModule, ClipRetrievalModule
from examples.clip_retrieval.report import TOP_K, naive_matrix_bytes, report
from examples.clip_retrieval.wiring import CHECKPOINT_MODULES, memory_callbacks, memory_trainer_kwargs

__all__ = ["build_parser", "main", "memory_callbacks", "memory_trainer_kwargs", "naive_matrix_bytes", "report"]
__all__ += ["CHECKPOINT_MODULES", "MEMORY_PRESETS", "TOP_K"]  # the constants that used to live here


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Parse ``argv``, train, validate and print the report on rank zero.

    Returns:
        A summary: ``metrics`` (every logged value as a float, e.g. ``val/t2v/R@5``), ``chance`` (R@K of a random
        ranking), ``metric_compute`` (sizes, seconds and memory of the last retrieval ``compute``),
        ``naive_matrix_bytes`` / ``naive_dedup_matrix_bytes`` (the dense float32 score matrix without / with caption
        deduplication), ``memory_logs``, ``log_dir``, ``root``, ``wall_seconds`` and ``trainer``.
    """
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
    assert datamodule.val_set is not None
    n_videos = cost.get("num_videos", 0)
    summary: dict[str, Any] = {
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1},
        "chance": chance_recalls(datamodule.val_set.caption_ids, TOP_K),
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
