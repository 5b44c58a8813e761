"""MemoryPresetCLI: a ``memory:`` section for LightningCLI whose MemoryPreset decides the Trainer's memory arguments."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from lightning_memopt.presets.preset import MemoryPreset
from lightning_memopt.presets.trainer_config import device_count

__all__ = ["MemoryPresetCLI"]

_FIELDS = frozenset(f.name for f in dataclasses.fields(MemoryPreset) if f.init)
#: Trainer arguments the preset's messages name (``trainer_kwargs`` decides them or compares with them).
_TRAINER_KEYS = frozenset(
    {
        "precision",
        "plugins",
        "accumulate_grad_batches",
        "gradient_clip_val",
        "devices",
        "num_nodes",
        "callbacks",
        "strategy",
    }
)


def _yaml_keys(message: str, section: str, names: frozenset[str]) -> str:
    """``message`` with each backticked argument (`` `name` `` or `` `name=...` ``) named by its config key."""
    return re.sub(
        r"`(\w+)(?=`|=)", lambda m: f"`{section}.{m.group(1)}" if m.group(1) in names else m.group(0), message
    )


def _devices(accelerator: Any, devices: Any) -> int:
    count = device_count(accelerator, devices)
    return count if count is not None else 1  # Lightning refuses such a value itself, with its own message


def _raised_by_preset(err: BaseException) -> bool:
    tb = err.__traceback__
    while tb is not None:
        if isinstance(tb.tb_frame.f_locals.get("self"), MemoryPreset):
            return True
        tb = tb.tb_next
    return False


class MemoryPresetCLI:
    """A mixin for ``LightningCLI`` (either namespace): a ``memory:`` config section holding a
    :class:`~lightning_memopt.MemoryPreset` that decides precision, accumulation, checkpointing and the memory
    callbacks of the Trainer.

    Put it in front of Lightning's class::

        from lightning.pytorch.cli import LightningCLI  # or: from pytorch_lightning.cli import LightningCLI
        from lightning_memopt import MemoryPresetCLI


        class CLI(MemoryPresetCLI, LightningCLI):
            memory_batch_size_target = "data.batch_size"  # the DataLoader batch; "model.batch_size"; None


        CLI(MyModel, MyDataModule)

    and write ``memory: {name: max-savings, effective_batch_size: 256, micro_batch_size: 16}`` in the config (or
    ``--memory.name max-savings`` ...). Without a ``memory:`` section it runs the ``balanced`` preset with the
    DataLoader batch ``DEFAULT_BATCH_SIZE`` (32). ``memory.devices`` and ``memory.num_nodes`` follow ``trainer.devices``
    and ``trainer.num_nodes``; the preset's batch goes to :attr:`memory_batch_size_target`; its errors name config
    keys (`` `memory.effective_batch_size` ``). ``docs/presets.md`` says more.
    """

    #: The config section of the preset.
    memory_key: str = "memory"
    #: Where the preset's DataLoader batch goes (``"data.batch_size"``, ``"model.batch_size"``, or ``None``).
    memory_batch_size_target: str | None = "data.batch_size"

    def add_arguments_to_parser(self, parser: Any) -> None:
        super().add_arguments_to_parser(parser)  # type: ignore[misc]
        key = self.memory_key
        parser.add_class_arguments(MemoryPreset, key)
        parser.link_arguments(("trainer.accelerator", "trainer.devices"), f"{key}.devices", compute_fn=_devices)
        parser.link_arguments("trainer.num_nodes", f"{key}.num_nodes")
        target = self.memory_batch_size_target
        if target and target.partition(".")[0] in parser.groups:
            parser.link_arguments(key, target, compute_fn=lambda preset: preset.batch_size, apply_on="instantiate")

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()  # type: ignore[misc]
        except ValueError as err:
            if not _raised_by_preset(err):
                raise
            raise ValueError(_yaml_keys(str(err), self.memory_key, _FIELDS)) from err

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init  # type: ignore[attr-defined]
        preset = config[self.memory_key]
        trainer_config = {**config["trainer"], **kwargs}
        try:
            merged = preset.merge_trainer_config(trainer_config)
        except ValueError as err:
            message = _yaml_keys(str(err), "trainer", _TRAINER_KEYS)
            raise ValueError(_yaml_keys(message, self.memory_key, _FIELDS - _TRAINER_KEYS)) from err
        return super().instantiate_trainer(**merged)  # type: ignore[misc]
