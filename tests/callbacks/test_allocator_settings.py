"""AllocatorSettings: the callback that applies allocator settings for one run and gives them back."""

import logging
import os
import warnings

import pytest

from lightning_memopt import AllocatorSettings, MemoryPreset
from lightning_memopt.functional import allocator
from lightning_memopt.functional.allocator import ALLOC_CONF_ENV
from tests.helpers.lightning import pl
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)


def test_bad_conf_and_fraction():
    with pytest.raises(ValueError, match="entries must look like `key:value`, got 'oops'"):
        AllocatorSettings("oops")
    with pytest.raises(ValueError, match="`memory_fraction` must be a fraction in \\(0, 1\\], got 1.5"):
        AllocatorSettings(memory_fraction=1.5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"allocator_conf": 123}, r"`allocator_conf` must be a string of `key:value` entries or None, got 123\."),
        ({"allocator_conf": True}, r"`allocator_conf` must be a string of `key:value` entries or None, got True\."),
        ({"allocator_conf": "oops"}, "entries must look like `key:value`, got 'oops'"),
        ({"memory_fraction": True}, r"`memory_fraction` must be a fraction in \(0, 1\], got True\."),
        ({"memory_fraction": "0.5"}, r"`memory_fraction` must be a fraction in \(0, 1\], got '0.5'\."),
        ({"memory_fraction": 0}, r"`memory_fraction` must be a fraction in \(0, 1\], got 0\."),
    ],
)
def test_bad_callback_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AllocatorSettings(**kwargs)


@pytest.mark.parametrize("previous", [None, "", "max_split_size_mb:64"])
@pytest.mark.parametrize("end", ["normal", "crash"])
def test_callback_gives_the_env_var_back_after_fit_and_after_a_crash(monkeypatch, tmp_path, previous, end):
    monkeypatch.setattr(allocator, "_cuda_initialized", lambda: False)
    if previous is not None:
        monkeypatch.setenv(ALLOC_CONF_ENV, previous)
    seen = []

    class Model(TinyModel):
        def training_step(self, batch, batch_idx):
            seen.append(os.environ.get(ALLOC_CONF_ENV))
            if end == "crash" and batch_idx == 1:
                raise RuntimeError("crash in step")
            return super().training_step(batch, batch_idx)

    trainer = make_trainer(tmp_path, callbacks=[AllocatorSettings("expandable_segments:True")], max_steps=2)
    if end == "crash":
        with pytest.raises(RuntimeError, match="crash in step"):
            trainer.fit(Model())
    else:
        trainer.fit(Model())
    assert seen[0] is not None and "expandable_segments:True" in seen[0]
    assert os.environ.get(ALLOC_CONF_ENV) == previous  # unset stays unset (not ""), set keeps its exact value
    assert "PYTORCH_ALLOC_CONF" not in os.environ


def test_a_restore_that_fails_in_a_hook_warns_and_never_raises(monkeypatch):
    monkeypatch.setattr(allocator, "_cuda_initialized", lambda: False)
    # giving the variable back fails (a name the OS refuses), after the setting was applied normally
    monkeypatch.setattr(allocator, "restore_allocator_settings", lambda state: os.environ.__setitem__("BAD\0", "x"))
    callback = AllocatorSettings("expandable_segments:True")
    try:
        callback.setup(None, None, "fit")
        assert callback._conf is not None and callback._conf.held
        with pytest.raises(ValueError):
            callback.restore()  # called directly, the error reaches the caller
        callback.setup(None, None, "fit")  # the failed give-back held nothing: this applies afresh
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            callback.on_exception(None, None, RuntimeError("the user's"))
            callback.teardown(None, None, "fit")
    finally:
        os.environ.pop(ALLOC_CONF_ENV, None)
    messages = [str(w.message) for w in seen]
    assert len(messages) == 1 and messages[0].startswith("AllocatorSettings could not give the allocator settings")


class SeenDuringFit(pl.Callback):
    """Records the allocator variable and the runtime setter's calls from a hook that runs mid-fit."""

    def __init__(self, calls=None) -> None:
        self.env: list[str | None] = []
        self.calls = calls
        self.calls_seen: list[list[str]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.env.append(os.environ.get(ALLOC_CONF_ENV))
        if self.calls is not None:
            self.calls_seen.append(list(self.calls))


def _fit(trainer, end):
    class Model(TinyModel):
        def training_step(self, batch, batch_idx):
            if end == "crash" and batch_idx == 1:
                raise RuntimeError("crash in step")
            return super().training_step(batch, batch_idx)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if end == "crash":
            with pytest.raises(RuntimeError, match="crash in step"):
                trainer.fit(Model())
        else:
            trainer.fit(Model())


@pytest.mark.parametrize("cuda_initialised", [False, True])
def test_building_the_preset_or_the_callback_changes_nothing(monkeypatch, cuda_initialised):
    monkeypatch.setattr(allocator, "_cuda_initialized", lambda: cuda_initialised)
    monkeypatch.setattr(allocator, "_runtime_setter", lambda: pytest.fail("nothing may be set before setup"))
    before = dict(os.environ)
    kwargs = MemoryPreset("balanced", allocator_conf="expandable_segments:True").trainer_kwargs()
    AllocatorSettings("max_split_size_mb:128", memory_fraction=0.5)
    assert [type(c).__name__ for c in kwargs["callbacks"]].count("AllocatorSettings") == 1
    assert dict(os.environ) == before


@pytest.mark.parametrize("end", ["normal", "crash"])
def test_the_presets_settings_hold_during_fit_only(monkeypatch, tmp_path, end):
    monkeypatch.setattr(allocator, "_cuda_initialized", lambda: False)  # the environment route
    kwargs = MemoryPreset("balanced", allocator_conf="expandable_segments:True").trainer_kwargs()
    seen = SeenDuringFit()
    kwargs["callbacks"].append(seen)
    _fit(make_trainer(tmp_path, max_steps=2, **kwargs), end)
    assert seen.env[0] == "expandable_segments:True"
    assert ALLOC_CONF_ENV not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ


@pytest.mark.parametrize("end", ["normal", "crash"])
def test_with_cuda_initialised_setup_takes_the_runtime_route(monkeypatch, tmp_path, end):
    calls: list[str] = []
    monkeypatch.setattr(allocator, "_cuda_initialized", lambda: True)
    monkeypatch.setattr(allocator, "_runtime_setter", lambda: calls.append)
    callback = AllocatorSettings("expandable_segments:True")
    assert calls == []
    seen = SeenDuringFit(calls)
    _fit(make_trainer(tmp_path, max_steps=2, callbacks=[callback, seen]), end)
    assert seen.calls_seen[0] == ["expandable_segments:True"] and seen.env[0] is None  # runtime, not the variable
    assert calls == ["expandable_segments:True", "expandable_segments:False"]  # torch's default given back
    assert ALLOC_CONF_ENV not in os.environ


def test_a_second_fit_applies_again(monkeypatch, tmp_path):
    monkeypatch.setattr(allocator, "_cuda_initialized", lambda: False)
    callback, seen = AllocatorSettings("expandable_segments:True"), SeenDuringFit()
    for _ in range(2):
        _fit(make_trainer(tmp_path, max_steps=1, callbacks=[callback, seen]), "normal")
        assert ALLOC_CONF_ENV not in os.environ
    assert seen.env == ["expandable_segments:True", "expandable_segments:True"]


@pytest.mark.parametrize("build", [AllocatorSettings, lambda conf: MemoryPreset(allocator_conf=conf)])
def test_a_backend_torch_did_not_load_with_is_refused_when_built(monkeypatch, build):
    # torch reads `backend` when it is imported: set later (even before CUDA initialises) it crashes CUDA's
    # initialisation with an internal assert (seen on an H200, torch 2.11); only an export before Python starts works
    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    with pytest.raises(ValueError, match=r"backend:cudaMallocAsync.*export PYTORCH_CUDA_ALLOC_CONF=backend:cud"):
        build("expandable_segments:True,backend:cudaMallocAsync")
    assert ALLOC_CONF_ENV not in os.environ
    monkeypatch.setenv(ALLOC_CONF_ENV, "backend:cudaMallocAsync")  # exported: the backend it has, accepted
    build("backend:cudaMallocAsync")
    with pytest.raises(ValueError, match=r"backend:native.*'cudaMallocAsync'"):
        build("backend:native")


def test_on_cpu_it_is_named_in_the_one_inactive_line_and_the_fraction_does_not_warn(tmp_path, caplog):
    callback = AllocatorSettings("expandable_segments:True", memory_fraction=0.5)
    trainer = make_trainer(tmp_path, callbacks=[callback], max_steps=1, limit_val_batches=0)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        trainer.fit(TinyModel())
    assert not [str(w.message) for w in caught if "memory_fraction" in str(w.message)]
    assert [m for m in caplog.messages if "AllocatorSettings" in m] == [
        "lightning-memopt: inactive here: AllocatorSettings (CUDA only)."
    ]
