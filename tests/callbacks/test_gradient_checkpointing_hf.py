"""GradientCheckpointing with today's models: explicit ``modules`` win over a model's own switch, transformers 5's
``activation_checkpointing_*`` names are used (the old ``gradient_checkpointing_*`` ones still found), and a model's
``use_cache`` is off while its blocks are wrapped.

The stand-ins below behave like Hugging Face models where it matters here (checked against a real T5 at the end
when ``transformers`` is installed): the old names warn with a ``FutureWarning`` on every call in transformers 5,
and a decoder block with ``use_cache`` on stores its keys in a cache object it was given, as ``DynamicCache.update``
does, so recomputing it inside a checkpoint sees a different cache (``CheckpointError``).
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointError, checkpoint

from lightning_memopt import GradientCheckpointing
from tests.helpers.lightning import pl
from tests.helpers.trainer import make_trainer


class Config:
    def __init__(self) -> None:
        self.use_cache = True


class CacheBlock(nn.Module):
    """A decoder block: with a cache, it appends its keys there and attends over every key in it."""

    def __init__(self) -> None:
        super().__init__()
        self.key = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x, cache=None):
        keys = self.key(x)
        if cache is not None:
            cache.append(keys)
            keys = torch.cat(cache, dim=1)
        return x + self.out(torch.softmax(x @ keys.transpose(1, 2), dim=-1) @ keys)


class OldStyleModel(nn.Module):
    """A transformers 4 model: ``gradient_checkpointing_enable()`` and friends, no warnings."""

    supports_gradient_checkpointing = True

    def __init__(self) -> None:
        super().__init__()
        self.config = Config()
        self.blocks = nn.ModuleList([CacheBlock(), CacheBlock()])
        self.switch = False
        self.switch_kwargs = None

    def forward(self, x):
        for block in self.blocks:
            if self.switch and self.training:  # the model's own checkpointing turns the cache off, as HF does
                x = checkpoint(block, x, **self.switch_kwargs)
            else:
                x = block(x, cache=[] if self.config.use_cache else None)
        return x

    def _enable(self, kwargs):
        self.switch, self.switch_kwargs = True, kwargs or {"use_reentrant": False}

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        self._enable(gradient_checkpointing_kwargs)

    def gradient_checkpointing_disable(self):
        self.switch = False

    @property
    def is_gradient_checkpointing(self):
        return self.switch


class NewStyleModel(OldStyleModel):
    """A transformers 5 model: ``activation_checkpointing_*``; the old names still work and warn on every call."""

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None):
        self._enable(activation_checkpointing_kwargs)

    def activation_checkpointing_disable(self):
        self.switch = False

    @property
    def is_activation_checkpointing(self):
        return self.switch

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
        warnings.warn("`gradient_checkpointing_enable` is deprecated", FutureWarning, stacklevel=2)
        super().gradient_checkpointing_enable(gradient_checkpointing_kwargs)

    def gradient_checkpointing_disable(self):
        warnings.warn("`gradient_checkpointing_disable` is deprecated", FutureWarning, stacklevel=2)
        super().gradient_checkpointing_disable()

    @property
    def is_gradient_checkpointing(self):
        warnings.warn("`is_gradient_checkpointing` is deprecated", FutureWarning, stacklevel=2)
        return self.switch


class Holder(pl.LightningModule):
    def __init__(self, backbone: nn.Module, crash_at: int | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        self.crash_at = crash_at
        self.seen: list[tuple[bool, bool]] = []  # (switch on, use_cache) per step

    def training_step(self, batch, batch_idx):
        self.seen.append((self.backbone.switch, self.backbone.config.use_cache))
        if batch_idx == self.crash_at:
            raise RuntimeError("crash in training_step")
        return self.backbone(batch).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(
            torch.randn(8, 3, 8, generator=torch.Generator().manual_seed(0)), batch_size=4
        )


def _fit(tmp_path, model, callback, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, callbacks=[callback], max_steps=2, **kwargs).fit(model)
    # what the model's deprecated checkpointing names warn (torch's own FutureWarnings are not counted)
    return [
        str(w.message) for w in caught if issubclass(w.category, FutureWarning) and "checkpointing" in str(w.message)
    ]


def test_the_stand_in_breaks_a_wrapped_block_while_its_cache_is_on():
    model = OldStyleModel().train()
    GradientCheckpointing(checkpoint_modules=["CacheBlock"]).wrap(model)
    with pytest.raises(CheckpointError):
        model(torch.randn(2, 3, 8)).pow(2).mean().backward()


def test_explicit_modules_win_over_the_model_s_own_switch_and_use_cache_is_off_for_the_fit(tmp_path, caplog):
    model = Holder(NewStyleModel())
    callback = GradientCheckpointing(checkpoint_modules=["CacheBlock"], verbose=True)
    with caplog.at_level(logging.INFO):
        _fit(tmp_path, model, callback)
    assert model.seen == [(False, False), (False, False)]  # blocks wrapped, the switch left off, no cache
    assert model.backbone.config.use_cache is True  # given back
    assert "forward" not in vars(model.backbone.blocks[0])
    said = " ".join(" ".join(m.split()) for m in caplog.messages if m.startswith("GradientCheckpointing:"))
    assert "wrapped 2 module(s) by `checkpoint_modules=['CacheBlock']`" in said
    assert "instead of the model's own switch (backbone.activation_checkpointing_enable())" in said
    assert "`config.use_cache=False` for the fit on backbone" in said


def test_use_cache_is_given_back_after_a_crash(tmp_path):
    model = Holder(NewStyleModel(), crash_at=1)
    with pytest.raises(RuntimeError, match="crash in training_step"):
        _fit(tmp_path, model, GradientCheckpointing(checkpoint_modules=["CacheBlock"]))
    assert model.seen == [(False, False), (False, False)]
    assert model.backbone.config.use_cache is True


def test_without_checkpoint_modules_the_newest_switch_is_used_and_nothing_warns(tmp_path, caplog):
    model = Holder(NewStyleModel())
    with caplog.at_level(logging.INFO):
        future = _fit(tmp_path, model, GradientCheckpointing(verbose=True))
    assert future == []  # transformers 5 warned 3 times per fit on the old names
    assert model.seen == [(True, True), (True, True)]
    assert model.backbone.switch_kwargs == {"use_reentrant": False}
    assert model.backbone.switch is False  # turned off again
    said = " ".join(" ".join(m.split()) for m in caplog.messages if m.startswith("GradientCheckpointing:"))
    assert "own switch turned on: backbone.activation_checkpointing_enable()" in said


def test_models_with_only_the_old_names_are_still_found(tmp_path):
    model = Holder(OldStyleModel())
    _fit(tmp_path, model, GradientCheckpointing())
    assert model.seen == [(True, True), (True, True)]
    assert model.backbone.switch_kwargs == {"use_reentrant": False} and model.backbone.switch is False


def test_a_switch_that_was_on_is_left_on_and_said(tmp_path, caplog):
    backbone = NewStyleModel()
    backbone.activation_checkpointing_enable()
    model = Holder(backbone)
    with caplog.at_level(logging.INFO):
        _fit(tmp_path, model, GradientCheckpointing(verbose=True))
    assert backbone.switch is True
    assert any("on already: backbone.activation_checkpointing_enable()" in m for m in caplog.messages)


def test_a_real_t5_block_by_class_name_and_the_new_switch(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=64,
        d_model=16,
        d_kv=4,
        d_ff=32,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )

    class T5Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = transformers.T5ForConditionalGeneration(config)

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randint(0, 64, (8, 6)), batch_size=4)

    model = T5Module()
    callback = GradientCheckpointing(checkpoint_modules=["T5Block"])
    _fit(tmp_path, model, callback)
    assert model.model.config.use_cache is True
    future = _fit(tmp_path, T5Module(), GradientCheckpointing())
    assert future == []
