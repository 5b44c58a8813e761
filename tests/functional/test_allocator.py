import os

import pytest
import torch

from lightning_memopt.functional import allocator
from lightning_memopt.functional.allocator import (
    ALLOC_CONF_ENV,
    apply_allocator_conf,
    apply_memory_fraction,
    restore_allocator_settings,
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)


def test_before_cuda_init_sets_the_env_var_and_restores_it(monkeypatch):
    monkeypatch.setattr(allocator, "_cuda_initialized", lambda: False)
    state = apply_allocator_conf("expandable_segments:True")
    assert state.how == "env" and os.environ[ALLOC_CONF_ENV] == "expandable_segments:True"
    restore_allocator_settings(state)
    assert ALLOC_CONF_ENV not in os.environ


def test_user_keys_win_and_new_variable_name_is_followed(monkeypatch):
    monkeypatch.setattr(allocator, "_cuda_initialized", lambda: False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64,expandable_segments:False")
    state = apply_allocator_conf("expandable_segments:True,garbage_collection_threshold:0.8")
    assert os.environ["PYTORCH_ALLOC_CONF"] == (
        "expandable_segments:False,garbage_collection_threshold:0.8,max_split_size_mb:64"
    )
    restore_allocator_settings(state)
    assert os.environ["PYTORCH_ALLOC_CONF"] == "max_split_size_mb:64,expandable_segments:False"


def test_after_cuda_init_uses_the_runtime_setter(monkeypatch):
    calls = []
    monkeypatch.setattr(allocator, "_cuda_initialized", lambda: True)
    monkeypatch.setattr(allocator, "_runtime_setter", lambda: calls.append)
    state = apply_allocator_conf("expandable_segments:True")
    assert state.how == "runtime" and calls == ["expandable_segments:True"]
    assert ALLOC_CONF_ENV not in os.environ
    restore_allocator_settings(state)
    assert calls[-1] == "expandable_segments:False"  # known default given back


def test_after_cuda_init_without_setter_warns_with_the_exact_export(monkeypatch):
    monkeypatch.setattr(allocator, "_cuda_initialized", lambda: True)
    monkeypatch.setattr(allocator, "_runtime_setter", lambda: None)
    with pytest.warns(UserWarning, match=r"export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True$"):
        state = apply_allocator_conf("expandable_segments:True")
    assert state.how == "warned"


def test_already_in_effect_does_nothing(monkeypatch):
    monkeypatch.setattr(allocator, "_cuda_initialized", lambda: True)
    monkeypatch.setattr(allocator, "_runtime_setter", lambda: pytest.fail("must not be called"))
    monkeypatch.setenv(ALLOC_CONF_ENV, "expandable_segments:True")
    assert apply_allocator_conf("expandable_segments:True").how == "already"


def test_bad_conf():
    with pytest.raises(ValueError, match="entries must look like `key:value`, got 'oops'"):
        apply_allocator_conf("oops")


def test_memory_fraction_on_cuda_is_set_and_restored(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 0.8, raising=False)
    state = apply_memory_fraction(0.5, torch.device("cuda", 1))
    restore_allocator_settings(state)
    assert calls == [(0.5, 1), (0.8, 1)]


def test_memory_fraction_on_cpu_warns():
    with pytest.warns(UserWarning, match="`memory_fraction`=0.9 limits CUDA memory only; ignored on device cpu"):
        state = apply_memory_fraction(0.9, torch.device("cpu"))
    assert state.fraction_device is None


@pytest.mark.cuda
def test_cuda_memory_fraction_really_applies():
    state = apply_memory_fraction(0.5, torch.device("cuda", 0))
    try:
        total = torch.cuda.get_device_properties(0).total_memory
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(int(total * 0.6), dtype=torch.uint8, device="cuda")
    finally:
        restore_allocator_settings(state)
        torch.cuda.empty_cache()


@pytest.mark.cuda
def test_cuda_settings_of_a_gpu_fit_take_the_runtime_route_and_are_given_back(tmp_path):
    # Lightning initialises CUDA before any callback's setup: the settings must reach the allocator at runtime.
    import lightning.pytorch as pl

    from lightning_memopt import AllocatorSettings
    from tests.helpers.models import TinyModel

    def expandable(tensor):
        ptr = tensor.data_ptr()
        for segment in torch.cuda.memory_snapshot():
            if segment["address"] <= ptr < segment["address"] + segment["total_size"]:
                return segment.get("is_expandable")
        return None

    seen = []

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if not seen:
                seen.append((expandable(torch.empty(1 << 26, dtype=torch.uint8, device="cuda")), env()))

    def env():
        return {name: os.environ.get(name) for name in (ALLOC_CONF_ENV, "PYTORCH_ALLOC_CONF")}

    before = env()
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
        callbacks=[AllocatorSettings("expandable_segments:True"), Probe()],
    )  # fmt: skip
    trainer.fit(TinyModel())
    assert seen[0] == (True, before)  # in effect during fit, not through the environment
    torch.cuda.empty_cache()
    assert expandable(torch.empty(1 << 26, dtype=torch.uint8, device="cuda")) is False  # given back
    assert env() == before
