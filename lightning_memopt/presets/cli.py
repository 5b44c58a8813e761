"""MemoryPresetCLI: a ``memory:`` section for LightningCLI whose MemoryPreset decides the Trainer's memory arguments."""

from __future__ import annotations

import dataclasses
import inspect
import re
import warnings
from typing import Any

from lightning_memopt.presets.preset import PRESET_TRAINER_KEYS, MemoryPreset, device_count

__all__ = ["MemoryPresetCLI", "preset_batch_size", "yaml_keys"]

_FIELDS = frozenset(f.name for f in dataclasses.fields(MemoryPreset) if f.init)
#: Trainer arguments the preset's messages name (``trainer_kwargs`` decides them or compares with them).
_TRAINER_KEYS = frozenset({*PRESET_TRAINER_KEYS, "strategy"})


def yaml_keys(message: str, section: str, names: frozenset[str]) -> str:
    """``message`` with each backticked argument (`` `name` `` or `` `name=...` ``) named by its config key."""

    def keyed(m: re.Match[str]) -> str:
        """One backticked argument: named by its config key when it is one of ``names``, else as it is."""
        if m.group(1) in names:
            return f"`{section}.{m.group(1)}"
        return m.group(0)

    return re.sub(r"`(\w+)(?=`|=)", keyed, message)


def _devices(accelerator: Any, devices: Any) -> int:
    count = device_count(accelerator, devices)
    return count if count is not None else 1  # Lightning refuses such a value itself, with its own message


def preset_batch_size(preset: MemoryPreset) -> int:
    """The DataLoader batch a preset gives its ``memory_batch_size_target`` (:attr:`MemoryPreset.batch_size`)."""
    return preset.batch_size


def _takes(cls: Any, name: str) -> bool:
    """Whether ``cls(...)`` has an argument called ``name``."""
    try:
        return name in inspect.signature(cls).parameters
    except (TypeError, ValueError):  # a builtin or a class without a readable signature
        return False


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
            memory_batch_size_target = "auto"  # or "data.batch_size", "model.batch_size", None


        CLI(MyModel, MyDataModule)  # or CLI() with `model: class_path: ...`, `data: class_path: ...` configs

    and write ``memory: {name: max-savings, effective_batch_size: 256, micro_batch_size: 16}`` in the config (or
    ``--memory.name max-savings`` ...). Without a ``memory:`` section it runs the ``balanced`` preset with the
    DataLoader batch ``DEFAULT_BATCH_SIZE`` (32). ``memory.devices`` and ``memory.num_nodes`` follow ``trainer.devices``
    and ``trainer.num_nodes``; the preset's batch goes to :attr:`memory_batch_size_target` in either config style
    (``data: {batch_size: ...}`` for a fixed class, ``data: {class_path: ..., init_args: {batch_size: ...}}``); its
    errors name config keys (`` `memory.effective_batch_size` ``). ``docs/presets.md`` says more.
    """

    #: The config section of the preset.
    memory_key: str = "memory"
    #: Where the preset's DataLoader batch goes. ``"auto"``: the ``batch_size`` init argument of the datamodule and
    #: of the model, whichever has one (both when both do). ``"data.batch_size"`` or ``"model.batch_size"`` (also
    #: written ``"data.init_args.batch_size"``): that argument, in either config style (a fixed class, or
    #: ``class_path`` + ``init_args``); a class chosen by ``class_path`` without it is refused. ``None``: nowhere.
    memory_batch_size_target: str | None = "auto"

    def add_arguments_to_parser(self, parser: Any) -> None:
        super().add_arguments_to_parser(parser)  # type: ignore[misc]
        key = self.memory_key
        parser.add_class_arguments(MemoryPreset, key)
        parser.link_arguments(("trainer.accelerator", "trainer.devices"), f"{key}.devices", compute_fn=_devices)
        parser.link_arguments("trainer.num_nodes", f"{key}.num_nodes")
        self._memory_targets = self._memory_batch_targets(parser)
        for target in self._memory_targets:
            parser.link_arguments(key, target, compute_fn=preset_batch_size, apply_on="instantiate")

    def _subclass_mode(self, section: str) -> bool:
        """Whether the config gives ``section`` as ``class_path`` + ``init_args`` (LightningCLI's subclass mode)."""
        return bool(getattr(self, {"model": "subclass_mode_model", "data": "subclass_mode_data"}[section], False))

    def _memory_batch_targets(self, parser: Any) -> list[str]:
        """The link targets of the preset's batch, spelled as jsonargparse wants them for each section's style."""
        target = self.memory_batch_size_target
        if not target:
            return []
        if target == "auto":
            targets = []
            for section, cls in (("data", "datamodule_class"), ("model", "model_class")):
                if section not in parser.groups:
                    continue
                if self._subclass_mode(section):
                    targets.append(f"{section}.init_args.batch_size")  # a class_path without it is skipped
                elif _takes(getattr(self, cls, None), "batch_size"):
                    targets.append(f"{section}.batch_size")
            return targets
        section, _, rest = target.partition(".")
        if section not in parser.groups:
            return []
        if section in ("model", "data"):
            rest = rest.removeprefix("init_args.")
            if self._subclass_mode(section):
                rest = f"init_args.{rest}"
        return [f"{section}.{rest}"]

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()  # type: ignore[misc]
        except ValueError as err:
            if not _raised_by_preset(err):
                raise
            raise ValueError(yaml_keys(str(err), self.memory_key, _FIELDS)) from err
        self._check_batch_target()
        self._drop_unlinked_hparams()

    def _drop_unlinked_hparams(self) -> None:
        """Take the preset's batch out of the hyperparameters of a class that did not receive it.

        A ``class_path`` without the target argument (``"auto"`` links ``model.init_args.batch_size`` and
        ``data.init_args.batch_size`` before the classes are known) gets nothing from the link, but LightningCLI
        still writes the linked value into its ``save_hyperparameters()``. Left there, the checkpoint's
        ``hyper_parameters`` name an argument the class does not take, and ``fit --ckpt_path`` (which parses them
        back into the config) or ``load_from_checkpoint`` refuses the checkpoint.
        """
        config = self.config[self.subcommand] if self.subcommand else self.config  # type: ignore[attr-defined]
        chosen = {"data": getattr(self, "datamodule", None), "model": getattr(self, "model", None)}
        for target in getattr(self, "_memory_targets", ()):
            section, _, rest = target.partition(".")
            obj = chosen.get(section)
            if obj is None or not rest.startswith("init_args.") or target in config:
                continue  # a fixed class, or the class took the argument: the hyperparameter is true
            name = rest.removeprefix("init_args.")
            given = config.get(f"{section}.dict_kwargs") or {}  # what the class got through **kwargs, if anything
            # `hparams` is what a checkpoint stores; `_hparams_initial` (behind the copying `hparams_initial`) is
            # what loggers record
            for hparams in (getattr(obj, "hparams", None), getattr(obj, "_hparams_initial", None)):
                if hparams is None or name not in hparams:
                    continue
                if name in given:
                    hparams[name] = given[name]
                else:
                    del hparams[name]

    def _check_batch_target(self) -> None:
        """Refuse an explicit target the chosen class cannot take; warn when ``"auto"`` found no ``batch_size``."""
        target = self.memory_batch_size_target
        if not target:
            return
        chosen = {"data": getattr(self, "datamodule", None), "model": getattr(self, "model", None)}
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init  # type: ignore[attr-defined]
        batch = config[self.memory_key].batch_size
        if target == "auto":
            if not any(obj is not None and _takes(type(obj), "batch_size") for obj in chosen.values()):
                names = " or ".join(type(obj).__name__ for obj in chosen.values() if obj is not None)
                warnings.warn(
                    f"MemoryPresetCLI: no `batch_size` init argument in {names or 'the model'}, so the"
                    f" preset's DataLoader batch ({batch}) goes nowhere and `memory.effective_batch_size` is not"
                    " what each optimizer step sees. Give the datamodule (or the model) a `batch_size` argument,"
                    " or set `memory_batch_size_target` to the argument that holds the batch.",
                    stacklevel=2,
                )
            return
        section, _, rest = target.partition(".")
        rest = rest.removeprefix("init_args.")
        obj = chosen.get(section)
        if obj is None or "." in rest or not self._subclass_mode(section) or _takes(type(obj), rest):
            return  # a fixed class without the argument fails while the parser is built (jsonargparse's message)
        raise ValueError(
            f"`memory_batch_size_target`={target!r}: {type(obj).__module__}.{type(obj).__qualname__} (the"
            f" `{section}.class_path` of the config) has no `{rest}` init argument, so the preset's DataLoader batch"
            f" ({batch}) cannot reach it. Give the class a `{rest}` argument, or set `memory_batch_size_target` to the"
            ' argument that holds the batch ("auto" finds a `batch_size` of the datamodule or the model).'
        )

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init  # type: ignore[attr-defined]
        preset = config[self.memory_key]
        trainer_config = {**config["trainer"], **kwargs}
        try:
            merged = preset.merge_trainer_config(trainer_config)
        except ValueError as err:
            message = yaml_keys(str(err), "trainer", _TRAINER_KEYS)
            raise ValueError(yaml_keys(message, self.memory_key, _FIELDS - _TRAINER_KEYS)) from err
        return super().instantiate_trainer(**merged)  # type: ignore[misc]
