"""The zoo's LightningCLI project (``tests/helpers/zoo_cli``): ``MemoryPresetCLI`` with the configs users write
(``class_path`` + ``init_args``, or a CLI given the classes), trained and estimated, against plain Lightning."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lightning_memopt import (
    AllocatorSettings,
    CacheCleaner,
    GarbageCollector,
    GradientCheckpointing,
    MemoryMonitor,
    MemoryPrecision,
    MemoryPreset,
    MemoryPresetCLI,
)
from lightning_memopt.cli import main as memopt_main
from lightning_memopt.planner import estimate_memory, plan_memory
from lightning_memopt.utilities.formatting import format_bytes
from tests.helpers.lightning import lightning_module, pl
from tests.helpers.models import TinyModel
from tests.helpers.presets_env import give_back_allocator_settings
from tests.helpers.zoo_cli import CONFIG, CONFIG_FIXED, ZooClassifier, ZooCLI, ZooDataModule, main

pytestmark = pytest.mark.zoo

STYLES = {"class_path": (CONFIG, True), "fixed": (CONFIG_FIXED, False)}


def _config(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _cli(tmp_path, style: str, *args: str, run: bool = False, target: str | None = "auto", config=None) -> Any:
    path, subclass_mode = STYLES[style]

    class CLI(ZooCLI):
        memory_batch_size_target = target

    argv = [f"--config={config or path}", f"--trainer.default_root_dir={tmp_path}", *args]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return main(
            ["fit", *argv] if run else argv,
            subclass_mode=subclass_mode,
            run=run,
            cli=CLI,
            save_config_callback=None,
        )


def _first_batch(cli) -> int:
    return len(next(iter(cli.datamodule.train_dataloader()))[0])


# ---------------------------------------------------------------------------------------- memory_batch_size_target


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("target", ["auto", "data.batch_size", "data.init_args.batch_size"])
def test_the_preset_s_batch_reaches_the_dataloader_in_either_config_style(tmp_path, style, target):
    cli = _cli(tmp_path, style, target=target)
    give_back_allocator_settings(cli.trainer.callbacks)  # never fit, never torn down
    preset = cli.config_init.memory
    data = _config(STYLES[style][0])["data"]
    assert data.get("init_args", data)["batch_size"] == 16  # what the config says; the preset decides
    assert preset.micro_batch_size == 4 and cli.datamodule.batch_size == 4
    assert _first_batch(cli) == preset.micro_batch_size
    assert cli.trainer.accumulate_grad_batches == 4


@pytest.mark.parametrize("style", ["class_path", pytest.param("fixed", marks=pytest.mark.slow)])
def test_the_fit_subcommand_trains_like_plain_lightning_with_the_preset_s_trainer_arguments(tmp_path, style):
    """Two optimizer steps of 4 x 4 samples with the preset's callbacks (checkpointed blocks with dropout among
    them) give the weights of a plain Trainer(accumulate_grad_batches=4, precision="32-true") at batch 4."""
    cli = _cli(tmp_path / "cli", style, run=True)
    assert cli.trainer.global_step == 2
    assert cli.trainer.train_dataloader.batch_size == 4 and cli.trainer.accumulate_grad_batches == 4
    kinds = [type(c) for c in cli.trainer.callbacks]
    for kind in (MemoryMonitor, CacheCleaner, GarbageCollector, GradientCheckpointing, AllocatorSettings):
        assert kind in kinds, kind
    assert cli.trainer.precision == "32-true"

    config = _config(STYLES[style][0])
    init = {k: v for k, v in config["model"].items() if k not in ("class_path", "init_args")}
    init.update(config["model"].get("init_args", {}))
    pl.seed_everything(config["seed_everything"], workers=True)
    data = ZooDataModule(batch_size=4)
    reference = ZooClassifier(**init)
    trainer = pl.Trainer(
        default_root_dir=tmp_path / "plain", accumulate_grad_batches=4, precision="32-true", **config["trainer"]
    )
    trainer.fit(reference, data)
    assert trainer.global_step == 2
    got, expected = cli.model.state_dict(), reference.state_dict()
    assert list(got) == list(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    assert not torch.equal(expected["head.weight"], ZooClassifier(**init).head.weight)  # it trained


def test_auto_finds_the_model_s_batch_size_when_there_is_no_datamodule(tmp_path):
    """The documented default target, data.batch_size, crashed a CLI given only a model (data is then optional)."""

    class CLI(MemoryPresetCLI, lightning_module("cli").LightningCLI):
        pass

    args = ["--memory.effective_batch_size=16", "--memory.micro_batch_size=2", "--trainer.accelerator=cpu"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = CLI(TinyModel, run=False, args=[*args, f"--trainer.default_root_dir={tmp_path}"])
    give_back_allocator_settings(cli.trainer.callbacks)
    assert cli.datamodule is None
    assert cli.model.batch_size == 2 and cli.trainer.accumulate_grad_batches == 8


class NoBatchSize(ZooDataModule):
    """A datamodule whose batch is not an init argument."""

    def __init__(self, samples: int = 32) -> None:
        super().__init__(batch_size=8, samples=samples)


def test_a_class_path_without_the_target_argument_is_refused_by_name(tmp_path):
    config = _config(CONFIG)
    config["data"] = {"class_path": f"{__name__}.NoBatchSize"}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match=r"`memory_batch_size_target`='data.batch_size': .*NoBatchSize .*has no"):
        _cli(tmp_path, "class_path", target="data.batch_size", config=path)
    with pytest.warns(UserWarning, match="no `batch_size` init argument in NoBatchSize or ZooClassifier"):
        cli = _default_cli(tmp_path, path)
    give_back_allocator_settings(cli.trainer.callbacks)


def _default_cli(tmp_path, path) -> Any:
    """``ZooCLI`` as the project defines it (target ``"auto"``), its warnings left to the test."""
    return main([f"--config={path}", f"--trainer.default_root_dir={tmp_path}"], run=False, save_config_callback=None)


# ------------------------------------------------------------------------------------------ lightning-memopt estimate


def _estimate(capsys, *argv) -> tuple[int, str, str]:
    code = memopt_main(["estimate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_estimate_reads_the_memory_section_and_equals_a_real_cpu_step(capsys, monkeypatch):
    """The preset's micro-batch (4, not the datamodule's 16) and its checkpointed blocks are what is estimated; the
    estimate is the byte count of a real CPU step with those settings."""
    import lightning_memopt.planner as planner

    seen = []

    def spy(module, batch, **kwargs):
        seen.append((len(batch[0]), kwargs))
        seen.append(estimate_memory(module, batch, **kwargs))
        return seen[-1]

    monkeypatch.setattr(planner, "estimate_memory", spy)
    code, out, err = _estimate(capsys, "--config", str(CONFIG), "--device", "cpu")
    assert code == 0, err
    (size, kwargs), predicted = seen
    assert size == 4 and kwargs["precision"] == "32-true"
    assert kwargs["gradient_checkpointing"] is True and kwargs["checkpoint_modules"] == ["ZooBlock"]
    init = _config(CONFIG)["model"]["init_args"]
    data = ZooDataModule(batch_size=4)
    batch = next(iter(data.train_dataloader()))
    blocks = {"gradient_checkpointing": True, "checkpoint_modules": ["ZooBlock"]}
    measured = estimate_memory(ZooClassifier(**init), batch, device="cpu", **blocks, fake=False)
    assert predicted.fake and not measured.fake
    assert predicted.peak_bytes == measured.peak_bytes > 0
    assert f"on cpu at 32-true: {format_bytes(measured.peak_bytes)} (fake tensors" in out
    assert "Batch 4: " in out


def test_the_planned_snippet_pasted_into_the_config_gives_the_planned_trainer_arguments(tmp_path, capsys):
    init = _config(CONFIG)["model"]["init_args"]

    def batch_fn(b):  # the first b samples, collated as the DataLoader does it
        return next(iter(ZooDataModule(batch_size=b).train_dataloader()))

    blocks = {"gradient_checkpointing": True, "checkpoint_modules": ["ZooBlock"]}
    needs = {b: estimate_memory(ZooClassifier(**init), batch_fn(b), device="cpu", **blocks) for b in (8, 16)}
    assert needs[8].peak_bytes < needs[16].peak_bytes
    budget = (needs[8].peak_bytes + needs[16].peak_bytes) // 2  # 8 fits, 16 does not
    code, out, err = _estimate(
        capsys, "--config", str(CONFIG), "--device", "cpu", "--device-memory", str(budget), "--margin", "0"
    )
    assert code == 0, err
    plan = plan_memory(
        ZooClassifier(**init),
        batch_fn,
        effective_batch_size=16,
        budget=budget,
        margin=0,
        gradient_checkpointing=True,
        checkpoint_modules=["ZooBlock"],
        device="cpu",
    )
    assert plan.micro_batch_size == 8 and plan.accumulate_grad_batches == 2
    snippet = yaml.safe_load(out.split("to paste into the config:\n", 1)[1])
    assert list(snippet) == ["memory"]
    config = _config(CONFIG)
    config["memory"] = snippet["memory"]
    pasted = tmp_path / "pasted.yaml"
    pasted.write_text(yaml.safe_dump(config))

    cli = _cli(tmp_path, "class_path", config=pasted)
    expected = MemoryPreset.from_plan(plan).trainer_kwargs()
    give_back_allocator_settings(cli.trainer.callbacks, expected["callbacks"])
    assert cli.datamodule.batch_size == plan.micro_batch_size == _first_batch(cli)
    assert cli.trainer.accumulate_grad_batches == expected["accumulate_grad_batches"] == 2
    assert cli.trainer.precision == plan.precision == expected["plugins"][0].precision
    wrapped = [c for c in cli.trainer.callbacks if isinstance(c, GradientCheckpointing)]
    assert (
        [c.checkpoint_modules for c in wrapped]
        == [["ZooBlock"]]
        == [c.checkpoint_modules for c in expected["callbacks"] if isinstance(c, GradientCheckpointing)]
    )
    assert cli.config_init.memory.name == config["memory"]["name"] == "max-savings"  # yours, not the plan's tier


# ------------------------------------------------------------------------- the config LightningCLI saves, run again


def _saving_fit(root: Path, style: str, config: Path, *args: str) -> Any:
    """``fit`` as a user runs it: LightningCLI's SaveConfigCallback writes ``root/config.yaml`` (no logger, so the
    log dir is the root) and ModelCheckpoint writes ``root/checkpoints/``."""
    argv = ["fit", f"--config={config}", f"--trainer.default_root_dir={root}", *args]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return main(argv, subclass_mode=STYLES[style][1], cli=ZooCLI)


def _trainer_arguments(cli) -> dict[str, Any]:
    """What the preset decided, as the Trainer got it."""
    return {
        "accumulate_grad_batches": cli.trainer.accumulate_grad_batches,
        "precision_plugin": (
            isinstance(cli.trainer.precision_plugin, MemoryPrecision),
            type(cli.trainer.precision_plugin).__name__,
            cli.trainer.precision,
        ),
        "callbacks": [type(c).__name__ for c in cli.trainer.callbacks],
        "batch_size": (cli.datamodule.batch_size, cli.trainer.train_dataloader.batch_size),
        "gradient_clip_val": cli.trainer.gradient_clip_val,
    }


def _assert_same_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


@pytest.mark.slow
@pytest.mark.parametrize("style", STYLES)
def test_the_saved_config_trains_again_and_resumes_its_checkpoint(tmp_path, style):
    """``fit --config <log dir>/config.yaml`` gives the first run's Trainer arguments (the preset's accumulation,
    its MemoryPrecision, its callbacks once each, its batch) and its weights; ``--ckpt_path`` resumes as plain
    Lightning resumes the same checkpoint. On the class_path style the checkpoint's hyperparameters named a
    `batch_size` the model does not take, so the resume (and ``load_from_checkpoint``) refused it."""
    first = _saving_fit(tmp_path / "first", style, STYLES[style][0], "--trainer.enable_checkpointing=true")
    saved = tmp_path / "first" / "config.yaml"
    (ckpt,) = (tmp_path / "first" / "checkpoints").glob("*.ckpt")
    again = _saving_fit(tmp_path / "again", style, saved)
    assert again.trainer.global_step == first.trainer.global_step == 2
    expected = _trainer_arguments(first)
    assert expected["accumulate_grad_batches"] == 4 and expected["batch_size"] == (4, 4)
    assert expected["precision_plugin"] == (True, "MemoryPrecision", "32-true")
    assert len(set(expected["callbacks"])) == len(expected["callbacks"])  # each callback once
    assert _trainer_arguments(again) == expected
    _assert_same_weights(again.model.state_dict(), first.model.state_dict())
    resaved, config = _config(tmp_path / "again" / "config.yaml"), _config(saved)
    assert resaved["trainer"].pop("default_root_dir") != config["trainer"].pop("default_root_dir")
    assert resaved == config  # saved again as it was read

    resumed = _saving_fit(tmp_path / "resumed", style, saved, f"--ckpt_path={ckpt}", "--trainer.max_steps=4")
    assert resumed.trainer.global_step == 4 and _trainer_arguments(resumed) == expected
    init = {k: v for k, v in ZooClassifier.load_from_checkpoint(ckpt).hparams.items() if not k.startswith("_")}
    assert init == {k: v for k, v in first.model.hparams.items() if not k.startswith("_")}
    pl.seed_everything(config["seed_everything"], workers=True)
    reference = ZooClassifier(**init)
    trainer_config = {k: config["trainer"][k] for k in ("accelerator", "limit_val_batches", "enable_model_summary")}
    trainer = pl.Trainer(
        default_root_dir=tmp_path / "plain",
        accumulate_grad_batches=4,
        precision="32-true",
        max_steps=4,
        logger=False,
        enable_progress_bar=False,
        **trainer_config,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the checkpoint lists callbacks this Trainer does not have
        trainer.fit(reference, ZooDataModule(batch_size=4), ckpt_path=ckpt)
    assert trainer.global_step == 4
    _assert_same_weights(resumed.model.state_dict(), reference.state_dict())
    assert not torch.equal(reference.head.weight, first.model.head.weight)  # the resumed steps trained


class KwargsClassifier(ZooClassifier):
    """The zoo's classifier taking extra init arguments through ``**kwargs`` (a config's ``dict_kwargs``)."""

    def __init__(self, hidden: int = 32, **kwargs: Any) -> None:
        super().__init__(hidden=hidden)
        self.extra = kwargs


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ({"class_path": "tests.helpers.zoo_cli.ZooClassifier"}, None),
        ({"class_path": f"{__name__}.KwargsClassifier", "dict_kwargs": {"batch_size": 16}}, 16),
    ],
    ids=["no-batch_size", "dict_kwargs"],
)
def test_the_hyperparameters_hold_the_batch_size_the_class_path_got(tmp_path, model, expected):
    """``"auto"`` links the preset's batch to ``model.init_args.batch_size`` before the class is known; a class that
    does not take it gets nothing, and its saved hyperparameters (what a checkpoint stores, what ``--ckpt_path`` and
    ``load_from_checkpoint`` build the model from) do not claim it did."""
    config = _config(CONFIG)
    config["model"] = model
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = _cli(tmp_path, "class_path", config=path)
    give_back_allocator_settings(cli.trainer.callbacks)
    assert cli.datamodule.batch_size == 4  # the preset's batch went where it can
    got = getattr(cli.model, "extra", {}).get("batch_size")
    assert got == expected
    assert cli.model.hparams.get("batch_size") == cli.model.hparams_initial.get("batch_size") == expected
    init = {k: v for k, v in cli.model.hparams.items() if not k.startswith("_")}
    assert type(cli.model)(**init).hparams.get("batch_size") == expected  # the class takes its hyperparameters


def _edited(tmp_path, style: str, edit: dict[str, dict[str, Any]]) -> Path:
    """The config LightningCLI's SaveConfigCallback writes for the project (the parser's dump of every field), with
    ``edit`` applied by section as a user edits it."""
    cli = _cli(tmp_path, style)
    give_back_allocator_settings(cli.trainer.callbacks)
    config = yaml.safe_load(cli.parser.dump(cli.config, skip_none=False))
    for section, values in edit.items():
        config[section].update(values)
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            {"trainer": {"accumulate_grad_batches": 2}},
            r"^`trainer.accumulate_grad_batches=2` contradicts the preset's accumulate_grad_batches=4\. Drop",
        ),
        (
            {"trainer": {"precision": "16-mixed"}},
            r"^Both `trainer.precision='16-mixed'` and the preset's MemoryPrecision plugin were given\. Drop",
        ),
        (
            {"memory": {"effective_batch_size": 18}},
            r"^`memory.effective_batch_size`=18 is not divisible by `memory.micro_batch_size` x world size = 4 x 1",
        ),
    ],
    ids=["accumulation", "precision", "effective-batch"],
)
def test_an_edited_saved_config_that_contradicts_the_preset_is_refused_by_name(tmp_path, style, edit, message):
    path = _edited(tmp_path, style, edit)
    ((section, values),) = edit.items()
    assert {key: _config(path)[section][key] for key in values} == values
    with pytest.raises(ValueError, match=message):
        _cli(tmp_path, style, config=path)
