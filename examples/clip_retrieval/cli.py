"""The command line of the CLIP-style retrieval example: data, model, training and memory flags."""

from __future__ import annotations

import argparse

__all__ = ["MEMORY_PRESETS", "build_parser", "check_args"]

MEMORY_PRESETS = ("max-savings", "balanced", "max-speed", "none")
#: The first line of ``train.py``'s docstring: what ``--help`` says first.
DESCRIPTION = (
    "CLIP-style multitask video-text retrieval with lightning-memopt, on synthetic clips and repeated captions."
)


def build_parser() -> argparse.ArgumentParser:
    """The command line: data, model, training and memory flags."""
    p = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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


def check_args(args: argparse.Namespace) -> None:
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
