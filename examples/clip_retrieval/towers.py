"""The two towers of the CLIP-style retrieval example and its symmetric InfoNCE loss."""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Pooling", "TextTower", "VideoTower", "contrastive_loss"]

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
