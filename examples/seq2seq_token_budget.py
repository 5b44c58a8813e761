"""Seq2seq batches shaped by memory: a T5-shaped encoder-decoder on synthetic long-tailed lengths, batched by a
token-budget table the estimator plans, with AutoMicroBatch as the safety net.

What it shows, on the CPU in well under a minute with the defaults:

1. ``plan_token_budget`` finds, per (source, target) length bucket, the largest batch whose estimated training step
   fits ``--budget`` (printed as a table);
2. ``TokenBudgetBatchSampler`` batches the dataset by that table: samples of similar length together, each batch as
   large as its padded lengths allow, padded to its longest sample, not to ``max_length``;
3. ``AutoMicroBatch(weight_fn=...)`` splits a batch only if it still runs out of memory, with the loss weighted by
   target tokens (the loss is a mean over them);
4. at the end: steps per epoch and padding, next to fixed batches of ``--fixed_batch_size`` padded to the longest.

    python examples/seq2seq_token_budget.py [--budget 256MB] [--samples 2000] [--max_steps 20]
    python examples/seq2seq_token_budget.py --d_model 512 --num_heads 8 --d_ff 2048 --vocab_size 32128  # T5-small
"""

from __future__ import annotations

import argparse
import functools
import random
from collections.abc import Sequence

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_memopt import AutoMicroBatch, TokenBudgetBatchSampler, plan_token_budget

PAD, IGNORE = 0, -100


def synthetic_lengths(samples: int, max_source: int, max_target: int, seed: int = 0) -> list[tuple[int, int]]:
    """Long-tailed source lengths (lognormal, median about 107 tokens, capped) and targets of 1 to ``max_target``."""
    rng = random.Random(seed)
    return [
        (min(max_source, max(1, int(rng.lognormvariate(4.67, 0.7)))), rng.randint(1, max_target))
        for _ in range(samples)
    ]


class Pairs(Dataset):
    """Random token ids of the given lengths (the target a function of the source, so there is something to learn)."""

    def __init__(self, lengths: Sequence[tuple[int, int]], vocab_size: int) -> None:
        self.lengths, self.vocab_size = lengths, vocab_size

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        source_length, target_length = self.lengths[i]
        g = torch.Generator().manual_seed(i)
        source = torch.randint(1, self.vocab_size, (source_length,), generator=g)
        target = (source.repeat(target_length // source_length + 1)[:target_length] + 1) % self.vocab_size
        return source, target.clamp(min=1)


def pad_to_longest(samples: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    sources, targets = zip(*samples)
    return {
        "source": nn.utils.rnn.pad_sequence(list(sources), batch_first=True, padding_value=PAD),
        "labels": nn.utils.rnn.pad_sequence(list(targets), batch_first=True, padding_value=IGNORE),
    }


class Seq2Seq(pl.LightningModule):
    """An encoder-decoder in T5's shapes (shared embedding, pre-norm layers, a causal decoder), from its widths."""

    def __init__(
        self, vocab_size: int = 1000, d_model: int = 64, num_heads: int = 4, d_ff: int = 128, num_layers: int = 2
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, d_model, padding_idx=PAD)
        layer = functools.partial(dict, d_model=d_model, nhead=num_heads, dim_feedforward=d_ff, dropout=0.0)
        self.encoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(**layer(), batch_first=True, norm_first=True),
            num_layers,
            enable_nested_tensor=False,
        )
        self.decoder = nn.TransformerDecoder(
            nn.TransformerDecoderLayer(**layer(), batch_first=True, norm_first=True), num_layers
        )
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied, as in T5
        with torch.no_grad():
            self.embed.weight.normal_(std=d_model**-0.5)
            self.embed.weight[PAD].zero_()

    def forward(self, source: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        memory = self.encoder(self.embed(source), src_key_padding_mask=source == PAD)
        decoder_input = nn.functional.pad(labels.clamp(min=PAD)[:, :-1], (1, 0), value=PAD)  # shifted right
        causal = nn.Transformer.generate_square_subsequent_mask(labels.shape[1], device=labels.device)
        hidden = self.decoder(self.embed(decoder_input), memory, tgt_mask=causal, tgt_is_causal=True)
        logits = self.head(hidden)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(batch["source"], batch["labels"])
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def target_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """What the loss is a mean over: the target tokens that are not padding (AutoMicroBatch's ``weight_fn``)."""
    return (batch["labels"] != IGNORE).sum()


def make_batch(n: int, lengths: tuple[int, int]) -> dict[str, torch.Tensor]:
    """A batch of ``n`` samples padded to ``lengths``, for the estimator: shapes only (meta tensors)."""
    source, target = lengths
    return {
        "source": torch.ones(n, source, dtype=torch.long, device="meta"),
        "labels": torch.ones(n, target, dtype=torch.long, device="meta"),
    }


def padding_share(batches: Sequence[Sequence[int]], lengths: Sequence[tuple[int, int]]) -> float:
    """The share of the padded tokens (both axes) that are padding."""
    real = sum(sum(lengths[i]) for b in batches for i in b)
    padded = sum(len(b) * (max(lengths[i][0] for i in b) + max(lengths[i][1] for i in b)) for b in batches)
    return 1 - real / padded


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--max_source_length", type=int, default=512)
    parser.add_argument("--max_target_length", type=int, default=96)
    parser.add_argument("--budget", default="256MB", help="the device memory to plan for (bytes, 24GB, A100-80GB)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="the device the plan models")
    parser.add_argument("--buckets", type=int, default=9, help="about this many length buckets")
    parser.add_argument("--fixed_batch_size", type=int, default=8, help="the fixed batching to compare with")
    parser.add_argument("--max_steps", type=int, default=20)
    parser.add_argument("--vocab_size", type=int, default=1000)
    parser.add_argument("--d_model", type=int, default=64)
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--d_ff", type=int, default=128)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    lengths = synthetic_lengths(args.samples, args.max_source_length, args.max_target_length)
    widths = {k: getattr(args, k) for k in ("vocab_size", "d_model", "num_heads", "d_ff", "num_layers")}
    plan = plan_token_budget(
        Seq2Seq(**widths), make_batch, lengths, buckets=args.buckets, budget=args.budget, device=args.device
    )
    print(plan)
    sampler = TokenBudgetBatchSampler(lengths, budget=plan.table, longest_first=True)
    model = Seq2Seq(**widths)
    loader = DataLoader(Pairs(lengths, args.vocab_size), batch_sampler=sampler, collate_fn=pad_to_longest)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        max_steps=args.max_steps,
        callbacks=[AutoMicroBatch(weight_fn=target_tokens)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, train_dataloaders=loader)

    order = list(range(len(lengths)))
    random.Random(0).shuffle(order)
    fixed = [order[k : k + args.fixed_batch_size] for k in range(0, len(order), args.fixed_batch_size)]
    budget_batches = sampler.batches()
    summary = {
        "steps_per_epoch": {"token budget": len(budget_batches), "fixed": len(fixed)},
        "padding": {"token budget": padding_share(budget_batches, lengths), "fixed": padding_share(fixed, lengths)},
        "train_loss": float(trainer.callback_metrics["train_loss"]),
        "table": plan.table,
    }
    print(
        f"steps per epoch: {len(budget_batches)} with the token budget, {len(fixed)} with batches of"
        f" {args.fixed_batch_size}; padding {summary['padding']['token budget']:.1%} against"
        f" {summary['padding']['fixed']:.1%}; train loss {summary['train_loss']:.3f} after {trainer.global_step} steps"
    )
    return summary


if __name__ == "__main__":
    main()
