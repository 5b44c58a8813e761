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
def test_cuda_preset_allocator_settings_are_in_place_before_cuda_initialises(tmp_path):
    # The allocator backend can only be chosen before CUDA initialises, so it shows whether the preset's settings
    # really got there first. A fresh process: this one may have initialised CUDA already.
    from tests.helpers.subprocess_run import run_script

    code = """
import torch
from lightning_memopt import MemoryPreset
kwargs = MemoryPreset.from_name("max-speed", allocator_conf="backend:cudaMallocAsync").trainer_kwargs()
assert not torch.cuda.is_initialized()
torch.empty(1, device="cuda")
print("BACKEND", torch.cuda.memory.get_allocator_backend())
"""
    proc = run_script(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "BACKEND cudaMallocAsync" in proc.stdout
