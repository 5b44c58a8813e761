"""The LightningModule and LightningDataModule of the CLIP-style video-text retrieval example."""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Literal

import lightning.pytorch as pl
import numpy as np
import psutil
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from typing_extensions import override

from examples.clip_retrieval.data import CaptionBank, SyntheticSpec, SyntheticVideoTextDataset, collate_batch
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

Pooling = Literal["mean", "attention"]


class VideoTower(nn.Module):
    """Per-frame MLP, then masked mean or attention pooling over frames, then a linear map to the embedding.

    Args:
        frame_dim: Features per frame.
        hidden_dim: Width of the per-frame MLP.
        embed_dim: Size of the shared embedding.
        pooling: ``"mean"`` (average of the real frames) or ``"attention"`` (a learned softmax weight per frame).
    """

    def __init__(self, frame_dim: int, hidden_dim: int, embed_dim: int, pooling: Pooling = "mean") -> None:
        super().__init__()
        if pooling not in ("mean", "attention"):
            raise ValueError(f"`pooling` must be 'mean' or 'attention', got {pooling!r}.")
        self.frame_mlp = nn.Sequential(nn.Linear(frame_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, hidden_dim))
        self.frame_score = nn.Linear(hidden_dim, 1) if pooling == "attention" else None
        self.proj = nn.Linear(hidden_dim, embed_dim)

    def forward(self, frames: torch.Tensor, frame_mask: torch.Tensor) -> torch.Tensor:
        """``(B, F, frame_dim)`` frames and a ``(B, F)`` mask of real frames -> ``(B, embed_dim)``."""
        h = self.frame_mlp(frames)
        if self.frame_score is None:
            weights = frame_mask.to(h.dtype) / frame_mask.sum(1, keepdim=True).clamp_min(1).to(h.dtype)
        else:
            scores = self.frame_score(h).squeeze(-1).masked_fill(~frame_mask, float("-inf"))
            weights = torch.softmax(scores.float(), dim=1).nan_to_num(0.0).to(h.dtype)
        return self.proj((weights.unsqueeze(-1) * h).sum(1))


class TextTower(nn.Module):
    """Mean of token embeddings (padding id 0 left out) followed by a small residual MLP.

    Args:
        vocab_size: Token vocabulary, padding id 0 included.
        hidden_dim: Width of the token embeddings and of the MLP.
        embed_dim: Size of the shared embedding.
    """

    def __init__(self, vocab_size: int, hidden_dim: int, embed_dim: int) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(vocab_size, hidden_dim, mode="mean", padding_idx=0)
        self.mlp = nn.Sequential(nn.Linear(hidden_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, hidden_dim))
        self.proj = nn.Linear(hidden_dim, embed_dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``(B, L)`` token ids -> ``(B, embed_dim)``."""
        h = self.bag(tokens)
        return self.proj(h + self.mlp(h))


def contrastive_loss(video: torch.Tensor, text: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE over a batch: row ``i``'s video and text are the positive pair, every other row a negative.

    A caption repeated within a batch gets identical text embeddings (the text tower is deterministic), so the
    copies tie in every row of the logits: the loss and its gradients are the same whichever copy is named the
    positive, and no caption-aware target is needed.

    Args:
        video: ``(B, D)`` L2-normalised video embeddings.
        text: ``(B, D)`` L2-normalised text embeddings.
        logit_scale: the inverse temperature (a scalar, already exponentiated).

    Example:
        >>> e = F.normalize(torch.eye(3), dim=1)
        >>> round(contrastive_loss(e, e, torch.tensor(100.0)).item(), 4)
        0.0
    """
    logits = logit_scale * video.float() @ text.float().T
    target = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


class PeakRSSSampler:
    """Samples this process's resident set size in a background thread while a ``with`` block runs.

    Matrix products release the GIL, so the thread keeps sampling during them. The growth is the peak seen minus
    the value at entry: what the block needed on top of what the process already held.

    Args:
        interval_s: Seconds between samples.

    Example:
        >>> with PeakRSSSampler() as rss:
        ...     block = torch.ones(2**22)  # 16 MiB
        >>> rss.growth_bytes >= 0
        True
    """

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self._process = psutil.Process()
        self.start_bytes = 0
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)

    def __enter__(self) -> PeakRSSSampler:
        self.start_bytes = self.peak_bytes = self._process.memory_info().rss
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="peak-rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._process.memory_info().rss)

    @property
    def growth_bytes(self) -> int:
        """Peak RSS during the block minus RSS at its start."""
        return self.peak_bytes - self.start_bytes


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
        stored = sum(t.numel() * t.element_size() for t in (*metric.video_features, *metric.text_features))
        rows = torch.cat(metric.sample_ids).unique().numel() if metric.sample_ids else 0
        texts = torch.cat(metric.text_ids).unique().numel() if metric.text_ids else 0
        rows, texts = _global_unique_counts(metric, rows, texts)
        dim = int(metric.video_features[0].shape[1]) if metric.video_features else 0
        blocks = choose_block_sizes(rows, texts, dim, metric.device, metric.memory_budget_bytes)
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
        self.retrieval_compute = {
            "num_videos": rows,
            "num_unique_texts": texts,
            "embed_dim": dim,
            "stored_feature_bytes_this_rank": stored,
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


def _global_unique_counts(metric: StreamingRetrievalMetric, rows: int, texts: int) -> tuple[int, int]:
    """Distinct sample ids and caption ids over all processes (the local counts when not distributed)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return rows, texts
    local = (
        torch.cat(metric.sample_ids).unique().numpy() if metric.sample_ids else np.zeros(0, np.int64),
        torch.cat(metric.text_ids).unique().numpy() if metric.text_ids else np.zeros(0, np.int64),
    )
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return (
        int(np.unique(np.concatenate([g[0] for g in gathered])).size),
        int(np.unique(np.concatenate([g[1] for g in gathered])).size),
    )


class ClipRetrievalDataModule(pl.LightningDataModule):
    """Synthetic clips and captions (see :mod:`examples.clip_retrieval.data`): a train split and a val split.

    Both splits draw from the same captions with different clips. The val split has ``num_samples`` rows and uses
    every caption at least once, so validation ranks ``num_samples`` videos against ``num_unique_texts`` captions.

    Args:
        num_samples: Rows of the validation split.
        num_unique_texts: Distinct captions.
        num_train_samples: Rows of the train split (default: ``num_samples``).
        batch_size: Training micro-batch per device.
        val_batch_size: Validation batch per device (default: ``max(batch_size, 512)``; no gradients are kept).
        num_workers: DataLoader workers.
        spec_kwargs: The other :class:`~examples.clip_retrieval.data.SyntheticSpec` fields (``max_frames``,
            ``frame_dim``, ``max_tokens``, ``vocab_size``, ``latent_dim``, ``num_categories``, ``noise_std``,
            ``distractor_prob``, ``seed``).
    """

    def __init__(
        self,
        num_samples: int = 10_000,
        num_unique_texts: int = 2000,
        num_train_samples: int | None = None,
        batch_size: int = 256,
        val_batch_size: int | None = None,
        num_workers: int = 0,
        **spec_kwargs: Any,
    ) -> None:
        super().__init__()
        if num_samples < num_unique_texts:
            raise ValueError(
                f"`num_samples`={num_samples} is smaller than `num_unique_texts`={num_unique_texts}: the val split"
                " uses every caption at least once. Raise `num_samples` or lower `num_unique_texts`."
            )
        self.save_hyperparameters()
        self.spec = SyntheticSpec(num_unique_texts=num_unique_texts, **spec_kwargs)
        self.bank: CaptionBank | None = None
        self.train_set: SyntheticVideoTextDataset | None = None
        self.val_set: SyntheticVideoTextDataset | None = None

    @override
    def setup(self, stage: str) -> None:
        if self.bank is None:
            self.bank = CaptionBank(self.spec)
            self.train_set = SyntheticVideoTextDataset(
                self.bank, self.hparams.num_train_samples or self.hparams.num_samples, "train"
            )
            self.val_set = SyntheticVideoTextDataset(self.bank, self.hparams.num_samples, "val")

    def _loader(self, dataset: Any, batch_size: int, shuffle: bool) -> DataLoader:
        workers = self.hparams.num_workers
        drop_last = shuffle and len(dataset) > batch_size  # full contrastive batches when training
        return DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            num_workers=workers,
            persistent_workers=workers > 0,
            collate_fn=collate_batch,
        )

    @override
    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, self.hparams.batch_size, shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader:
        size = self.hparams.val_batch_size or max(self.hparams.batch_size, 512)
        return self._loader(self.val_set, size, shuffle=False)
