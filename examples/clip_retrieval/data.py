"""Synthetic video-text pairs for the CLIP-style retrieval example: per-frame features and repeated captions.

How the data is built (everything follows from one seed, identically on every process and DataLoader worker):

* A vocabulary of ``vocab_size`` tokens (id 0 is padding), each with a hidden vector of ``latent_dim`` numbers.
* ``num_unique_texts`` captions, each a distinct sequence of ``min(4, max_tokens)``..``max_tokens`` token ids. A
  caption's latent is the unit-normalised mean of its tokens' hidden vectors, so a bag-of-tokens text tower can
  recover it. Its category (the second task) is the argmax of a fixed linear map of the latent.
* Each row is one video clip showing one caption. The raw clip has 1..24 frames, of which the first
  ``max_frames`` are kept. A frame is the caption's latent through a fixed random projection to ``frame_dim``
  numbers plus Gaussian noise (``noise_std``), except for "distractor" frames (probability ``distractor_prob``),
  which are noise only. Pooling the frames recovers the latent, so a contrastive model learns retrieval well
  above chance.
* Rows get captions so that every caption is used at least once (when there are enough rows) and the remaining
  rows draw captions uniformly: ``num_samples / num_unique_texts`` rows per caption on average (the run this
  example is modelled on had 117,120 rows over 23,592 captions, about 5 per caption).

Only the caption tables and one int per row are held in memory (about 11 MiB for 117,120 rows and 23,592 captions);
frames are generated when a row is read, from a counter-based generator keyed on ``(seed, split, row)``, so a row
is the same whichever batch, worker or process reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from examples.clip_retrieval.chance import chance_recall_at_k

__all__ = [
    "RAW_MAX_FRAMES",
    "SPLITS",
    "CaptionBank",
    "SyntheticSpec",
    "SyntheticVideoTextDataset",
    "assign_captions",
    "chance_recall_at_k",
    "collate_batch",
]

#: Longest raw clip, in frames, before ``max_frames`` caps it.
RAW_MAX_FRAMES = 24
#: Split names and the number that keys their random streams.
SPLITS = {"train": 0, "val": 1}


@dataclass(frozen=True)
class SyntheticSpec:
    """Sizes and noise of the synthetic data.

    Args:
        num_unique_texts: Distinct captions.
        vocab_size: Token vocabulary, padding id 0 included.
        max_tokens: Longest caption, in tokens.
        latent_dim: Size of the hidden vector behind each caption.
        frame_dim: Size of one frame's feature vector.
        max_frames: Frames kept per clip (the cap applied to the raw 1..24 frames).
        num_categories: Caption categories (the second task).
        noise_std: Standard deviation of the per-frame Gaussian noise (the signal has about unit scale).
        distractor_prob: Probability that a frame holds noise only.
        seed: Seed of everything.
    """

    num_unique_texts: int = 2000
    vocab_size: int = 1000
    max_tokens: int = 16
    latent_dim: int = 32
    frame_dim: int = 48
    max_frames: int = 8
    num_categories: int = 10
    noise_std: float = 1.0
    distractor_prob: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_unique_texts", "max_tokens", "latent_dim", "frame_dim", "max_frames", "num_categories"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive int, got {value!r}.")
        if self.vocab_size < 2:
            raise ValueError(f"`vocab_size` must be at least 2 (padding id 0 and one token), got {self.vocab_size}.")
        if self.noise_std < 0:
            raise ValueError(f"`noise_std` must be >= 0, got {self.noise_std}.")
        if not 0.0 <= self.distractor_prob < 1.0:
            raise ValueError(f"`distractor_prob` must be in [0, 1), got {self.distractor_prob}.")


class CaptionBank:
    """The captions (token ids, latents, categories) and the frame projection shared by every split.

    Attributes:
        tokens: ``(U, max_tokens)`` int64 token ids, right-padded with 0.
        lengths: ``(U,)`` number of tokens per caption.
        latents: ``(U, latent_dim)`` float32 unit vectors.
        categories: ``(U,)`` int64 category of each caption.
        clean_frames: ``(U, frame_dim)`` float32, the noise-free frame of each caption.

    Example:
        >>> bank = CaptionBank(SyntheticSpec(num_unique_texts=50, vocab_size=30, max_tokens=6))
        >>> bank.tokens.shape, len({tuple(r) for r in bank.tokens.tolist()})
        (torch.Size([50, 6]), 50)
    """

    def __init__(self, spec: SyntheticSpec) -> None:
        self.spec = spec
        rng = np.random.default_rng([spec.seed, 7])
        word_vectors = rng.standard_normal((spec.vocab_size, spec.latent_dim)).astype(np.float32)
        word_vectors[0] = 0.0
        tokens = self._distinct_token_rows(rng, spec)
        lengths = (tokens > 0).sum(1)
        summed = word_vectors[tokens].sum(1) / lengths[:, None]
        latents = summed / np.linalg.norm(summed, axis=1, keepdims=True).clip(1e-6)
        category_map = rng.standard_normal((spec.latent_dim, spec.num_categories)).astype(np.float32)
        projection = rng.standard_normal((spec.latent_dim, spec.frame_dim)).astype(np.float32)
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.lengths = torch.from_numpy(lengths.astype(np.int64))
        self.latents = torch.from_numpy(latents.astype(np.float32))
        self.categories = torch.from_numpy((latents @ category_map).argmax(1).astype(np.int64))
        self.clean_frames = np.ascontiguousarray(latents @ projection, dtype=np.float32)

    @staticmethod
    def _distinct_token_rows(rng: np.random.Generator, spec: SyntheticSpec) -> np.ndarray:
        """Random token sequences, redrawn until no two captions are identical."""
        n, width = spec.num_unique_texts, spec.max_tokens
        shortest = min(4, width)
        real_tokens = spec.vocab_size - 1
        possible = sum(real_tokens**k for k in range(shortest, width + 1))
        if possible < n:
            raise ValueError(
                f"`vocab_size`={spec.vocab_size} and `max_tokens`={width} allow only {possible} distinct"
                f" captions, fewer than `num_unique_texts`={n}. Raise `vocab_size` or `max_tokens`."
            )
        tokens = np.zeros((n, width), dtype=np.int64)
        todo = np.arange(n)
        while todo.size:
            lengths = rng.integers(shortest, width + 1, size=todo.size)
            rows = rng.integers(1, spec.vocab_size, size=(todo.size, width))
            rows[np.arange(width)[None, :] >= lengths[:, None]] = 0
            tokens[todo] = rows
            _, first = np.unique(tokens, axis=0, return_index=True)
            keep = np.zeros(n, dtype=bool)
            keep[first] = True
            todo = np.flatnonzero(~keep)
        return tokens

    @property
    def num_texts(self) -> int:
        """Number of distinct captions."""
        return int(self.tokens.shape[0])


def assign_captions(num_rows: int, num_unique_texts: int, seed: int, split: str = "val") -> np.ndarray:
    """Caption id of every row: each caption at least once (when ``num_rows`` allows), the rest uniform.

    Example:
        >>> ids = assign_captions(1000, 200, seed=0)
        >>> len(ids), len(set(ids.tolist()))
        (1000, 200)
    """
    if num_rows < 1 or num_unique_texts < 1:
        raise ValueError(f"`num_rows` and `num_unique_texts` must be positive, got {num_rows} and {num_unique_texts}.")
    rng = np.random.default_rng([seed, SPLITS[split], 11])
    covered = rng.permutation(num_unique_texts)[: min(num_rows, num_unique_texts)]
    extra = rng.integers(0, num_unique_texts, size=num_rows - covered.size)
    ids = np.concatenate([covered, extra])
    rng.shuffle(ids)
    return ids.astype(np.int64)


class SyntheticVideoTextDataset(Dataset):
    """Rows of (frames, caption tokens, caption id, category, row index), generated on access.

    ``__getitems__`` builds a whole batch at once (the DataLoader calls it with a batch of indices), so use
    :func:`collate_batch` as the ``collate_fn``. Items are dicts with the keys ``frames`` ``(max_frames,
    frame_dim)`` float32 (zero-padded), ``frame_mask`` ``(max_frames,)`` bool, ``tokens`` ``(max_tokens,)`` int64,
    ``text_id``, ``category`` and ``sample_id`` (int64 scalars; the batch adds the leading dimension).

    Args:
        bank: The captions and frame projection.
        num_rows: Rows in this split.
        split: ``"train"`` or ``"val"`` (separate random streams: the same caption gets different clips).

    Example:
        >>> bank = CaptionBank(SyntheticSpec(num_unique_texts=20, vocab_size=50))
        >>> batch = collate_batch(SyntheticVideoTextDataset(bank, 40).__getitems__([0, 1, 2]))
        >>> batch["frames"].shape, batch["tokens"].shape, batch["sample_id"].tolist()
        (torch.Size([3, 8, 48]), torch.Size([3, 16]), [0, 1, 2])
    """

    def __init__(self, bank: CaptionBank, num_rows: int, split: str = "val") -> None:
        if split not in SPLITS:
            raise ValueError(f"`split` must be one of {sorted(SPLITS)}, got {split!r}.")
        self.bank = bank
        self.spec = bank.spec
        self.split = split
        self.caption_ids = assign_captions(num_rows, bank.num_texts, bank.spec.seed, split)

    def __len__(self) -> int:
        return int(self.caption_ids.shape[0])

    def _rng(self, row: int) -> np.random.Generator:
        # Philox is counter-based: a row's stream depends only on (seed, split, row)
        return np.random.Generator(np.random.Philox(key=self.spec.seed, counter=[row, SPLITS[self.split], 0, 0]))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        batch = self.__getitems__([index])
        return {k: v[0] for k, v in batch.items()}

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        spec = self.spec
        rows = np.asarray(indices, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"row indices must be in [0, {len(self)}), got {rows.min()}..{rows.max()}.")
        captions = self.caption_ids[rows]
        frames = np.zeros((rows.size, spec.max_frames, spec.frame_dim), dtype=np.float32)
        mask = np.zeros((rows.size, spec.max_frames), dtype=bool)
        for b, (row, caption) in enumerate(zip(rows.tolist(), captions.tolist())):
            rng = self._rng(row)
            n = min(int(rng.integers(1, RAW_MAX_FRAMES + 1)), spec.max_frames)
            distractor = rng.random(RAW_MAX_FRAMES)[:n] < spec.distractor_prob
            noise = rng.standard_normal((n, spec.frame_dim), dtype=np.float32)
            frames[b, :n] = noise * spec.noise_std + self.bank.clean_frames[caption] * ~distractor[:, None]
            mask[b, :n] = True
        cap = torch.from_numpy(captions)
        return {
            "frames": torch.from_numpy(frames),
            "frame_mask": torch.from_numpy(mask),
            "tokens": self.bank.tokens[cap],
            "text_id": cap,
            "category": self.bank.categories[cap],
            "sample_id": torch.from_numpy(rows),
        }


def collate_batch(batch: Any) -> dict[str, torch.Tensor]:
    """``collate_fn`` for :class:`SyntheticVideoTextDataset`: batches come whole from ``__getitems__``."""
    if isinstance(batch, dict):
        return batch
    return {k: torch.stack([item[k] for item in batch]) for k in batch[0]}  # a plain list of items
