import dataclasses
import importlib
import itertools
import os
import time
import typing
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
    MemoryPrecision,
    MemoryPreset,
)
from lightning_memopt.functional.allocator import ALLOC_CONF_ENV
from lightning_memopt.functional.presets import PRESET_NAMES, PRESETS
from lightning_memopt.presets import DEFAULT_BATCH_SIZE, PresetName
from tests.helpers.lightning import NAMESPACE, lightning_module, pl
from tests.helpers.models import TinyModel
from tests.helpers.presets_cli import memory_cli_class
from tests.helpers.trainer import make_trainer


@pytest.fixture(autouse=True)
def _clean_alloc_env(monkeypatch):
    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)


def _types(callbacks):
    return [type(c) for c in callbacks]


def _restore(kwargs):
    for cb in kwargs["callbacks"]:
        if isinstance(cb, AllocatorSettings):
            cb.restore()


@pytest.mark.parametrize("name", ["max-savings", "balanced", "max-speed"])
def test_named_presets_produce_trainer_kwargs(name):
    preset = MemoryPreset.from_name(name, effective_batch_size=128)
    kwargs = preset.trainer_kwargs()
    _restore(kwargs)
    assert kwargs["accumulate_grad_batches"] * preset.batch_size == 128
    assert [type(p) for p in kwargs["plugins"]] == [MemoryPrecision]
    assert "precision" not in kwargs  # one or the other, never both
    assert (GradientCheckpointing in _types(kwargs["callbacks"])) is (name == "max-savings")


def test_max_savings_callbacks_and_knobs():
    preset = MemoryPreset.from_name("max-savings", effective_batch_size=96)
    assert (preset.batch_size, preset.accumulate_grad_batches) == (24, 4)
    kwargs = preset.trainer_kwargs()
    _restore(kwargs)
    assert _types(kwargs["callbacks"]) == [
        MemoryMonitor,
        CacheCleaner,
        GarbageCollector,
        GradientCheckpointing,
        AllocatorSettings,
    ]
    plugin = kwargs["plugins"][0]
    assert (plugin.requested_precision, plugin.float32_matmul_precision) == ("auto", "high")
    assert MemoryPreset.from_name("max-speed").trainer_kwargs()["callbacks"] == []


def test_overrides_and_turning_knobs_off():
    preset = MemoryPreset.from_name(
        "max-savings",
        precision="16-mixed",
        gradient_checkpointing=False,
        allocator_conf="",
        gc_every_n_train_steps=0,
        monitor=False,
        cache_clean_on_phase_end=False,
        float32_matmul_precision="",
    )
    kwargs = preset.trainer_kwargs()
    assert kwargs["callbacks"] == []
    assert (
        kwargs["plugins"][0].requested_precision == "16-mixed" and kwargs["plugins"][0].float32_matmul_precision is None
    )


def test_unknown_preset_lists_valid_names():
    with pytest.raises(
        ValueError, match="Unknown preset `name`='fast'. Valid presets: max-savings, balanced, max-speed"
    ):
        MemoryPreset.from_name("fast")
    with pytest.raises(TypeError, match=r"Unknown `MemoryPreset` field\(s\) \['micro_batch'\]"):
        MemoryPreset.from_name("balanced", micro_batch=4)


def test_effective_batch_smaller_than_micro_times_world():
    with pytest.raises(ValueError, match="`effective_batch_size` must be at least .* = 8 x 4 x 2 = 64, got 32"):
        MemoryPreset(effective_batch_size=32, micro_batch_size=8, devices=4, num_nodes=2)
    with pytest.raises(ValueError, match="Use `effective_batch_size`=96 or 112"):
        MemoryPreset(effective_batch_size=100, micro_batch_size=16)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("precision", "fp16", "`precision` must be one of"),
        ("memory_fraction", 95, r"Did you mean 0.95"),
        ("gc_every_n_train_steps", -1, "`gc_every_n_train_steps` must be a non-negative int"),
        ("allocator_conf", "expandable_segments", "`allocator_conf` entries must look like `key:value`"),
        ("gradient_clip_val", -1.0, "`gradient_clip_val` must be a finite, non-negative number or None, got -1.0"),
        ("gradient_clip_val", float("nan"), "`gradient_clip_val` must be a finite, non-negative .* got nan"),
        ("gradient_clip_val", float("inf"), "`gradient_clip_val` .* got inf. Use None for no clipping"),
        ("gradient_clip_val", "1.0", "`gradient_clip_val` .* got '1.0'"),
        ("checkpoint_modules", 5, r"`checkpoint_modules` must be a non-empty list .* got 5 \(int\)"),
        ("checkpoint_modules", [], r"`checkpoint_modules` must be a non-empty list .* got \[\] \(list\)"),
        ("checkpoint_modules", [""], r"`checkpoint_modules` entries must be non-empty .* got '' in \[''\]"),
        ("checkpoint_modules", ["Linear", 3], r"`checkpoint_modules` entries .* got 3 in \['Linear', 3\]"),
        ("allocator_conf", 5, r"`allocator_conf` must be a str, got 5 \(int\). Example: 'expandable_segments:True'"),
        ("name", ["balanced"], r"`name` must be a preset name \(str\).* got \['balanced'\] \(list\). In YAML"),
        ("gradient_checkpointing", "yes", r"`gradient_checkpointing` must be a bool .* got 'yes'. Leave it None"),
        ("cache_clean_on_phase_end", 0, r"`cache_clean_on_phase_end` must be a bool .* got 0"),
        ("monitor", "false", r"`monitor` must be a bool .* got 'false'"),
        ("allow_emulated_bf16", None, r"`allow_emulated_bf16` must be a bool .* got None"),
        ("tier", 16, r"`tier` must be a str or None, got 16 \(int\)"),
        ("gc_every_n_train_steps", True, "`gc_every_n_train_steps` must be a non-negative int, got True"),
        ("precision", True, "`precision` must be one of .* got True"),
        ("auto_micro_batch", "yes", r"`auto_micro_batch` must be a bool .* got 'yes'. Use True to let AutoMicroBatch"),
        ("auto_micro_batch", None, r"`auto_micro_batch` must be a bool .* got None"),
    ],
)
def test_bad_fields(field, value, match):
    with pytest.raises(ValueError, match=match):
        MemoryPreset(**{field: value})


def test_checkpoint_modules_take_one_name_a_list_or_module_classes():
    assert MemoryPreset(checkpoint_modules="Block").checkpoint_modules == ("Block",)
    assert MemoryPreset(checkpoint_modules=["Block", "enc.*"]).checkpoint_modules == ("Block", "enc.*")
    layer = torch.nn.TransformerEncoderLayer
    assert MemoryPreset(checkpoint_modules=(layer,)).checkpoint_modules == (layer,)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -8, 0, True, "24"])
def test_for_device_refuses_what_is_not_a_memory_size(bad):
    with pytest.raises(ValueError, match=f"`total_memory_gib` must be a finite, positive number, got {bad!r}"):
        MemoryPreset.for_device(bad)


@pytest.mark.parametrize("effective", [10**10, 2**62, 2**61 - 1])
def test_huge_effective_batch_answers_in_well_under_a_second(effective):
    start = time.perf_counter()
    preset = MemoryPreset(effective_batch_size=effective)
    assert preset.batch_size * preset.accumulate_grad_batches == effective
    assert time.perf_counter() - start < 1.0


def test_merge_trainer_config_needs_a_mapping():
    with pytest.raises(ValueError, match=r"`trainer_config` must be a mapping .* got \['max_steps'\] \(list\)"):
        MemoryPreset().merge_trainer_config(["max_steps"])


def test_preset_is_frozen_and_describes_every_knob():
    preset = MemoryPreset.from_name("balanced", effective_batch_size=32, micro_batch_size=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        preset.precision = "32-true"
    text = str(preset)
    assert text == preset.describe()
    for knob in (
        "precision",
        "float32_matmul_precision",
        "gradient_checkpointing",
        "accumulate_grad_batches",
        "allocator_conf",
        "memory_fraction",
        "gradient_clip_val",
        "monitor",
    ):
        assert knob in text
    line = next(row for row in text.splitlines() if row.startswith("accumulate_grad_batches"))
    assert line.split()[1] == "4"


def test_conflicting_trainer_arguments_say_which_to_drop():
    preset = MemoryPreset(effective_batch_size=32, micro_batch_size=8, gradient_clip_val=1.0)
    with pytest.raises(ValueError, match=r"Both `precision='bf16-mixed'` .* Drop `precision=` from the Trainer"):
        preset.trainer_kwargs(precision="bf16-mixed")
    MixedPrecision = lightning_module("plugins.precision").MixedPrecision

    with pytest.raises(ValueError, match=r"Both `plugins=\[MixedPrecision\(...\)\]` .* Drop that precision plugin"):
        preset.trainer_kwargs(plugins=[MixedPrecision("bf16-mixed", "cpu")])
    with pytest.raises(
        ValueError, match="`accumulate_grad_batches=2` contradicts the preset's accumulate_grad_batches=4"
    ):
        preset.trainer_kwargs(accumulate_grad_batches=2)
    with pytest.raises(ValueError, match="`devices=2` differs from the preset's `devices=1`"):
        preset.trainer_kwargs(devices=2)
    with pytest.raises(ValueError, match="`gradient_clip_val=0.5` contradicts"):
        preset.trainer_kwargs(gradient_clip_val=0.5)


def test_user_callbacks_and_plugins_are_kept_first():
    mine = GradientCheckpointing(checkpoint_modules=["x"])
    kwargs = MemoryPreset.from_name("max-speed").trainer_kwargs(callbacks=mine, max_steps=3)
    assert kwargs["callbacks"][0] is mine and kwargs["max_steps"] == 3
    assert "devices" not in kwargs  # no effective batch: the preset does not pin the world size


def test_fsdp_strategy_gets_a_precision_string_not_the_plugin():
    kwargs = MemoryPreset.from_name("max-speed", precision="bf16-mixed").trainer_kwargs(strategy="fsdp")
    assert kwargs["precision"] == "bf16-mixed" and "plugins" not in kwargs
    kwargs = MemoryPreset.from_name("max-speed").trainer_kwargs(strategy="deepspeed_stage_2")
    assert kwargs["precision"] == "32-true"  # "auto" resolved on this (CPU) machine


def test_for_device_tiers():
    assert MemoryPreset.for_device(8).name == "max-savings"
    assert MemoryPreset.for_device(16, effective_batch_size=64).tier == "16GB"
    assert MemoryPreset.for_device(80, precision="16-mixed").precision == "16-mixed"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU fallback")
def test_for_device_without_gpu_warns_and_uses_balanced():
    with pytest.warns(UserWarning, match="found no CUDA device .* Pass `total_memory_gib=`"):
        assert MemoryPreset.for_device().name == "balanced"


def test_trainer_kwargs_leave_allocator_settings_to_setup_and_fit_restores_them(tmp_path):
    preset = MemoryPreset.from_name(
        "max-savings", effective_batch_size=8, micro_batch_size=4, monitor=False, memory_fraction=0.5
    )
    kwargs = preset.trainer_kwargs()
    assert ALLOC_CONF_ENV not in os.environ  # applied at setup, not when the arguments are built
    model = TinyModel(batch_size=preset.batch_size)
    trainer = make_trainer(tmp_path, max_steps=2, **{k: v for k, v in kwargs.items() if k not in ("devices",)})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    assert trainer.accumulate_grad_batches == 2
    assert trainer.global_step == 2
    assert ALLOC_CONF_ENV not in os.environ
    assert not any("memory_fraction" in str(w.message) for w in caught)  # CPU: named in the inactive line instead


def test_existing_user_allocator_env_wins(monkeypatch):
    monkeypatch.setenv(ALLOC_CONF_ENV, "expandable_segments:False,max_split_size_mb:128")
    kwargs = MemoryPreset.from_name("balanced").trainer_kwargs()
    assert os.environ[ALLOC_CONF_ENV] == "expandable_segments:False,max_split_size_mb:128"
    _restore(kwargs)
    assert os.environ[ALLOC_CONF_ENV] == "expandable_segments:False,max_split_size_mb:128"


def test_preset_fits_with_a_full_trainer(tmp_path):
    kwargs = MemoryPreset.from_name("max-savings", effective_batch_size=8, micro_batch_size=2).trainer_kwargs()
    trainer = make_trainer(tmp_path, max_steps=2, limit_train_batches=8, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(TinyModel(batch_size=2))
    assert trainer.global_step == 2 and trainer.accumulate_grad_batches == 4
    assert trainer.precision == "32-true"  # auto on CPU
    assert ALLOC_CONF_ENV not in os.environ


def test_usable_from_yaml_with_jsonargparse(tmp_path):
    from jsonargparse import ArgumentParser

    config = tmp_path / "preset.yaml"
    config.write_text(
        "preset:\n  name: max-savings\n  effective_batch_size: 128\n  micro_batch_size: 16\n"
        "  checkpoint_modules: [TransformerEncoderLayer]\n"
        "trainer_plugin:\n  class_path: lightning_memopt.MemoryPrecision\n  init_args:\n    precision: 16-mixed\n"
    )
    parser = ArgumentParser()
    parser.add_class_arguments(MemoryPreset, "preset")
    parser.add_argument("--trainer_plugin", type=MemoryPrecision)
    parser.add_argument("--config", action="config")
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    init = instantiate(parser.parse_args([f"--config={config}"]))
    preset = init.preset
    assert isinstance(preset, MemoryPreset) and preset.accumulate_grad_batches == 8
    assert preset.checkpoint_modules == ("TransformerEncoderLayer",)
    assert isinstance(init.trainer_plugin, MemoryPrecision) and init.trainer_plugin.requested_precision == "16-mixed"


def test_merge_trainer_config_fills_defaults_and_keeps_real_conflicts():
    import inspect

    Trainer = pl.Trainer

    # a complete trainer config with every argument at its default, as LightningCLI passes it
    full = {
        p.name: p.default
        for p in inspect.signature(Trainer.__init__).parameters.values()
        if p.default is not inspect.Parameter.empty
    }
    preset = MemoryPreset.from_name("max-speed", effective_batch_size=32, micro_batch_size=8, gradient_clip_val=1.0)
    with pytest.raises(ValueError, match="contradicts the preset's accumulate_grad_batches=4"):
        preset.trainer_kwargs(**full)  # the plain method takes the default 1 as a choice
    kwargs = preset.merge_trainer_config({**full, "max_steps": 7})
    assert kwargs["accumulate_grad_batches"] == 32 // 8 and kwargs["gradient_clip_val"] == 1.0
    assert (kwargs["devices"], kwargs["num_nodes"], kwargs["max_steps"]) == (1, 1, 7)
    assert kwargs["precision"] is None and [type(p) for p in kwargs["plugins"]] == [MemoryPrecision]
    assert set(kwargs) == set(full)  # nothing dropped, nothing invented
    no_plan = MemoryPreset.from_name("max-speed").merge_trainer_config(full)
    assert no_plan["devices"] == full["devices"]  # without an effective batch the world size is the user's
    with pytest.raises(ValueError, match=r"Both `precision='16-mixed'` .* Drop `precision=`"):
        preset.merge_trainer_config({**full, "precision": "16-mixed"})
    with pytest.raises(ValueError, match="`accumulate_grad_batches=2` contradicts"):
        preset.merge_trainer_config({**full, "accumulate_grad_batches": 2})
    with pytest.raises(ValueError, match="`devices=2` differs from the preset's `devices=1`"):
        preset.merge_trainer_config({**full, "devices": 2})


CLI_YAML = """
memory:
  name: max-savings
  effective_batch_size: 16
  micro_batch_size: 4
  checkpoint_modules: [Linear]
  monitor: false
trainer:
  accelerator: cpu
  max_steps: 2
  limit_train_batches: 8
  limit_val_batches: 0
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  default_root_dir: {root}
  callbacks:
    - class_path: {namespace}.callbacks.ModelSummary
      init_args:
        max_depth: 2
"""


@pytest.mark.parametrize("subcommand", [False, True], ids=["run_false", "fit_subcommand"])
def test_lightning_cli_yaml_builds_the_trainer_from_the_preset(tmp_path, subcommand):
    ModelSummary = lightning_module("callbacks").ModelSummary

    config = tmp_path / "config.yaml"
    config.write_text(CLI_YAML.format(root=tmp_path, namespace=NAMESPACE))
    args = ["fit", f"--config={config}"] if subcommand else [f"--config={config}"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = memory_cli_class()(TinyModel, run=subcommand, args=args, save_config_callback=None)
        if not subcommand:
            cli.trainer.fit(cli.model)
    trainer, preset = cli.trainer, MemoryPreset.from_name("max-savings", effective_batch_size=16, micro_batch_size=4)
    assert trainer.accumulate_grad_batches == preset.accumulate_grad_batches == 4
    assert cli.model.batch_size == preset.batch_size == 4  # linked from the preset
    assert (
        isinstance(trainer.precision_plugin, MemoryPrecision) and trainer.precision_plugin.requested_precision == "auto"
    )
    types = _types(trainer.callbacks)
    assert ModelSummary in types  # the user's callbacks are kept
    assert types.index(ModelSummary) < types.index(GradientCheckpointing)
    assert CacheCleaner in types and GarbageCollector in types and MemoryMonitor not in types
    checkpointing = next(c for c in trainer.callbacks if isinstance(c, GradientCheckpointing))
    assert checkpointing.checkpoint_modules == ["Linear"]
    assert trainer.global_step == 2
    assert ALLOC_CONF_ENV not in os.environ  # AllocatorSettings gave the variable back at teardown


@pytest.mark.parametrize(
    ("total_gib", "name", "tier"),
    [
        (7.6, "max-savings", "8GB"),
        (15.8, "balanced", "16GB"),
        (23.6, "max-speed", "24GB+"),
        (79.1, "max-speed", "24GB+"),
    ],
)
def test_for_device_reads_the_current_gpu(monkeypatch, total_gib, name, tier):
    from types import SimpleNamespace

    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda index: asked.append(index) or SimpleNamespace(total_memory=int(total_gib * 2**30)),
    )
    preset = MemoryPreset.for_device(effective_batch_size=64)
    assert (preset.name, preset.tier) == (name, tier) and asked == [1]
    assert preset.batch_size * preset.accumulate_grad_batches == 64


# ------------------------------------------------------------------------------------------------ auto_micro_batch


def _auto_micro_batches(callbacks):
    return [c for c in callbacks if isinstance(c, AutoMicroBatch)]


@pytest.mark.parametrize(("micro", "start"), [(None, "auto"), (16, 16)])
def test_auto_micro_batch_plan_gives_the_dataloader_the_whole_per_device_batch(micro, start):
    preset = MemoryPreset.from_name(
        "max-savings", effective_batch_size=128, micro_batch_size=micro, devices=2, auto_micro_batch=True
    )
    assert (preset.batch_size, preset.accumulate_grad_batches, preset.auto_micro_batch_start) == (64, 1, start)
    kwargs = preset.trainer_kwargs()
    _restore(kwargs)
    assert kwargs["accumulate_grad_batches"] == 1 and kwargs["devices"] == 2
    (callback,) = _auto_micro_batches(kwargs["callbacks"])
    assert callback.start_micro_batch_size == start
    assert callback.micro_batch_size == (None if micro is None else micro)
    # the preset's other callbacks are still there; without the flag there is no AutoMicroBatch
    assert GradientCheckpointing in _types(kwargs["callbacks"])
    plain = MemoryPreset.from_name("max-savings", effective_batch_size=128, micro_batch_size=micro, devices=2)
    plain_kwargs = plain.trainer_kwargs()
    _restore(plain_kwargs)
    assert not _auto_micro_batches(plain_kwargs["callbacks"]) and plain.auto_micro_batch_start is None
    assert plain_kwargs["accumulate_grad_batches"] == 64 // plain.batch_size > 1


def _row(text, knob):
    """The row of ``knob`` in a preset's printout, its wrapped continuation lines joined."""
    lines = text.splitlines()
    start = next(i for i, row in enumerate(lines) if row.startswith(knob))
    rest = [row.strip() for row in itertools.takewhile(lambda row: row.startswith(" "), lines[start + 1 :])]
    return " ".join([lines[start], *rest])


def test_auto_micro_batch_printout_explains_the_split():
    text = MemoryPreset(effective_batch_size=96, micro_batch_size=8, devices=3, auto_micro_batch=True).describe()
    line = _row(text, "auto_micro_batch")
    assert line.split()[1] == "True"
    assert line.endswith(
        "the DataLoader yields the whole per-device batch (32) and AutoMicroBatch splits it into micro-batches"
        " (from 8), halving on out-of-memory with the same effective batch."
    )
    assert next(row for row in text.splitlines() if row.startswith("batch_size")).split()[:4] == [
        "batch_size",
        "(per",
        "device)",
        "32",
    ]
    off = next(row for row in MemoryPreset().describe().splitlines() if row.startswith("auto_micro_batch"))
    assert off.split()[1:3] == ["False", "off:"]


def test_auto_micro_batch_start_must_divide_and_needs_an_effective_batch():
    with pytest.raises(ValueError, match=r"12 x 1 = 12. .* or `micro_batch_size` in \[5, 8, 10\]"):
        MemoryPreset(effective_batch_size=40, micro_batch_size=12, auto_micro_batch=True)
    with pytest.raises(ValueError, match="`effective_batch_size`=40 is not divisible by the world size 3"):
        MemoryPreset(effective_batch_size=40, devices=3, auto_micro_batch=True)
    with pytest.raises(ValueError, match=r"`micro_batch_size`=8 with `auto_micro_batch=True` needs `effective_batch"):
        MemoryPreset(micro_batch_size=8, auto_micro_batch=True)
    # without an effective batch the DataLoader's batch is the default; AutoMicroBatch splits it from the whole batch
    no_plan = MemoryPreset.from_name("max-speed", auto_micro_batch=True)
    assert no_plan.batch_size == DEFAULT_BATCH_SIZE and no_plan.auto_micro_batch_start == "auto"
    assert [type(c) for c in no_plan.trainer_kwargs()["callbacks"]] == [AutoMicroBatch]


def test_auto_micro_batch_keeps_your_own_callback_and_refuses_accumulation():
    preset = MemoryPreset.from_name("max-speed", effective_batch_size=32, auto_micro_batch=True)
    mine = AutoMicroBatch(micro_batch_size=4, min_micro_batch_size=2)
    kwargs = preset.trainer_kwargs(callbacks=[mine])
    assert _auto_micro_batches(kwargs["callbacks"]) == [mine]  # yours, not a second one
    with pytest.raises(
        ValueError,
        match=r"`accumulate_grad_batches=4` contradicts the preset's accumulate_grad_batches"
        r"=1. .*with `auto_micro_batch=True` the DataLoader yields the whole",
    ):
        preset.trainer_kwargs(accumulate_grad_batches=4)


class _BudgetModel(TinyModel):
    """TinyModel whose forward runs out of memory (simulated) above ``budget`` samples; records the sizes it saw."""

    def __init__(self, batch_size: int, budget: int | None = None) -> None:
        torch.manual_seed(0)
        super().__init__(batch_size=batch_size)
        self.budget, self.seen = budget, []

    def forward(self, x):
        self.seen.append(len(x))
        if self.budget is not None and len(x) > self.budget:
            raise torch.OutOfMemoryError(f"simulated: {len(x)} samples, budget {self.budget}")
        return super().forward(x)


def test_auto_micro_batch_preset_fits_and_matches_the_accumulation_preset(tmp_path):
    """The auto plan halves 16 -> 8 -> 4 and ends bitwise equal to the plain preset at micro-batch 4 x 4 steps."""
    knobs = {"effective_batch_size": 16, "monitor": False, "cache_clean_on_phase_end": False, "allocator_conf": ""}
    auto = MemoryPreset.from_name("balanced", auto_micro_batch=True, **knobs)
    model = _BudgetModel(auto.batch_size, budget=4)
    trainer = make_trainer(tmp_path / "auto", max_steps=3, limit_train_batches=None, **auto.trainer_kwargs())
    trainer.fit(model)
    (callback,) = _auto_micro_batches(trainer.callbacks)
    assert (callback.micro_batch_size, callback.retries) == (4, 2)
    assert model.seen[:3] == [16, 8, 4] and set(model.seen[3:]) == {4}
    plain = MemoryPreset.from_name("balanced", micro_batch_size=4, **knobs)
    reference = _BudgetModel(plain.batch_size)
    ref_trainer = make_trainer(tmp_path / "plain", max_steps=3, limit_train_batches=None, **plain.trainer_kwargs())
    ref_trainer.fit(reference)
    assert (trainer.accumulate_grad_batches, ref_trainer.accumulate_grad_batches) == (1, 4)
    assert trainer.global_step == ref_trainer.global_step == 3
    for name, expected in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], expected), name


def test_auto_micro_batch_from_yaml_and_a_full_trainer_config(tmp_path):
    from jsonargparse import ArgumentParser

    config = tmp_path / "preset.yaml"
    config.write_text("preset:\n  name: max-speed\n  effective_batch_size: 64\n  auto_micro_batch: true\n")
    parser = ArgumentParser()
    parser.add_class_arguments(MemoryPreset, "preset")
    parser.add_argument("--config", action="config")
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    preset = instantiate(parser.parse_args([f"--config={config}"])).preset
    assert preset.auto_micro_batch is True and (preset.batch_size, preset.accumulate_grad_batches) == (64, 1)
    import inspect

    Trainer = pl.Trainer

    full = {
        p.name: p.default
        for p in inspect.signature(Trainer.__init__).parameters.values()
        if p.default is not inspect.Parameter.empty
    }
    kwargs = preset.merge_trainer_config(full)
    assert kwargs["accumulate_grad_batches"] == 1 and [type(c) for c in kwargs["callbacks"]] == [AutoMicroBatch]


def test_auto_micro_batch_through_lightning_cli(tmp_path):
    """The documented MemoryCLI: ``memory.auto_micro_batch: true`` links the per-device batch and adds the callback."""
    ModelSummary = lightning_module("callbacks").ModelSummary

    config = tmp_path / "config.yaml"
    yaml = CLI_YAML.format(root=tmp_path, namespace=NAMESPACE)
    yaml = yaml.replace("  micro_batch_size: 4\n", "  auto_micro_batch: true\n")
    config.write_text(yaml)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = memory_cli_class()(TinyModel, run=False, args=[f"--config={config}"], save_config_callback=None)
    _restore({"callbacks": cli.trainer.callbacks})
    assert cli.model.batch_size == 16 and cli.trainer.accumulate_grad_batches == 1
    (callback,) = _auto_micro_batches(cli.trainer.callbacks)
    assert callback.start_micro_batch_size == "auto"
    assert ModelSummary in _types(cli.trainer.callbacks)  # the user's callbacks are kept


# ------------------------------------------------------------------------------------------------ the table, in use


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_each_preset_turns_on_what_its_table_entry_says(name):
    entry = PRESETS[name]
    assert typing.get_args(PresetName) == PRESET_NAMES  # LightningCLI's choices are the table's presets
    preset = MemoryPreset.from_name(name, effective_batch_size=96)
    kwargs = preset.trainer_kwargs()
    _restore(kwargs)
    expected = [
        kind
        for kind, on in (
            (MemoryMonitor, entry["monitor"]),
            (CacheCleaner, entry["cache_clean_on_phase_end"]),
            (GarbageCollector, entry["gc_every_n_train_steps"] > 0),
            (GradientCheckpointing, entry["gradient_checkpointing"]),
            (AllocatorSettings, bool(entry["allocator_conf"])),
        )
        if on
    ]
    assert _types(kwargs["callbacks"]) == expected
    plugin = kwargs["plugins"][0]
    assert plugin.requested_precision == entry["precision"]
    assert plugin.float32_matmul_precision == (entry["float32_matmul_precision"] or None)
    # the fewest accumulation steps at or above the preset's target that divide the batch
    accumulation = kwargs["accumulate_grad_batches"]
    assert accumulation * preset.batch_size == 96 and accumulation >= entry["target_accumulation"]
    assert not any(96 % a == 0 for a in range(entry["target_accumulation"], accumulation))


def test_the_presets_live_in_one_place():
    """No second path: ``lightning_memopt.plugins`` has the precision plugin only, ``plugins.presets`` is gone."""
    import lightning_memopt
    import lightning_memopt.plugins as plugins

    assert lightning_memopt.MemoryPreset is MemoryPreset and lightning_memopt.AllocatorSettings is AllocatorSettings
    assert plugins.__all__ == ["MemoryPrecision"]
    with pytest.raises(AttributeError):
        plugins.MemoryPreset  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("lightning_memopt.plugins.presets")


@pytest.mark.slow
def test_planning_never_imports_the_presets(tmp_path):
    """The planner sits below the presets: a plan is made without importing them (``from_plan`` builds the preset)."""
    from tests.helpers.subprocess_run import run_script

    code = """
import sys
import torch
from lightning_memopt.planner import plan_memory
plan = plan_memory(torch.nn.Linear(8, 8), lambda b: torch.randn(b, 8), effective_batch_size=4, budget="1GB",
                   device="cpu")
print("PRESETS", "lightning_memopt.presets" in sys.modules, plan.feasible)
"""
    proc = run_script(code, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "PRESETS False True" in proc.stdout


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_print_preset_fits_100_columns(name):
    """Every row of ``print(preset)`` fits 100 columns (long values and reasons wrap under their column)."""
    blocks = ("TransformerEncoderLayer", "encoder.layers.*", "decoder.block.*.layer.*", torch.nn.Linear)
    for preset in (
        MemoryPreset.from_name(name),
        MemoryPreset.from_name(name, effective_batch_size=2**40, devices=2**20, auto_micro_batch=True, tier="24GB+"),
        MemoryPreset.from_name(name, checkpoint_modules=blocks, memory_fraction=0.123456789, gradient_clip_val=1e-9),
    ):
        lines = str(preset).splitlines()
        assert max(map(len, lines)) <= 100, str(preset)
        assert lines[0].startswith(f"MemoryPreset {name!r}")
        text = " ".join(lines)
        assert "gc_every_n_train_steps" in text and "gc_every_n_steps" not in text


def test_gc_every_n_train_steps_is_the_field_and_the_old_name_is_gone():
    preset = MemoryPreset("balanced", gc_every_n_train_steps=7)
    (collector,) = [c for c in preset.callbacks() if isinstance(c, GarbageCollector)]
    assert preset.gc_every_n_train_steps == 7 and 7 in vars(collector).values()  # its interval, whatever its name
    assert "gc_every_n_steps" not in {f.name for f in dataclasses.fields(MemoryPreset)}
    with pytest.raises(TypeError):
        MemoryPreset("balanced", gc_every_n_steps=7)
