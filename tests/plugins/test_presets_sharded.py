"""``MemoryPreset.from_plan`` of a plan over several GPUs: DDP, or FSDP2 with ``ModelParallelStrategy`` and the
``configure_model`` recipe, executed here in one process on a fake process group."""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_memopt import MemoryPreset, plan_memory
from lightning_memopt.functional.planning.sharding import fake_process_group
from tests.scripts.fsdp2_peak import WIDTH, ResidualMLP

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


class Wrapped(pl.LightningModule):
    """A LightningModule whose training step calls its submodule (not ``self``): each child is a root."""

    def __init__(self) -> None:
        super().__init__()
        self.model = ResidualMLP()

    def training_step(self, batch, batch_idx):
        return self.model(batch)

    def configure_optimizers(self):
        return ADAMW(self.parameters())


def _batch(b: int) -> torch.Tensor:
    return torch.randn(b, WIDTH)


def _plan(module: nn.Module, strategy: str = "fsdp2", **kwargs):
    return plan_memory(
        module, _batch, effective_batch_size=16, budget="1GB", devices=2, device="cpu", strategy=strategy, **kwargs
    )


def _fsdp_units(module: nn.Module) -> set[str]:
    from torch.distributed.fsdp import FSDPModule

    return {name for name, m in module.named_modules() if isinstance(m, FSDPModule)}


def test_a_sharded_plan_gives_model_parallel_strategy_and_a_recipe_that_shards_as_planned():
    plan = _plan(Wrapped())
    preset = MemoryPreset.from_plan(plan, monitor=False)
    assert preset.strategy == "fsdp2" and preset.reshard_after_forward is True and not preset.cpu_offload
    assert preset.shard_blocks == tuple(f"model.blocks.{i}" for i in range(4)) and preset.shard_roots == ("model",)
    kwargs = preset.trainer_kwargs()
    strategy = kwargs["strategy"]
    assert type(strategy).__name__ == "ModelParallelStrategy"
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (2, 1)
    assert "plugins" not in kwargs and kwargs["precision"] == "32-true"  # the strategy owns precision
    assert kwargs["devices"] == 2 and kwargs["accumulate_grad_batches"] == plan.accumulate_grad_batches
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, **kwargs)
    assert trainer.strategy is strategy
    # the recipe, pasted into the LightningModule, shards the units the estimate sharded
    recipe = preset.configure_model_recipe
    assert "ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)" in recipe
    assert "configure_model (FSDP2):\n" + recipe in str(preset)
    namespace: dict = {}
    exec(recipe, namespace)
    module = Wrapped()
    with fake_process_group(2) as mesh:
        module._device_mesh = mesh  # what ModelParallelStrategy gives the LightningModule
        namespace["configure_model"](module)
        assert plan.estimate is not None and plan.estimate.sharding is not None
        assert _fsdp_units(module) == set(plan.estimate.sharding.units) == {*preset.shard_blocks, "model"}


def test_a_recipe_with_cpu_offload_and_a_plain_module_root():
    preset = MemoryPreset(
        effective_batch_size=8,
        micro_batch_size=4,
        devices=2,
        strategy="fsdp2",
        cpu_offload=True,
        reshard_after_forward=False,
        shard_blocks=["blocks.0", "blocks.1", "blocks.2", "blocks.3"],
        shard_roots=[""],
    )
    recipe = preset.configure_model_recipe
    assert "for i in range(0, 4)" in recipe and '"offload_policy": CPUOffloadPolicy()' in recipe
    namespace: dict = {}
    exec(recipe.replace("CPUOffloadPolicy()", "CPUOffloadPolicy(pin_memory=False)"), namespace)  # no GPU to pin for
    module = ResidualMLP()
    with fake_process_group(2) as mesh:
        module.device_mesh = mesh
        namespace["configure_model"](module)
        assert _fsdp_units(module) == {"", "blocks.0", "blocks.1", "blocks.2", "blocks.3"}
        state = module._get_fsdp_state()
        assert state._fsdp_param_group.post_forward_mesh_info is None  # reshard_after_forward=False


def test_a_ddp_plan_gives_strategy_ddp_and_no_recipe():
    plan = _plan(ResidualMLP(), strategy="auto", optimizer=ADAMW)
    assert plan.strategy == "ddp"
    preset = MemoryPreset.from_plan(plan)
    assert preset.strategy == "ddp" and preset.configure_model_recipe == ""
    assert preset.trainer_kwargs()["strategy"] == "ddp" and "configure_model" not in str(preset)
    single = plan_memory(ResidualMLP(), _batch, effective_batch_size=16, budget="1GB", device="cpu")
    assert MemoryPreset.from_plan(single).strategy is None and "strategy" not in MemoryPreset.from_plan(
        single
    ).trainer_kwargs(callbacks=[])


def test_a_configure_model_that_shards_itself_is_kept():
    class Sharding(Wrapped):
        def configure_model(self):
            from torch.distributed.fsdp import fully_shard

            for block in self.model.blocks:
                fully_shard(block, mesh=self.device_mesh["data_parallel"])
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    plan = _plan(Sharding())
    assert plan.sharded and plan.shard_blocks is None and plan.shard_roots is None
    recipe = MemoryPreset.from_plan(plan).configure_model_recipe
    assert "keep your own configure_model" in recipe


def test_merge_trainer_config_takes_the_preset_strategy_over_the_default():
    preset = MemoryPreset(effective_batch_size=8, micro_batch_size=4, devices=2, strategy="ddp")
    assert preset.merge_trainer_config({"strategy": "auto", "devices": "auto"})["strategy"] == "ddp"


def test_fsdp2_on_a_lightning_without_model_parallel_strategy_names_the_version(monkeypatch):
    from lightning_memopt.presets import preset as preset_module

    installed = preset_module.classes
    missing = "strategies.ModelParallelStrategy"  # as on Lightning 2.1 and 2.2
    monkeypatch.setattr(preset_module, "classes", lambda path: () if path == missing else installed(path))
    preset = MemoryPreset(effective_batch_size=8, micro_batch_size=4, devices=2, strategy="fsdp2")
    with pytest.raises(ValueError, match="ModelParallelStrategy, which came with Lightning 2.3"):
        preset.merge_trainer_config({"strategy": "auto"})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"strategy": "fsdp"}, "`strategy` must be one of None, 'ddp', 'fsdp2', got 'fsdp'"),
        ({"strategy": "fsdp2"}, "`strategy`='fsdp2' shards over `devices` x `num_nodes` = 1 rank"),
        ({"devices": 2, "cpu_offload": True}, "`cpu_offload` shapes FSDP2's configure_model, but `strategy`=None"),
        ({"devices": 2, "strategy": "fsdp2", "shard_blocks": [1]}, "`shard_blocks` must be a list of qualified"),
        ({"devices": 2, "strategy": "ddp", "shard_roots": [""]}, "`shard_roots` shapes FSDP2's configure_model"),
    ],
)
def test_bad_sharding_fields_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MemoryPreset(**kwargs)


def test_a_strategy_of_yours_that_contradicts_the_preset_is_refused():
    preset = MemoryPreset(effective_batch_size=8, micro_batch_size=4, devices=2, strategy="fsdp2")
    with pytest.raises(ValueError, match="`strategy='ddp'` contradicts the preset's strategy='fsdp2'"):
        preset.trainer_kwargs(strategy="ddp")
    with pytest.raises(ValueError, match="`reshard_after_forward` is decided by the plan"):
        MemoryPreset.from_plan(_plan(Wrapped()), reshard_after_forward=False)


def test_memory_preset_cli_builds_the_trainer_with_model_parallel_strategy(tmp_path):
    from tests.plugins.test_preset_cli import _cli

    memory = [
        "--memory.effective_batch_size=16",
        "--memory.micro_batch_size=4",
        "--memory.strategy=fsdp2",
        "--memory.shard_blocks=[net.0]",
        "--memory.shard_roots=[net]",
    ]
    cli = _cli([*memory, "--trainer.devices=2"], tmp_path)
    strategy = cli.trainer.strategy
    assert type(strategy).__name__ == "ModelParallelStrategy" and strategy._data_parallel_size == 2
    preset = cli.config_init.memory
    assert preset.shard_blocks == ("net.0",) and "for name in ['net.0']:" in preset.configure_model_recipe
