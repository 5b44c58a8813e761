"""Presets combine with your own callbacks and with LightningCLI (``MemoryPresetCLI``)."""

from __future__ import annotations

import logging
import os
import warnings

import pytest
import torch

from lightning_memopt import (
    AllocatorSettings,
    AutoMicroBatch,
    CacheCleaner,
    GarbageCollector,
    GradientCheckpointing,
    MemoryMonitor,
    MemoryPreset,
    MemoryPresetCLI,
)
from lightning_memopt.functional.allocator import ALLOC_CONF_ENV
from lightning_memopt.presets import DEFAULT_BATCH_SIZE, device_count
from tests.helpers.lightning import lightning_module
from tests.helpers.models import TinyModel
from tests.helpers.presets_env import give_back_allocator_settings
from tests.helpers.trainer import make_trainer

FULL = dict(
    name="max-savings",
    effective_batch_size=16,
    micro_batch_size=4,
    auto_micro_batch=True,
    monitor=True,
    cache_clean_on_phase_end=True,
    gc_every_n_train_steps=5,
    allocator_conf="expandable_segments:True",
)


def _yours(kind):
    return {
        MemoryMonitor: lambda: MemoryMonitor(log_every_n_steps=3),
        CacheCleaner: lambda: CacheCleaner(every_n_train_steps=7),
        GarbageCollector: lambda: GarbageCollector(every_n_train_steps=9),
        GradientCheckpointing: lambda: GradientCheckpointing(checkpoint_modules=["Linear"]),
        AutoMicroBatch: lambda: AutoMicroBatch(micro_batch_size=2),
        AllocatorSettings: lambda: AllocatorSettings("garbage_collection_threshold:0.7"),
    }[kind]()


@pytest.mark.parametrize(
    "kind",
    [MemoryMonitor, CacheCleaner, GarbageCollector, GradientCheckpointing, AutoMicroBatch, AllocatorSettings],
    ids=lambda k: k.__name__,
)
def test_your_callback_of_a_type_the_preset_adds_replaces_the_preset_s(kind, monkeypatch, caplog):
    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)
    preset = MemoryPreset(**FULL)
    built = preset.trainer_kwargs()["callbacks"]
    every = [type(c) for c in built]
    for c in built:
        if isinstance(c, AllocatorSettings):
            c.restore()
    assert kind in every
    mine = _yours(kind)
    try:
        with caplog.at_level(logging.INFO):
            first = preset.trainer_kwargs(callbacks=[mine])["callbacks"]
            second = preset.trainer_kwargs(callbacks=[mine])["callbacks"]
        for callbacks in (first, second):
            of_kind = [c for c in callbacks if isinstance(c, kind)]
            assert of_kind == [mine]  # yours, with your settings, and only one
            assert [type(c) for c in callbacks] == [kind, *(k for k in every if k is not kind)]
        said = [m for m in caplog.messages if f"your {kind.__name__} is used instead of the preset's" in m]
        assert len(said) == 1
        if kind is AllocatorSettings:  # building sets nothing: the settings are applied at setup
            assert os.environ.get(ALLOC_CONF_ENV) is None
    finally:  # the last one built gives back first: each restores what was there when it was built
        for c in [*reversed(second), *reversed(first), mine]:
            if isinstance(c, AllocatorSettings):
                c.restore()


def test_your_memory_monitor_beside_a_preset_fits(tmp_path):
    """Lightning refused two MemoryMonitors: "more than one stateful callback of type MemoryMonitor"."""
    preset = MemoryPreset(
        "balanced",
        effective_batch_size=8,
        micro_batch_size=4,
        monitor=True,
        allocator_conf="",
        float32_matmul_precision="",
    )
    mine = MemoryMonitor(dirpath=tmp_path / "mine")
    kwargs = preset.trainer_kwargs(callbacks=[mine])
    trainer = make_trainer(tmp_path, max_steps=2, **kwargs)
    trainer.fit(TinyModel(batch_size=preset.batch_size))
    assert trainer.global_step == 2
    assert (tmp_path / "mine").is_dir() and any((tmp_path / "mine").iterdir())


def test_batch_size_is_never_none():
    assert MemoryPreset().batch_size == DEFAULT_BATCH_SIZE
    assert MemoryPreset(micro_batch_size=6).batch_size == 6
    assert MemoryPreset(auto_micro_batch=True).batch_size == DEFAULT_BATCH_SIZE
    assert MemoryPreset(effective_batch_size=64, micro_batch_size=8).batch_size == 8
    assert str(DEFAULT_BATCH_SIZE) in MemoryPreset().describe()


def test_device_count_counts_as_lightning_does(monkeypatch):
    assert [device_count("cpu", d) for d in ("auto", -1, 3, "3", [0, 1], "0,1,", 0, True)] == [
        1,
        1,
        3,
        3,
        2,
        2,
        None,
        None,
    ]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [device_count(a, "auto") for a in ("auto", "gpu", "cuda", "cpu")] == [4, 4, 4, 1]


def test_devices_written_another_way_are_the_same_devices():
    preset = MemoryPreset(effective_batch_size=16, micro_batch_size=4, devices=2)
    kwargs = preset.trainer_kwargs(accelerator="cpu", devices="2")
    give_back_allocator_settings(kwargs["callbacks"])
    assert kwargs["devices"] == "2"
    with pytest.raises(ValueError, match="`devices=3` differs from the preset's `devices=2`"):
        preset.trainer_kwargs(accelerator="cpu", devices=3)


# ------------------------------------------------------------------------------------------------ LightningCLI


def _cli(args, tmp_path, run=False):
    LightningCLI = lightning_module("cli").LightningCLI

    class CLI(MemoryPresetCLI, LightningCLI):
        memory_batch_size_target = "model.batch_size"

    base = [
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.accelerator=cpu",
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CLI(TinyModel, run=run, args=[*(["fit"] if run else []), *base, *args], save_config_callback=None)


def test_the_cli_runs_without_a_memory_section(tmp_path):
    cli = _cli(["--trainer.max_steps=2", "--trainer.limit_val_batches=0"], tmp_path, run=True)
    assert cli.trainer.global_step == 2
    assert cli.model.batch_size == DEFAULT_BATCH_SIZE
    assert cli.trainer.train_dataloader.batch_size == DEFAULT_BATCH_SIZE
    assert cli.config.fit.memory.name == "balanced"


def test_the_cli_lists_preset_names_and_refuses_a_typo_while_parsing(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _cli(["--help"], tmp_path)
    assert "{max-savings,balanced,max-speed}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        _cli(["--memory.name=max-sped"], tmp_path)
    err = capsys.readouterr().err
    assert 'Parser key "memory.name"' in err and "max-sped" in err
    with pytest.raises(SystemExit):
        _cli(["--memory.precision=fp16"], tmp_path)
    assert 'Parser key "memory.precision"' in capsys.readouterr().err


def test_the_cli_s_errors_name_config_keys(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"`memory.effective_batch_size`=100 is not divisible by"
        r" `memory.micro_batch_size`",
    ):
        _cli(["--memory.effective_batch_size=100", "--memory.micro_batch_size=16"], tmp_path)
    with pytest.raises(
        ValueError,
        match=r"`trainer.accumulate_grad_batches=2` contradicts .*"
        r"`memory.effective_batch_size`",
    ):
        _cli(
            ["--memory.effective_batch_size=16", "--memory.micro_batch_size=4", "--trainer.accumulate_grad_batches=2"],
            tmp_path,
        )


def test_trainer_devices_flow_into_the_preset(tmp_path):
    cli = _cli(
        [
            "--memory.effective_batch_size=16",
            "--memory.micro_batch_size=4",
            "--trainer.devices=2",
            "--trainer.strategy=ddp",
        ],
        tmp_path,
    )
    give_back_allocator_settings(cli.trainer.callbacks)  # never fit, never torn down
    assert cli.config.memory.devices == 2
    assert cli.trainer.accumulate_grad_batches == 2  # 16 = 4 x 2 devices x 2
    assert cli.model.batch_size == 4
    with pytest.raises(SystemExit):  # set once, under trainer
        _cli(["--memory.devices=2"], tmp_path)


def test_your_callbacks_in_the_config_replace_the_preset_s(tmp_path):
    cli = _cli(
        [
            "--memory.name=max-savings",
            "--memory.allocator_conf=",
            "--trainer.callbacks+=MemoryMonitor",
            "--trainer.callbacks.log_every_n_steps=7",
        ],
        tmp_path,
    )
    monitors = [c for c in cli.trainer.callbacks if isinstance(c, MemoryMonitor)]
    assert len(monitors) == 1 and monitors[0].log_every_n_steps == 7
