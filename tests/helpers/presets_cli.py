"""The LightningCLI subclass documented in ``docs/presets.md`` (a ``memory:`` section merged by hand, no mixin)."""

from __future__ import annotations

from typing import Any

from lightning_memopt import MemoryPreset
from tests.helpers.lightning import lightning_module


def memory_cli_class() -> Any:
    """The LightningCLI subclass documented in ``docs/presets.md``, linking the preset's batch to the model."""
    LightningCLI = lightning_module("cli").LightningCLI

    class MemoryCLI(LightningCLI):
        def add_arguments_to_parser(self, parser):
            parser.add_class_arguments(MemoryPreset, "memory")
            parser.link_arguments("memory", "model.batch_size", lambda p: p.batch_size, apply_on="instantiate")

        def instantiate_trainer(self, **kwargs):
            config = self.config_init[self.subcommand] if self.subcommand else self.config_init
            trainer_config = {**config["trainer"], **kwargs}
            return super().instantiate_trainer(**config["memory"].merge_trainer_config(trainer_config))

    return MemoryCLI
