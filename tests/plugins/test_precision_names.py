"""Every precision value Lightning's Trainer accepts works in ``MemoryPrecision`` and ``MemoryPreset``, mapped as
Lightning maps it (checked against Lightning's own conversion, not a table written here)."""

from __future__ import annotations

import logging
import typing
import warnings

import pytest
import torch

from lightning_memopt import MemoryPrecision, MemoryPreset
from lightning_memopt.functional.precision import PRECISION_MODES, normalize_precision
from tests.helpers.lightning import NAMESPACE, lightning_module
from tests.helpers.models import TinyModel
from tests.helpers.presets_cli import memory_cli_class
from tests.helpers.presets_env import give_back_allocator_settings
from tests.helpers.trainer import make_trainer

_connector = lightning_module("trainer.connectors.accelerator_connector")


def _flatten(tp) -> list:
    """The values of a ``Literal`` or of a ``Union`` of ``Literal`` types."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Literal:
        return list(args)
    return [v for a in args for v in _flatten(a)]


#: What the Trainer's ``precision=`` accepts, read from Lightning's type.
LIGHTNING_VALUES = _flatten(_connector._PRECISION_INPUT)


def test_lightning_s_values_are_read_from_lightning():
    assert {16, 32, 64, "16", "bf16", "16-mixed", "bf16-true", "64-true"} <= set(LIGHTNING_VALUES)


@pytest.mark.parametrize("value", LIGHTNING_VALUES, ids=repr)
def test_every_value_the_trainer_takes_maps_as_lightning_maps_it(value):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning discourages 16 / "bf16" with a warning
        expected = _connector._convert_precision_to_unified_args(value)
    assert normalize_precision(value) == expected
    assert MemoryPrecision(value).requested_precision == expected
    assert MemoryPreset(precision=value).precision == expected
    assert expected in PRECISION_MODES


@pytest.mark.parametrize("value", ["fp16", "16-bit", 8, True, "BF16", None, 16.0])
def test_anything_else_is_refused_naming_the_argument_and_the_choices(value):
    choices = r"`precision` must be one of 'auto', '32-true'.*'64-true'.*'bf16'.*, 16, 32, 64, got"
    with pytest.raises(ValueError, match=choices):
        MemoryPrecision(value)
    with pytest.raises(ValueError, match=r"`precision` must be one of .*Trainer\(precision=\.\.\.\)"):
        MemoryPreset(precision=value if value is not None else "none")


@pytest.mark.parametrize(
    ("value", "dtype", "autocast"),
    [
        (16, torch.float32, torch.float16),
        ("bf16", torch.float32, torch.bfloat16),
        (64, torch.float64, None),
        ("32", torch.float32, None),
        ("bf16-true", torch.bfloat16, None),
    ],
    ids=repr,
)
def test_a_fit_runs_in_the_precision_lightning_would_use(value, dtype, autocast, tmp_path):
    seen = []

    class Probe(TinyModel):
        def training_step(self, batch, batch_idx):
            out = self(batch.to(self.layer.weight.dtype))
            seen.append((self.layer.weight.dtype, out.dtype))
            return out.float().pow(2).mean()

    plugin = MemoryPrecision(value)
    trainer = make_trainer(tmp_path, plugins=[plugin], max_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Probe())
    assert trainer.global_step == 2
    weight, output = seen[0]
    assert weight == dtype
    assert output == (autocast or dtype)


def test_transformer_engine_without_the_package_gets_lightning_s_error(tmp_path):
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("transformer_engine is installed")
    plugin = MemoryPrecision("transformer-engine")
    assert plugin.requested_precision == "transformer-engine"
    with pytest.raises(ModuleNotFoundError, match="transformer.engine"):
        plugin.resolve(torch.device("cpu"), namespace=NAMESPACE)


def test_the_cpu_hint_names_where_the_precision_is_set(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    for plugin, where in (
        (MemoryPrecision("auto"), "`MemoryPrecision(precision='bf16-mixed')`"),
        (
            MemoryPreset("balanced").precision_plugin(),
            "`MemoryPreset(precision='bf16-mixed')` (`memory.precision: bf16-mixed` in a LightningCLI config)",
        ),
    ):
        plugin.verbose = True
        caplog.clear()
        make_trainer(tmp_path, plugins=[plugin], max_steps=1).fit(TinyModel())
        text = " ".join(" ".join(r.getMessage().split()) for r in caplog.records if "chose '32-true'" in r.getMessage())
        assert where in text and "not `Trainer(precision=...)`" in text, text


@pytest.mark.parametrize("value", ["16", "bf16", "64"])
def test_lightning_cli_takes_lightning_s_names_for_memory_precision(value, tmp_path):
    yaml = f"""
memory:
  name: balanced
  effective_batch_size: 8
  micro_batch_size: 4
  precision: {value}
  monitor: false
trainer:
  accelerator: cpu
  max_steps: 1
  limit_val_batches: 0
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  default_root_dir: {tmp_path}
"""
    config = tmp_path / "config.yaml"
    config.write_text(yaml)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = memory_cli_class()(TinyModel, run=False, args=[f"--config={config}"], save_config_callback=None)
    give_back_allocator_settings(cli.trainer.callbacks)  # never fit, never torn down
    assert cli.trainer.precision_plugin.requested_precision == normalize_precision(value)


@pytest.mark.parametrize(("value", "dtype"), [(64, torch.float64), ("bf16-true", torch.bfloat16), (32, torch.float32)])
def test_true_dtype_modes_act_before_setup_as_lightning_s_do(value, dtype):
    """``trainer.init_module()`` runs before setup: the true-dtype plugins must already be in place."""
    with MemoryPrecision(value).tensor_init_context():
        assert torch.zeros(1).dtype == dtype
