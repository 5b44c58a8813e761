"""AllocatorSettings: the callback that applies allocator settings for one run and gives them back."""

import os
import warnings

import pytest

from lightning_memopt import AllocatorSettings
from lightning_memopt.functional import allocator
from lightning_memopt.functional.allocator import ALLOC_CONF_ENV
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


def test_a_restore_that_fails_in_a_hook_warns_and_never_raises():
    callback = AllocatorSettings()
    # an environment variable name the OS refuses: giving it back raises ValueError inside restore
    callback._conf_state = allocator.AllocatorState(how="env", env_name="BAD\0NAME", previous_env="x")
    with pytest.raises(ValueError):
        callback.restore()  # called directly, the error reaches the caller
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        callback.on_exception(None, None, RuntimeError("the user's"))
        callback.teardown(None, None, "fit")
    messages = [str(w.message) for w in seen]
    assert len(messages) == 1 and messages[0].startswith("AllocatorSettings could not give the allocator settings")


def test_settings_apply_when_built_and_again_at_setup_after_a_restore(monkeypatch, tmp_path):
    monkeypatch.setattr(allocator, "_cuda_initialized", lambda: False)
    callback = AllocatorSettings("expandable_segments:True")
    assert os.environ[ALLOC_CONF_ENV] == "expandable_segments:True"  # applied when built, before CUDA starts
    callback.restore()
    assert ALLOC_CONF_ENV not in os.environ
    seen = []

    class Model(TinyModel):
        def training_step(self, batch, batch_idx):
            seen.append(os.environ.get(ALLOC_CONF_ENV))
            return super().training_step(batch, batch_idx)

    make_trainer(tmp_path, callbacks=[callback], max_steps=1).fit(Model())
    assert seen == ["expandable_segments:True"] and ALLOC_CONF_ENV not in os.environ
