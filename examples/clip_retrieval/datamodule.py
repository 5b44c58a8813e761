"""The LightningDataModule of the CLIP-style retrieval example: synthetic train and val splits."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader
from typing_extensions import override

from examples.clip_retrieval.data import CaptionBank, SyntheticSpec, SyntheticVideoTextDataset, collate_batch

__all__ = ["ClipRetrievalDataModule"]


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
