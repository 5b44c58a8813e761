"""The LightningModule of the CLIP-style video-text retrieval example (the towers, data module and RSS sampler
live in :mod:`~examples.clip_retrieval.towers`, :mod:`~examples.clip_retrieval.datamodule` and
:mod:`~examples.clip_retrieval.rss`, and are importable from here too)."""

from __future__ import annotations

import math
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from examples.clip_retrieval.datamodule import ClipRetrievalDataModule
from examples.clip_retrieval.rss import PeakRSSSampler
from examples.clip_retrieval.towers import Pooling, TextTower, VideoTower, contrastive_loss
from lightning_memopt import StreamingRetrievalMetric
from lightning_memopt.functional.retrieval import choose_block_sizes

__all__ = [
    "ClipRetrievalDataModule",
    "ClipRetrievalModule",
    "PeakRSSSampler",
    "TextTower",
    "VideoTower",
    "contrastive_loss",
]


class ClipRetrievalModule(pl.LightningModule):
    """Two towers trained with a symmetric InfoNCE loss plus a caption-category head on the video embedding.

    The loss is ``InfoNCE(video, text) + category_weight * CE(category | video)``; the temperature is learned
    (``logit_scale`` = log of the inverse temperature, capped at log 100). Validation feeds every row's
    embeddings to a :class:`~lightning_memopt.StreamingRetrievalMetric` (features kept on the CPU; captions
    deduplicated by ``text_id``; DDP padding repeats dropped by ``sample_id``) and, at the end of the epoch, logs

    * ``val/v2t/R@1``, ``val/v2t/R@5``, ``val/v2t/R@10``, ``val/v2t/MedR``, ``val/v2t/MeanR`` and the same for
      ``val/t2v/...`` (R@K as fractions, ranks 1-based),
    * per batch: ``val/loss``, ``val/contrastive_loss``, ``val/category_acc``.

    What the metric's ``compute`` cost is kept in :attr:`retrieval_compute` (rows, texts, stored feature bytes,
    block sizes, seconds and the peak RSS growth during ``compute``).

    Gradient accumulation keeps the effective batch of the optimizer step, but each micro-batch's InfoNCE only
    sees the negatives of that micro-batch: accumulation is not the same as a larger contrastive batch.

    Args:
        frame_dim: Features per frame.
        vocab_size: Token vocabulary.
        num_categories: Caption categories of the second task.
        hidden_dim: Width of both towers.
        embed_dim: Size of the shared embedding.
        pooling: Frame pooling of the video tower, ``"mean"`` or ``"attention"``.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay (not applied to the temperature).
        category_weight: Weight of the category loss.
        init_temperature: Initial softmax temperature of the contrastive loss.
        metric_budget_bytes: ``memory_budget_bytes`` of the retrieval metric (working set of one block).
        top_k: The K of the logged R@K.
    """

    def __init__(
        self,
        frame_dim: int = 48,
        vocab_size: int = 1000,
        num_categories: int = 10,
        hidden_dim: int = 128,
        embed_dim: int = 64,
        pooling: Pooling = "mean",
        lr: float = 2e-3,
        weight_decay: float = 0.01,
        category_weight: float = 0.5,
        init_temperature: float = 0.07,
        metric_budget_bytes: int = 2**31,
        top_k: tuple[int, ...] = (1, 5, 10),
    ) -> None:
        super().__init__()
        if not 0.0 < init_temperature <= 1.0:
            raise ValueError(f"`init_temperature` must be in (0, 1], got {init_temperature}.")
        self.save_hyperparameters()
        self.video_tower = VideoTower(frame_dim, hidden_dim, embed_dim, pooling)
        self.text_tower = TextTower(vocab_size, hidden_dim, embed_dim)
        self.category_head = nn.Linear(embed_dim, num_categories)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1.0 / init_temperature)))
        self.val_retrieval = StreamingRetrievalMetric(top_k=top_k, memory_budget_bytes=metric_budget_bytes)
        self.retrieval_compute: dict[str, Any] = {}
        self.last_eval_step: int | None = None

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """L2-normalised video and text embeddings and the category logits of one batch."""
        video = self.video_tower(batch["frames"], batch["frame_mask"])
        text = self.text_tower(batch["tokens"])
        return F.normalize(video.float(), dim=-1), F.normalize(text.float(), dim=-1), self.category_head(video)

    def _scale(self) -> torch.Tensor:
        return self.logit_scale.clamp(max=math.log(100.0)).exp()

    def _losses(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
        video, text, category_logits = self(batch)
        contrastive = contrastive_loss(video, text, self._scale())
        category = F.cross_entropy(category_logits.float(), batch["category"])
        loss = contrastive + self.hparams.category_weight * category
        acc = (category_logits.argmax(1) == batch["category"]).float().mean()
        losses = {"loss": loss, "contrastive_loss": contrastive, "category_loss": category, "category_acc": acc}
        return losses, video, text

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        losses, _, _ = self._losses(batch)
        n = batch["frames"].shape[0]
        self.log_dict({f"train/{k}": v for k, v in losses.items()}, batch_size=n)
        self.log("train/temperature", 1.0 / self._scale().detach(), batch_size=n)
        return losses["loss"]

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        losses, video, text = self._losses(batch)
        n = batch["frames"].shape[0]
        self.log_dict({f"val/{k}": v for k, v in losses.items() if k != "category_loss"}, batch_size=n, sync_dist=True)
        self.val_retrieval.update(video, text, text_ids=batch["text_id"], sample_ids=batch["sample_id"])

    @override
    def on_validation_epoch_end(self) -> None:
        metric = self.val_retrieval
        start = time.perf_counter()
        with PeakRSSSampler() as rss:
            results = metric.compute()
        seconds = time.perf_counter() - start
        # every process holds the same global values: `sync_dist` only tells Lightning that these epoch-level values
        # are synchronised, and the max of equal values is exact (a mean over 3 processes may round)
        self.log_dict({f"val/{k}": v for k, v in results.items()}, sync_dist=True, reduce_fx="max")
        metric.reset()
        if self.trainer.sanity_checking:
            return
        self.last_eval_step = self.trainer.global_step
        stats = metric.last_compute_stats  # what compute() ranked, over all processes
        assert stats is not None
        rows, texts, dim = stats["num_rows"], stats["num_texts"], stats["embed_dim"]
        blocks = choose_block_sizes(rows, texts, dim, metric.device, metric.memory_budget_bytes)
        self.retrieval_compute = {
            "num_videos": rows,
            "num_unique_texts": texts,
            "embed_dim": dim,
            "stored_feature_bytes_this_rank": stats["stored_feature_bytes"],
            "budget_bytes": metric.memory_budget_bytes,
            "block_sizes": blocks,
            "planned_working_set_bytes": (texts * dim + blocks[0] * (2 * min(blocks[1], texts) + dim)) * 4,
            "seconds": seconds,
            "rss_start_bytes": rss.start_bytes,
            "rss_peak_bytes": rss.peak_bytes,
            "rss_growth_bytes": rss.growth_bytes,
            "results": {k: float(v) for k, v in results.items()},
        }

    @override
    def configure_optimizers(self) -> Any:
        decay = [p for n, p in self.named_parameters() if p.ndim >= 2 and "bag" not in n]
        no_decay = [p for n, p in self.named_parameters() if not (p.ndim >= 2 and "bag" not in n)]
        groups = [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0}]
        return torch.optim.AdamW(groups, lr=self.hparams.lr)
