"""The zoo: small, randomly initialised versions of the models people train, as LightningModules for CPU tests.

Each entry builds its module from a config with a fixed seed (no downloads) and makes batches as its
``training_step`` receives them. Tests marked ``zoo`` run every feature that applies on every entry, against a
reference computed without the package; :attr:`ZooModel.not_applicable` says which features do not apply and why.

Entries (``ZOO``):

* ``t5``: Hugging Face ``T5ForConditionalGeneration`` (encoder-decoder, learned relative position bias, dropout).
* ``bert``: Hugging Face ``BertForSequenceClassification`` (dropout, attention mask).
* ``resnet``: a ResNet-style CNN with BatchNorm (running statistics change in every training forward).
* ``lstm``: a 2-layer LSTM language model (batch-first token ids).
* ``metrics``: an MLP with dropout, a torchmetrics accuracy logged per epoch, two parameter groups and an LR
  schedule stepped every optimizer step.
* ``manual``: manual optimization with two optimizers (a generator and a discriminator), Lightning's way to
  train two models in one step.

Usage::

    entry = ZOO["resnet"]
    module = entry.build()                # seeded: two calls give equal weights
    batch = entry.batch(8)                # 8 samples, as training_step gets them
    trainer.fit(entry.build(batch_size=4))  # its own train_dataloader: N_SAMPLES samples, no shuffling
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torchmetrics
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from tests.helpers.lightning import pl

__all__ = ["N_SAMPLES", "ZOO", "ZooModel", "zoo_params"]

#: Samples in each zoo module's training set.
N_SAMPLES = 32


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


class _Samples(Dataset):
    """The samples of one batch (a tensor, or a dict / tuple of tensors), one per index; collated back as given."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch
        if isinstance(batch, Mapping):
            batch = tuple(batch.values())
        self.length = len(batch[0] if isinstance(batch, tuple) else batch)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> Any:
        if isinstance(self.batch, Mapping):
            return {k: v[i] for k, v in self.batch.items()}
        if isinstance(self.batch, tuple):
            return tuple(v[i] for v in self.batch)
        return self.batch[i]


class _ZooModule(pl.LightningModule):
    """What every zoo module shares: its data (seeded, not shuffled) and an AdamW optimizer."""

    make_batch: Callable[[int, int], Any]

    def __init__(self, batch_size: int = 8, lr: float = 1e-3) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.lr = lr

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_Samples(type(self).make_batch(N_SAMPLES, 0)), batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_Samples(type(self).make_batch(N_SAMPLES // 2, 1)), batch_size=self.batch_size)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


# ------------------------------------------------------------------------------------------------- Hugging Face


def _tokens(n: int, length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(1, vocab, (n, length), generator=_generator(seed))


def _mask(n: int, length: int, seed: int) -> torch.Tensor:
    """An attention mask with padding at the end of every other sample."""
    mask = torch.ones(n, length, dtype=torch.long)
    lengths = torch.randint(length // 2, length + 1, (n,), generator=_generator(seed + 100))
    for i in range(0, n, 2):
        mask[i, lengths[i] :] = 0
    return mask


class _HuggingFaceModule(_ZooModule):
    """A Hugging Face model (``self.model``) trained on its own loss: a dict batch in, ``.loss`` out."""

    model: torch.nn.Module

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.model(**batch).loss
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(**batch).loss)


class T5Module(_HuggingFaceModule):
    """``T5ForConditionalGeneration`` trained on (input ids, attention mask, labels)."""

    VOCAB, SOURCE, TARGET = 64, 12, 6

    def __init__(self, batch_size: int = 8, dropout: float = 0.1) -> None:
        super().__init__(batch_size)
        import transformers

        config = transformers.T5Config(
            vocab_size=self.VOCAB,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            dropout_rate=dropout,
            decoder_start_token_id=0,
            pad_token_id=0,
            eos_token_id=1,
        )
        self.model = transformers.T5ForConditionalGeneration(config)

    @staticmethod
    def make_batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
        return {
            "input_ids": _tokens(n, T5Module.SOURCE, T5Module.VOCAB, seed),
            "attention_mask": _mask(n, T5Module.SOURCE, seed),
            "labels": _tokens(n, T5Module.TARGET, T5Module.VOCAB, seed + 1),
        }


class BertModule(_HuggingFaceModule):
    """``BertForSequenceClassification`` (3 classes) trained on (input ids, attention mask, labels)."""

    VOCAB, LENGTH = 64, 16

    def __init__(self, batch_size: int = 8, dropout: float = 0.1) -> None:
        super().__init__(batch_size)
        import transformers

        config = transformers.BertConfig(
            vocab_size=self.VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=self.LENGTH,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
            num_labels=3,
        )
        self.model = transformers.BertForSequenceClassification(config)

    @staticmethod
    def make_batch(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
        return {
            "input_ids": _tokens(n, BertModule.LENGTH, BertModule.VOCAB, seed),
            "attention_mask": _mask(n, BertModule.LENGTH, seed),
            "labels": torch.randint(0, 3, (n,), generator=_generator(seed + 1)),
        }


# ------------------------------------------------------------------------------------------------- vision, sequence


class BasicBlock(nn.Module):
    """A ResNet basic block: conv-BN-ReLU-conv-BN plus the input (projected where the shape changes)."""

    def __init__(self, channels_in: int, channels_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False), nn.BatchNorm2d(channels_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNetModule(_ZooModule):
    """A ResNet-style CNN with BatchNorm on 3 x 16 x 16 images, 10 classes, SGD with momentum."""

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__(batch_size, lr=0.05)
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 16, stride=2))
        self.head = nn.Linear(16, 10)

    @staticmethod
    def make_batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = _generator(seed)
        return torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=1e-4)


class LSTMModule(_ZooModule):
    """A 2-layer LSTM language model over batch-first token ids ``(batch, time)``: predict the next token."""

    VOCAB, LENGTH = 48, 17

    def __init__(self, batch_size: int = 8, dropout: float = 0.1) -> None:
        super().__init__(batch_size)
        self.embed = nn.Embedding(self.VOCAB, 24)
        self.lstm = nn.LSTM(24, 32, num_layers=2, batch_first=True, dropout=dropout)
        self.out = nn.Linear(32, self.VOCAB)

    @staticmethod
    def make_batch(n: int, seed: int = 0) -> torch.Tensor:
        return _tokens(n, LSTMModule.LENGTH, LSTMModule.VOCAB, seed)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(tokens))
        return self.out(hidden)

    def _loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, self.VOCAB), tokens[:, 1:].reshape(-1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch))


# ------------------------------------------------------------------------------------------------- Lightning features


class MetricsModule(_ZooModule):
    """An MLP with dropout; a torchmetrics accuracy updated in ``training_step`` and logged per epoch; two parameter
    groups (backbone with weight decay, head without, other learning rates) and a schedule stepped every step."""

    FEATURES, CLASSES = 16, 4

    def __init__(self, batch_size: int = 8, dropout: float = 0.2) -> None:
        super().__init__(batch_size)
        self.backbone = nn.Sequential(
            nn.Linear(self.FEATURES, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 32), nn.ReLU()
        )
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(32, self.CLASSES))
        self.train_accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=self.CLASSES, average="micro")

    @staticmethod
    def make_batch(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = _generator(seed)
        x = torch.randn(n, MetricsModule.FEATURES, generator=g)
        return x, (x[:, :4].argmax(dim=1) + (torch.rand(n, generator=g) < 0.2).long()) % MetricsModule.CLASSES

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_accuracy(logits, y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.log("train_acc", self.train_accuracy, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(
            [
                {"params": self.backbone.parameters(), "lr": 1e-3, "weight_decay": 0.05},
                {"params": self.head.parameters(), "lr": 1e-2, "weight_decay": 0.0},
            ]
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.1 * step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class ManualModule(_ZooModule):
    """Manual optimization with two optimizers: a generator and a discriminator trained in turn on every batch."""

    NOISE, FEATURES = 8, 12

    def __init__(self, batch_size: int = 8) -> None:
        super().__init__(batch_size)
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(self.NOISE, 32), nn.ReLU(), nn.Linear(32, self.FEATURES))
        self.discriminator = nn.Sequential(nn.Linear(self.FEATURES, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))

    @staticmethod
    def make_batch(n: int, seed: int = 0) -> torch.Tensor:
        return torch.randn(n, ManualModule.FEATURES, generator=_generator(seed)) * 0.5 + 1.0

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        opt_g, opt_d = self.optimizers()
        noise = torch.randn(batch.shape[0], self.NOISE, device=batch.device)
        fake = self.generator(noise)
        real_label = torch.ones(batch.shape[0], 1, device=batch.device)
        fake_label = torch.zeros(batch.shape[0], 1, device=batch.device)
        d_loss = F.binary_cross_entropy_with_logits(
            self.discriminator(batch), real_label
        ) + F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), fake_label)
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), real_label)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss}, on_step=True, on_epoch=True)

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log("val_d_real", self.discriminator(batch).mean())

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.Adam(self.generator.parameters(), lr=2e-4, betas=(0.5, 0.999)),
            torch.optim.Adam(self.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999)),
        )


# ------------------------------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class ZooModel:
    """One zoo entry.

    Attributes:
        name: the entry's key in :data:`ZOO`.
        module_class: the LightningModule; ``module_class.make_batch(n, seed)`` makes ``n`` samples.
        checkpoint_modules: what :class:`~lightning_memopt.GradientCheckpointing` should wrap (``None``: the model's
            own switch is used, for Hugging Face models).
        needs_transformers: whether building it imports ``transformers``.
        not_applicable: feature -> why it does not apply to this model.
    """

    name: str
    module_class: type[_ZooModule]
    checkpoint_modules: tuple[str, ...] | None = None
    needs_transformers: bool = False
    not_applicable: dict[str, str] = field(default_factory=dict)

    def build(self, seed: int = 0, **kwargs: Any) -> pl.LightningModule:
        """The module with weights drawn from ``seed`` (equal for equal seeds)."""
        if self.needs_transformers:
            pytest.importorskip("transformers")
        torch.manual_seed(seed)
        return self.module_class(**kwargs)

    def batch(self, n: int, seed: int = 0) -> Any:
        """``n`` samples as ``training_step`` receives them."""
        return self.module_class.make_batch(n, seed)

    @property
    def automatic_optimization(self) -> bool:
        return self.module_class is not ManualModule


ZOO: dict[str, ZooModel] = {
    entry.name: entry
    for entry in (
        ZooModel("t5", T5Module, needs_transformers=True),
        ZooModel("bert", BertModule, needs_transformers=True),
        ZooModel("resnet", ResNetModule, checkpoint_modules=("BasicBlock",)),
        ZooModel("lstm", LSTMModule, checkpoint_modules=("lstm",)),
        ZooModel("metrics", MetricsModule, checkpoint_modules=("backbone",)),
        ZooModel(
            "manual",
            ManualModule,
            checkpoint_modules=("generator", "discriminator"),
            not_applicable={
                "AutoMicroBatch": "manual optimization: training_step calls manual_backward itself, so there is no"
                " backward for the callback to split (it refuses the module in setup)",
                "accumulate_grad_batches": "Lightning refuses accumulate_grad_batches with manual optimization",
            },
        ),
    )
}


def zoo_params(*names: str, feature: str | None = None) -> list[Any]:
    """``pytest.param`` per zoo entry (all, or ``names``), each with the ``zoo`` mark and its name as id; an entry to
    which ``feature`` does not apply is left out (its reason is in :attr:`ZooModel.not_applicable`)."""
    entries = [ZOO[n] for n in names] if names else list(ZOO.values())
    return [
        pytest.param(entry, id=entry.name, marks=pytest.mark.zoo)
        for entry in entries
        if feature is None or feature not in entry.not_applicable
    ]
