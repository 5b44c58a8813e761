"""wrap_checkpointing without a Trainer: which path it takes, what it changes, and that the handle gives it back."""

from __future__ import annotations

import torch
from torch import nn

from lightning_memopt.functional.checkpointing import (
    SWITCH_APIS,
    enable_switch,
    find_switches,
    is_checkpointed,
    module_matches,
    switch_api,
    wrap_checkpointing,
    wrap_modules,
)


def _encoder(layers: int = 2) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


class _Switchable(nn.Module):
    """A model with the newest switch API; records how it was called."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.TransformerEncoderLayer(8, 2, 16)
        self.calls: list[tuple[str, dict]] = []
        self.on = False

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None):
        self.calls.append(("enable", activation_checkpointing_kwargs))
        self.on = True

    def activation_checkpointing_disable(self):
        self.calls.append(("disable", {}))
        self.on = False

    @property
    def is_activation_checkpointing(self):
        return self.on


def test_default_blocks_are_wrapped_and_the_handle_unwraps_them():
    model = _encoder(3).train()
    x = torch.randn(2, 4, 8)
    expected = model(x)
    handle = wrap_checkpointing(model)
    assert handle.wrapped_names == ["layers.0", "layers.1", "layers.2"] and not handle.used_switch
    assert all(is_checkpointed(layer) for layer in model.layers) and handle.changed
    torch.testing.assert_close(model(x), expected)
    handle.restore()
    assert not any(is_checkpointed(m) for m in model.modules()) and not handle.changed
    assert all("forward" not in vars(m) for m in model.modules())


def test_patterns_classes_and_names_match_and_already_wrapped_blocks_are_left_alone():
    model = _encoder(2)
    layer = model.layers[0]
    assert module_matches("layers.0", layer, ["layers.*"]) and module_matches("x", layer, ["TransformerEncoderLayer"])
    assert module_matches("x", layer, [nn.TransformerEncoderLayer]) and module_matches("x", layer, None)
    assert not module_matches("layers.0", layer, ["layers.1", nn.Linear])
    first = wrap_modules(model, ["layers.0"])
    second = wrap_modules(model)
    assert (first.wrapped_names, second.wrapped_names, second.already_wrapped_names) == (
        ["layers.0"],
        ["layers.1"],
        ["layers.0"],
    )
    second.restore()
    assert is_checkpointed(model.layers[0]) and not is_checkpointed(model.layers[1])  # still the first's
    first.restore()
    assert not is_checkpointed(model.layers[0])


def test_the_model_s_switch_is_turned_on_non_reentrant_and_off_again():
    model = _Switchable()
    assert switch_api(model) is SWITCH_APIS[0] and [n for n, _, _ in find_switches(model)] == [""]
    handle = wrap_checkpointing(model)
    assert handle.used_switch and handle.turned_on == ["_Switchable.activation_checkpointing_enable()"]
    assert model.calls == [("enable", {"use_reentrant": False})] and handle.wrapped_names == []
    handle.restore()
    assert model.calls[-1] == ("disable", {}) and not model.on


def test_a_switch_found_on_is_left_on_and_modules_win_over_the_switch():
    model = _Switchable()
    enable_switch(model, SWITCH_APIS[0])
    handle = wrap_checkpointing(model)
    assert handle.already_on and not handle.turned_on
    handle.restore()
    assert model.on  # not ours to turn off
    explicit = wrap_checkpointing(_Switchable(), [nn.TransformerEncoderLayer])
    assert explicit.wrapped_names == ["block"] and [n for n, _, _ in explicit.switches] == [""]
    assert not wrap_checkpointing(_Switchable(), use_model_switch=False).used_switch


def test_use_cache_is_off_while_blocks_are_wrapped_and_on_again_after():
    model = _encoder(1)
    model.config = type("Config", (), {"use_cache": True})()
    handle = wrap_checkpointing(model, ["layers.0"])
    assert model.config.use_cache is False and handle.caches == ["TransformerEncoder"]
    handle.restore()
    assert model.config.use_cache is True
    nothing = wrap_checkpointing(model, ["no.such.*"])
    assert nothing.wrapped_names == [] and model.config.use_cache is True and not nothing.changed


def test_a_switch_without_an_is_on_property_counts_as_off_and_is_turned_on():
    class NoProperty(nn.Module):  # enable/disable methods, nothing that says whether it is on
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.TransformerEncoderLayer(8, 2, 16)
            self.on = False

        def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None):
            self.on = True

        def activation_checkpointing_disable(self):
            self.on = False

    model = NoProperty()
    handle = wrap_checkpointing(model)
    assert handle.turned_on == ["NoProperty.activation_checkpointing_enable()"] and not handle.already_on
    assert model.on
    handle.restore()
    assert not model.on


def test_recomputation_leaves_batchnorm_running_stats_as_one_forward_left_them():
    """A checkpointed block with BatchNorm runs its forward twice (forward, recomputation in backward); the running
    statistics must move once, as without checkpointing: same buffers, same gradients."""

    def block() -> nn.Module:
        torch.manual_seed(0)
        inner = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Dropout(0.3))
        return nn.Sequential(inner, nn.Linear(6, 1))

    x = torch.randn(8, 6)
    plain, wrapped = block().train(), block().train()
    assert wrap_modules(wrapped, ["0"]).wrapped_names == ["0"]
    torch.manual_seed(1)
    plain(x).sum().backward()
    torch.manual_seed(1)
    wrapped(x).sum().backward()
    assert int(wrapped[0][1].num_batches_tracked) == 1
    for (name, a), b in zip(plain.state_dict().items(), wrapped.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_modules_checkpointed_by_another_spec_are_left_alone_and_not_listed():
    layer = nn.TransformerEncoderLayer(8, 2, 16)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    first = wrap_modules(model, ["layers.0"])
    second = wrap_modules(model, ["layers.1"])  # layers.0 is another's: neither wrapped again nor listed as "already"
    assert (second.wrapped_names, second.already_wrapped_names) == (["layers.1"], [])
    again = wrap_modules(model, ["layers.*", "layers.0.linear1"])
    assert (again.wrapped_names, again.already_wrapped_names) == ([], ["layers.0", "layers.1"])  # nothing inside
    second.restore()
    first.restore()
    assert not any(is_checkpointed(m) for m in model.modules())
