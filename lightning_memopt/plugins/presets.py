"""MemoryPreset: named memory presets and GPU-size tiers that keep the effective batch -> ``Trainer(**kwargs)``."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from lightning_memopt.functional.allocator import parse_alloc_conf
from lightning_memopt.functional.presets import (
    PRESET_NAMES,
    PRESETS,
    AccumulationPlan,
    PrecisionInput,
    choose_precision,
    normalize_precision,
    plan_accumulation,
    plan_auto_micro_batch,
    tier_for_memory,
)
from lightning_memopt.utilities.checks import (
    check_bool,
    check_choice,
    check_fraction,
    check_non_negative_int,
    check_non_negative_number,
    check_positive_int,
    check_str,
)
from lightning_memopt.utilities.namespaces import rank_zero_info

__all__ = ["DEFAULT_BATCH_SIZE", "MemoryPreset", "PresetName", "device_count"]

#: The DataLoader batch per device when a preset has neither ``effective_batch_size`` nor ``micro_batch_size``.
DEFAULT_BATCH_SIZE = 32

#: The preset names (a ``Literal``, so LightningCLI lists them in ``--help`` and refuses a typo while parsing).
PresetName = Literal["max-savings", "balanced", "max-speed"]

_KNOBS = (
    "precision",
    "float32_matmul_precision",
    "gradient_checkpointing",
    "allocator_conf",
    "cache_clean_on_phase_end",
    "gc_every_n_steps",
    "monitor",
)
#: Trainer arguments that ``trainer_kwargs`` decides.
_PRESET_TRAINER_KEYS = (
    "precision",
    "plugins",
    "accumulate_grad_batches",
    "gradient_clip_val",
    "devices",
    "num_nodes",
    "callbacks",
)


def _trainer_defaults() -> dict[str, Any]:
    """Defaults of the Trainer's arguments (the first installed namespace's), read from its signature."""
    from lightning_memopt.utilities.namespaces import classes

    Trainer = classes("Trainer")[0]

    params = inspect.signature(Trainer.__init__).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def _checkpoint_modules(value: Any) -> tuple[Any, ...] | None:
    """``checkpoint_modules`` as a tuple: one entry or a list/tuple of class names, name patterns or module classes."""
    if value is None:
        return None
    entries = (value,) if isinstance(value, (str, type)) else value
    if not isinstance(entries, (list, tuple)) or not entries:
        raise ValueError(
            f"`checkpoint_modules` must be a non-empty list of class names or name patterns, or None, got {value!r}"
            f" ({type(value).__name__}). Example: ['TransformerEncoderLayer', 'encoder.layers.*']; None checkpoints"
            " the default blocks."
        )
    for entry in entries:
        if not (isinstance(entry, str) and entry) and not (isinstance(entry, type) and issubclass(entry, nn.Module)):
            raise ValueError(
                f"`checkpoint_modules` entries must be non-empty class names, name patterns or nn.Module classes, got"
                f" {entry!r} in {value!r}. Example: ['TransformerEncoderLayer', 'encoder.layers.*']."
            )
    return tuple(entries)


def device_count(accelerator: Any, devices: Any) -> int | None:
    """How many devices per node ``Trainer(accelerator=..., devices=...)`` trains on; ``None`` if it cannot tell.

    Counts as Lightning does: a list (or ``"0,1"``) by its length, a positive int (or its string) as is, ``"auto"``
    and ``-1`` as every CUDA GPU for a CUDA accelerator, one device for the CPU and others.

    Example:
        >>> device_count("cpu", "auto"), device_count("gpu", [0, 3]), device_count("auto", "2"), device_count("cpu", 0)
        (1, 2, 2, None)
    """
    if isinstance(devices, (list, tuple)):
        return len(devices) or None
    if isinstance(devices, str):
        text = devices.strip()
        if "," in text:
            return len([d for d in text.split(",") if d.strip()]) or None
        if text.lstrip("-").isdigit():
            devices = int(text)
    if isinstance(devices, bool):
        return None
    if isinstance(devices, int) and devices > 0:
        return devices
    if devices in ("auto", -1):
        name = (accelerator if isinstance(accelerator, str) else type(accelerator).__name__).lower()
        if any(word in name for word in ("auto", "gpu", "cuda")) and torch.cuda.is_available():
            return torch.cuda.device_count()
        return 1
    return None


def _same(value: Any, default: Any) -> bool:
    """``value == default`` for plain values only (plugin or callback objects are never "at the default")."""
    if default is None:
        return value is None
    return type(value) is type(default) and value == default


@dataclass(frozen=True)
class MemoryPreset:
    """A named bundle of memory knobs that keeps the effective batch and turns into ``Trainer`` arguments.

    Presets (``MemoryPreset.from_name``):

    =============== ========= ============= ===== ============ ========================= ==================
    name            precision checkpointing TF32  accumulation allocator                 callbacks
    =============== ========= ============= ===== ============ ========================= ==================
    ``max-savings`` auto      yes           high  >= 4 steps   expandable_segments:True  monitor, cache, gc
    ``balanced``    auto      no            high  >= 2 steps   expandable_segments:True  monitor, cache
    ``max-speed``   auto      no            high  1 step       --                        --
    =============== ========= ============= ===== ============ ========================= ==================

    ``precision="auto"`` is resolved by :class:`~lightning_memopt.MemoryPrecision` on the training device (bf16 on
    GPUs with native bf16, fp16 + GradScaler on older GPUs, fp32 on CPU). ``MemoryPreset.for_device()`` picks the
    preset from the GPU size: up to 12 GiB ``max-savings`` ("8 GB" tier), up to 20 GiB ``balanced`` ("16 GB"),
    above ``max-speed`` ("24 GB+").

    **Batch arithmetic.** ``accumulate_grad_batches = effective_batch_size / (micro_batch_size x devices x
    num_nodes)``. The effective batch is never rounded: a split that does not divide raises a ``ValueError``
    naming the nearest valid sizes. Without ``micro_batch_size`` the preset picks the largest micro-batch whose
    accumulation reaches the preset's target (``max-savings``: 96 -> 4 x 24). Pass :attr:`batch_size` to your
    DataLoader.

    **Surviving out-of-memory.** With ``auto_micro_batch=True`` the DataLoader yields the whole per-device batch
    (:attr:`batch_size` ``= effective_batch_size / (devices x num_nodes)``), ``accumulate_grad_batches`` is 1, and an
    :class:`~lightning_memopt.AutoMicroBatch` callback splits each batch into micro-batches inside the training step,
    halving them on out-of-memory with the same effective batch and optimizer step count. ``micro_batch_size``, if
    given, is where it starts (it must divide the per-device batch, as without ``auto_micro_batch``); without it,
    it starts with the whole batch: the preset's accumulation target is a rule of thumb, not a measurement, and a
    size that does not fit costs one failed attempt per halving, once per run (the size is checkpointed). Your own
    ``AutoMicroBatch`` among the Trainer's callbacks is kept instead of the preset's.

    **Short last window.** Lightning divides every micro-batch loss by ``accumulate_grad_batches``, also in the
    last window of an epoch when fewer micro-batches remain (upstream #19987). The preset's ``MemoryPrecision``
    rescales that window (``exact_accumulation=True``), so its optimizer step uses the mean of the micro-batch
    losses it saw. Strategies that get a precision string instead of the plugin (FSDP, DeepSpeed) keep Lightning's
    behaviour: there, keep ``len(train_dataloader)`` a multiple of ``accumulate_grad_batches`` or use
    ``drop_last=True``.

    **LightningCLI.** ``class CLI(MemoryPresetCLI, LightningCLI)`` adds a ``memory:`` section holding the preset
    (see :class:`~lightning_memopt.MemoryPresetCLI`): the preset's batch goes to ``data.batch_size``,
    ``trainer.devices`` flows into it, and its errors name config keys. Without the mixin, add the section yourself
    and merge it into the trainer arguments; :meth:`merge_trainer_config` takes the whole ``trainer`` section, where
    most entries sit at their defaults::

        class MemoryCLI(LightningCLI):
            def add_arguments_to_parser(self, parser):
                parser.add_class_arguments(MemoryPreset, "memory")
                parser.link_arguments("memory", "data.batch_size", lambda p: p.batch_size, apply_on="instantiate")

            def instantiate_trainer(self, **kwargs):
                config = self.config_init[self.subcommand] if self.subcommand else self.config_init
                trainer_config = {**config["trainer"], **kwargs}
                return super().instantiate_trainer(**config["memory"].merge_trainer_config(trainer_config))

    with a config such as ``{memory: {name: max-savings, effective_batch_size: 128, micro_batch_size: 16},
    trainer: {max_steps: 1000}}``. ``MemoryPrecision`` and ``GradientCheckpointing`` can also be used alone
    through ``class_path`` entries under ``trainer.plugins`` and ``trainer.callbacks``.

    **Your own callbacks.** A callback you pass (``trainer_kwargs(callbacks=[...])``, ``trainer.callbacks`` in a
    config) of a type the preset adds (``MemoryMonitor``, ``CacheCleaner``, ``GarbageCollector``,
    ``GradientCheckpointing``, ``AutoMicroBatch``, ``AllocatorSettings``) replaces the preset's, with your settings;
    the preset says so once. Without ``effective_batch_size`` and ``micro_batch_size``, :attr:`batch_size` is
    ``DEFAULT_BATCH_SIZE`` (32).

    Knob fields left ``None`` take the preset's value; turn a knob off with ``False``, ``0`` or ``""``.

    Args:
        name: ``"max-savings"``, ``"balanced"`` or ``"max-speed"``.
        effective_batch_size: samples per optimizer step over all ranks; ``None`` = no accumulation arithmetic.
        micro_batch_size: samples per forward pass and rank; ``None`` = chosen by the preset.
        devices: devices per node (as given to the Trainer).
        num_nodes: number of nodes.
        precision: ``"auto"`` or any precision ``Trainer(precision=...)`` accepts (``"bf16-mixed"``, ``16``,
            ``"bf16"``, ``"16-true"``, ...), mapped as Lightning maps it (``16`` is ``"16-mixed"``).
        float32_matmul_precision: ``"highest"``, ``"high"`` (TF32) or ``"medium"``; ``""`` leaves it alone.
        gradient_checkpointing: add :class:`~lightning_memopt.GradientCheckpointing`.
        checkpoint_modules: class names or name patterns for ``GradientCheckpointing(modules=...)``.
        gradient_clip_val: passed to the Trainer (``None`` = no clipping).
        allocator_conf: CUDA caching-allocator settings, e.g. ``"expandable_segments:True"``.
        memory_fraction: fraction of device memory this process may use, in (0, 1].
        cache_clean_on_phase_end: add ``CacheCleaner`` emptying the CUDA cache at phase ends.
        gc_every_n_steps: add ``GarbageCollector(every_n_steps=...)``; ``0`` = no collector.
        monitor: add ``MemoryMonitor``.
        allow_emulated_bf16: allow bf16 on GPUs that only emulate it.
        tier: set by :meth:`for_device` (the GPU-size tier label); informational.
        auto_micro_batch: the DataLoader yields the whole per-device batch and ``AutoMicroBatch`` splits it,
            halving on out-of-memory; ``micro_batch_size`` is then where it starts (``None``: the whole batch).

    Example:
        >>> preset = MemoryPreset.from_name("max-savings", effective_batch_size=128, micro_batch_size=16)
        >>> preset.accumulate_grad_batches, preset.batch_size
        (8, 16)
        >>> kwargs = preset.trainer_kwargs()
        >>> sorted(kwargs)
        ['accumulate_grad_batches', 'callbacks', 'devices', 'gradient_clip_val', 'num_nodes', 'plugins']
        >>> [type(c).__name__ for c in kwargs["callbacks"]]
        ['MemoryMonitor', 'CacheCleaner', 'GarbageCollector', 'GradientCheckpointing', 'AllocatorSettings']
        >>> kwargs["callbacks"][-1].restore()  # normally done at teardown
        >>> auto = MemoryPreset(effective_batch_size=128, devices=2, auto_micro_batch=True)
        >>> auto.batch_size, auto.accumulate_grad_batches, auto.auto_micro_batch_start  # AutoMicroBatch splits the 64
        (64, 1, 'auto')
    """

    name: PresetName = "balanced"
    effective_batch_size: int | None = None
    micro_batch_size: int | None = None
    devices: int = 1
    num_nodes: int = 1
    precision: PrecisionInput | None = None
    float32_matmul_precision: str | None = None
    gradient_checkpointing: bool | None = None
    checkpoint_modules: tuple[str, ...] | None = None
    gradient_clip_val: float | None = None
    allocator_conf: str | None = None
    memory_fraction: float | None = None
    cache_clean_on_phase_end: bool | None = None
    gc_every_n_steps: int | None = None
    monitor: bool | None = None
    allow_emulated_bf16: bool = False
    tier: str | None = None
    auto_micro_batch: bool = False
    plan: AccumulationPlan | None = field(default=None, init=False, repr=False, compare=False)
    _said: set[str] = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            hint = " In YAML write `name: balanced`, not a list." if isinstance(self.name, (list, tuple)) else ""
            raise ValueError(
                f"`name` must be a preset name (str), one of {', '.join(map(repr, PRESET_NAMES))}, got {self.name!r}"
                f" ({type(self.name).__name__}).{hint}"
            )
        if self.name not in PRESETS:
            raise ValueError(
                f"Unknown preset `name`={self.name!r}. Valid presets: {', '.join(PRESET_NAMES)}."
                " For a GPU-size tier use `MemoryPreset.for_device()`."
            )
        table = PRESETS[self.name]
        for knob in _KNOBS:
            if getattr(self, knob) is None:
                object.__setattr__(self, knob, table[knob])
        object.__setattr__(self, "precision", normalize_precision(self.precision))
        check_choice("float32_matmul_precision", self.float32_matmul_precision, ("", "highest", "high", "medium"))
        leave = "Leave it None for the preset's value."
        for knob in ("gradient_checkpointing", "cache_clean_on_phase_end", "monitor"):
            check_bool(knob, getattr(self, knob), hint=leave)
        check_bool("allow_emulated_bf16", self.allow_emulated_bf16)
        check_bool(
            "auto_micro_batch",
            self.auto_micro_batch,
            hint="Use True to let AutoMicroBatch split the per-device batch (halving on out-of-memory), or"
            " False for Lightning's gradient accumulation.",
        )
        check_non_negative_int("gc_every_n_steps", self.gc_every_n_steps, hint="Use 0 for no garbage collector.")
        check_fraction("memory_fraction", self.memory_fraction, allow_none=True)
        check_str("allocator_conf", self.allocator_conf, hint="Example: 'expandable_segments:True'.")
        parse_alloc_conf(self.allocator_conf)
        check_non_negative_number(
            "gradient_clip_val", self.gradient_clip_val, allow_none=True, hint="Use None for no clipping."
        )
        check_str("tier", self.tier, allow_none=True, hint="It is set by `MemoryPreset.for_device()`, e.g. '16GB'.")
        object.__setattr__(self, "checkpoint_modules", _checkpoint_modules(self.checkpoint_modules))
        check_positive_int("devices", self.devices, hint="Pass the number of devices per node, as for the Trainer.")
        check_positive_int("num_nodes", self.num_nodes)
        check_positive_int("micro_batch_size", self.micro_batch_size, allow_none=True)
        if self.auto_micro_batch and self.micro_batch_size is not None and self.effective_batch_size is None:
            raise ValueError(
                f"`micro_batch_size`={self.micro_batch_size!r} with `auto_micro_batch=True` needs"
                " `effective_batch_size`: the DataLoader then yields the whole per-device batch and AutoMicroBatch"
                " starts splitting it at `micro_batch_size`. Pass `effective_batch_size=` (samples per optimizer step"
                " over all devices), or drop `micro_batch_size` to split whatever batch your DataLoader yields."
            )
        plan = None
        if self.effective_batch_size is not None and self.auto_micro_batch:
            plan = plan_auto_micro_batch(self.effective_batch_size, self.micro_batch_size, self.devices, self.num_nodes)
        elif self.effective_batch_size is not None:
            plan = plan_accumulation(
                self.effective_batch_size,
                self.micro_batch_size,
                self.devices,
                self.num_nodes,
                table["target_accumulation"],
            )
        object.__setattr__(self, "plan", plan)

    # ---------------------------------------------------------------------------------------------- builders
    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> MemoryPreset:
        """The preset ``name`` with ``overrides`` for any field.

        Example:
            >>> MemoryPreset.from_name("max-sped")
            Traceback (most recent call last):
            ...
            ValueError: Unknown preset `name`='max-sped'. Valid presets: max-savings, balanced, max-speed. ...
        """
        fields = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise TypeError(f"Unknown `MemoryPreset` field(s) {unknown}. Valid fields: {sorted(fields - {'name'})}.")
        return cls(name=name, **overrides)

    @classmethod
    def for_device(
        cls,
        total_memory_gib: float | None = None,
        *,
        module: nn.Module | None = None,
        batch_fn: Any = None,
        **overrides: Any,
    ) -> MemoryPreset:
        """The preset for a GPU with ``total_memory_gib`` GiB (``None`` reads the current CUDA device).

        Without a CUDA device and without ``total_memory_gib`` it warns and uses ``balanced``.

        Given ``module`` and ``batch_fn`` (``batch_fn(micro_batch_size) -> batch``) and ``effective_batch_size``,
        the choice is measured instead of looked up by size: :func:`~lightning_memopt.plan_memory` estimates the
        training step on fake tensors and picks the micro-batch, precision and checkpointing that fit (10 % margin).
        If nothing fits, ``ValueError`` says what would (8-bit optimizer states, or FSDP over N GPUs).

        Example:
            >>> p = MemoryPreset.for_device(8, effective_batch_size=32)
            >>> p.name, p.tier, p.batch_size, p.accumulate_grad_batches
            ('max-savings', '8GB', 8, 4)
        """
        if module is not None or batch_fn is not None:
            return cls._planned(total_memory_gib, module, batch_fn, overrides)
        if total_memory_gib is None:
            if torch.cuda.is_available():
                index = torch.cuda.current_device()
                total_memory_gib = torch.cuda.get_device_properties(index).total_memory / 1024**3
            else:
                warnings.warn(
                    "MemoryPreset.for_device() found no CUDA device to read; using the 'balanced' preset."
                    " Pass `total_memory_gib=` to choose a tier explicitly.",
                    stacklevel=2,
                )
                return cls.from_name("balanced", **overrides)
        tier, name = tier_for_memory(total_memory_gib)
        overrides.setdefault("tier", tier)
        return cls.from_name(name, **overrides)

    @classmethod
    def _planned(
        cls, total_memory_gib: float | None, module: Any, batch_fn: Any, overrides: dict[str, Any]
    ) -> MemoryPreset:
        from lightning_memopt.planner import plan_memory

        if module is None or batch_fn is None or overrides.get("effective_batch_size") is None:
            raise ValueError(
                "`MemoryPreset.for_device(module=..., batch_fn=...)` plans from the model and needs all of `module`,"
                " `batch_fn` (`batch_fn(micro_batch_size) -> batch`) and `effective_batch_size`; got"
                f" module={type(module).__name__ if module is not None else None}, batch_fn={batch_fn!r},"
                f" effective_batch_size={overrides.get('effective_batch_size')!r}."
            )
        if overrides.get("micro_batch_size") is not None:
            raise ValueError(
                f"`micro_batch_size`={overrides['micro_batch_size']!r} cannot be given with `module`/`batch_fn`: the"
                " plan chooses it. Drop one of them."
            )
        planned = {"effective_batch_size", "devices", "num_nodes", "precision", "gradient_checkpointing"}
        plan = plan_memory(
            module,
            batch_fn,
            effective_batch_size=overrides["effective_batch_size"],
            budget_bytes=None if total_memory_gib is None else int(total_memory_gib * 1024**3),
            devices=overrides.get("devices", 1),
            num_nodes=overrides.get("num_nodes", 1),
            precision=overrides.get("precision") or "auto",
            checkpointing="auto"
            if overrides.get("gradient_checkpointing") is None
            else bool(overrides["gradient_checkpointing"]),
        )
        if not plan.feasible:
            raise ValueError(f"No micro-batch fits {plan.budget_label}: {plan.advice}")
        rest = {k: v for k, v in overrides.items() if k not in planned}
        return dataclasses.replace(plan.preset, **rest) if rest else plan.preset

    # ---------------------------------------------------------------------------------------------- properties
    @property
    def accumulate_grad_batches(self) -> int:
        """Micro-batches per optimizer step (1 without an effective batch)."""
        return self.plan.accumulate_grad_batches if self.plan is not None else 1

    @property
    def batch_size(self) -> int:
        """The DataLoader's batch per rank: the micro-batch, or the whole per-rank batch with ``auto_micro_batch``.

        Without ``effective_batch_size`` it is ``micro_batch_size``, or :data:`DEFAULT_BATCH_SIZE` (32) when that is
        not given either: never ``None`` (a DataLoader given ``batch_size=None`` would yield single samples).
        """
        if self.plan is not None:
            return self.plan.micro_batch_size
        return self.micro_batch_size if self.micro_batch_size is not None else DEFAULT_BATCH_SIZE

    @property
    def auto_micro_batch_start(self) -> int | str | None:
        """Where the preset's ``AutoMicroBatch`` starts: ``micro_batch_size`` or ``"auto"``; ``None`` without it."""
        if not self.auto_micro_batch:
            return None
        return self.micro_batch_size if self.micro_batch_size is not None else "auto"

    # ---------------------------------------------------------------------------------------------- outputs
    def precision_plugin(self) -> Any:
        """The :class:`~lightning_memopt.MemoryPrecision` plugin this preset uses."""
        from lightning_memopt.plugins.precision import MemoryPrecision

        plugin = MemoryPrecision(
            self.precision,  # type: ignore[arg-type]
            float32_matmul_precision=self.float32_matmul_precision or None,  # type: ignore[arg-type]
            allow_emulated_bf16=self.allow_emulated_bf16,
        )
        plugin.setting = "MemoryPreset(precision={0!r})` (`memory.precision: {0}` in a LightningCLI config)"
        return plugin

    def _callback_factories(self) -> list[tuple[type, Any]]:
        """``(type, build)`` for each callback the preset implies, in order; nothing is built yet."""
        from lightning_memopt.callbacks import (
            AllocatorSettings,
            AutoMicroBatch,
            CacheCleaner,
            GarbageCollector,
            GradientCheckpointing,
            MemoryMonitor,
        )

        out: list[tuple[type, Any]] = []
        if self.monitor:
            out.append((MemoryMonitor, MemoryMonitor))
        if self.cache_clean_on_phase_end:
            out.append(
                (
                    CacheCleaner,
                    lambda: CacheCleaner(every_n_train_batches=None, every_n_val_batches=None, on_phase_end=True),
                )
            )
        if self.gc_every_n_steps:
            out.append((GarbageCollector, lambda: GarbageCollector(every_n_steps=self.gc_every_n_steps)))
        if self.gradient_checkpointing:
            modules = list(self.checkpoint_modules) if self.checkpoint_modules else None
            out.append((GradientCheckpointing, lambda: GradientCheckpointing(modules=modules)))
        if self.auto_micro_batch:
            out.append((AutoMicroBatch, lambda: AutoMicroBatch(micro_batch_size=self.auto_micro_batch_start)))
        if self.allocator_conf or self.memory_fraction is not None:
            # built last and only when used: it sets the allocator's environment when it is made
            conf, fraction = self.allocator_conf or None, self.memory_fraction
            out.append((AllocatorSettings, lambda: AllocatorSettings(conf, fraction)))
        return out

    def callbacks(self, exclude: tuple[type, ...] = ()) -> list[Any]:
        """The callbacks the preset implies, built fresh on every call, leaving out those of the ``exclude`` types."""
        return [build() for kind, build in self._callback_factories() if not issubclass(kind, exclude)]

    def dataloader_kwargs(self, cpu_count: int | None = None, cuda: bool | None = None) -> dict[str, Any]:
        """DataLoader settings for this preset's memory tier (``DataLoader(dataset, **preset.dataloader_kwargs())``).

        Batches prepared ahead cost ``num_workers x prefetch_factor x batch`` host memory (and as much again pinned
        with ``pin_memory``): ``max-savings`` keeps 2 workers with 1 batch each ahead, ``balanced`` up to 4 workers
        with 2 (PyTorch's default), ``max-speed`` up to 8 with 2 and persistent workers. Workers are capped at the
        CPU cores per device; ``pin_memory`` only where CUDA is there to copy to.

        Example:
            >>> MemoryPreset("max-savings").dataloader_kwargs(cpu_count=16, cuda=True)
            {'batch_size': 32, 'num_workers': 2, 'prefetch_factor': 1, 'pin_memory': True, 'persistent_workers': False}
        """
        import os

        cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
        cuda = torch.cuda.is_available() if cuda is None else cuda
        wanted, prefetch = {"max-savings": (2, 1), "balanced": (4, 2), "max-speed": (8, 2)}[self.name]
        workers = max(0, min(wanted, cores // max(1, self.devices) - 1))
        out: dict[str, Any] = {"batch_size": self.batch_size, "num_workers": workers}
        if workers:
            out["prefetch_factor"] = prefetch
        out["pin_memory"] = bool(cuda)
        out["persistent_workers"] = bool(workers) and self.name == "max-speed"
        return out

    def _precision_string(self) -> str:
        """A Lightning precision string for strategies with their own precision classes, resolved on this machine."""
        if torch.cuda.is_available():
            index = torch.cuda.current_device()
            cap = tuple(torch.cuda.get_device_capability(index))
            choice = choose_precision(
                self.precision,  # type: ignore[arg-type]
                "cuda",
                cap,  # type: ignore[arg-type]
                torch.cuda.get_device_name(index),
                self.allow_emulated_bf16,
            )
        else:
            choice = choose_precision(self.precision, "cpu")  # type: ignore[arg-type]
        return choice.precision

    def trainer_kwargs(self, **trainer_kwargs: Any) -> dict[str, Any]:
        """Arguments for ``Trainer(**kwargs)``, merged with your own ``trainer_kwargs``.

        Returns ``plugins=[MemoryPrecision(...)]`` (or ``precision="..."`` for FSDP/DeepSpeed strategies, which need
        their own precision classes), ``accumulate_grad_batches``, ``gradient_clip_val``, ``callbacks`` (yours first,
        then the preset's; with ``auto_micro_batch`` an ``AutoMicroBatch`` of yours replaces the preset's) and, with
        an effective batch, ``devices`` and ``num_nodes``. Allocator settings are applied now, before CUDA is
        initialised, by the ``AllocatorSettings`` callback built here.

        Raises:
            ValueError: when one of ``trainer_kwargs`` contradicts the preset; the message says which to drop.

        Example:
            >>> preset = MemoryPreset(effective_batch_size=64, micro_batch_size=8)
            >>> preset.trainer_kwargs(precision="16-mixed")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: Both `precision='16-mixed'` and the preset's MemoryPrecision plugin were given. Drop ...
        """
        out: dict[str, Any] = dict(trainer_kwargs)
        from lightning_memopt.plugins.precision import has_own_precision

        if has_own_precision(trainer_kwargs.get("strategy")):
            if "precision" in trainer_kwargs:
                pass  # the user chose for their strategy
            else:
                out["precision"] = self._precision_string()
        else:
            user_plugins = trainer_kwargs.get("plugins") or []
            user_plugins = list(user_plugins) if isinstance(user_plugins, (list, tuple)) else [user_plugins]
            if "precision" in trainer_kwargs and trainer_kwargs["precision"] is not None:
                raise ValueError(
                    f"Both `precision={trainer_kwargs['precision']!r}` and the preset's MemoryPrecision plugin were"
                    f" given. Drop `precision=` from the Trainer arguments and set"
                    f" `MemoryPreset(precision={trainer_kwargs['precision']!r})` instead."
                )
            from lightning_memopt.utilities.namespaces import is_instance

            theirs = [p for p in user_plugins if is_instance(p, "plugins.precision.Precision")]
            if theirs:
                raise ValueError(
                    f"Both `plugins=[{type(theirs[0]).__name__}(...)]` and the preset's MemoryPrecision plugin were"
                    " given. Drop that precision plugin from `plugins` (set `MemoryPreset(precision=...)` instead)."
                )
            out.pop("precision", None)
            out["plugins"] = [*user_plugins, self.precision_plugin()]
        for key, value in (
            ("accumulate_grad_batches", self.accumulate_grad_batches),
            ("gradient_clip_val", self.gradient_clip_val),
        ):
            given = trainer_kwargs.get(key)
            if (
                given is not None
                and value is not None
                and given != value
                and not (key == "accumulate_grad_batches" and self.plan is None)
            ):
                why = (
                    "with `auto_micro_batch=True` the DataLoader yields the whole per-device batch and"
                    " AutoMicroBatch splits it"
                    if self.auto_micro_batch
                    else "the preset computes it from `effective_batch_size`"
                )
                raise ValueError(
                    f"`{key}={given!r}` contradicts the preset's {key}={value!r}. Drop `{key}=` from the Trainer"
                    f" arguments ({why}) or change the preset."
                )
            if given is None:
                out[key] = value
        if self.plan is not None:
            for key in ("devices", "num_nodes"):
                value = getattr(self, key)
                given = trainer_kwargs.get(key)
                count = device_count(trainer_kwargs.get("accelerator", "auto"), given) if key == "devices" else given
                if given is not None and count == value:
                    continue  # the same number, written your way (e.g. devices=[0, 1] or "2")
                if given is not None and given != value:
                    raise ValueError(
                        f"`{key}={given!r}` differs from the preset's `{key}={value}`, so the effective batch would"
                        f" not be {self.effective_batch_size}. Drop `{key}=` from the Trainer arguments or build the"
                        f" preset with `{key}={given!r}`."
                    )
                out[key] = value
        user_callbacks = trainer_kwargs.get("callbacks") or []
        user_callbacks = list(user_callbacks) if isinstance(user_callbacks, (list, tuple)) else [user_callbacks]
        # a callback of yours of a type the preset adds replaces the preset's: yours, with your settings, only one
        kinds = [kind for kind, _ in self._callback_factories()]
        replaced = tuple(kind for kind in kinds if any(isinstance(c, kind) for c in user_callbacks))
        for kind in replaced:
            if kind.__name__ not in self._said:
                self._said.add(kind.__name__)
                rank_zero_info(f"MemoryPreset {self.name!r}: your {kind.__name__} is used instead of the preset's.")
        out["callbacks"] = [*user_callbacks, *self.callbacks(exclude=replaced)]
        return out

    def merge_trainer_config(self, trainer_config: Mapping[str, Any]) -> dict[str, Any]:
        """:meth:`trainer_kwargs` for a complete trainer configuration, such as LightningCLI's ``trainer`` section.

        A complete configuration lists every Trainer argument, most of them at their defaults. Entries that the
        preset decides and that still hold the Trainer's default (``accumulate_grad_batches: 1``, ``devices: auto``,
        ``num_nodes: 1``, ``precision: null``, ``plugins: null``, ``callbacks: null``, ``gradient_clip_val: null``)
        are taken from the preset instead of counting as a contradiction; any other value that disagrees with the
        preset raises as in :meth:`trainer_kwargs`. Entries the preset does not decide are kept as they are.

        Example:
            >>> preset = MemoryPreset.from_name("max-speed", effective_batch_size=32, micro_batch_size=8)
            >>> kwargs = preset.merge_trainer_config({"accumulate_grad_batches": 1, "devices": "auto", "max_steps": 9})
            >>> kwargs["accumulate_grad_batches"], kwargs["devices"], kwargs["max_steps"]
            (4, 1, 9)
        """
        if not isinstance(trainer_config, Mapping):
            raise ValueError(
                f"`trainer_config` must be a mapping of Trainer arguments (such as LightningCLI's `trainer` section),"
                f" got {trainer_config!r} ({type(trainer_config).__name__}). For keyword arguments use"
                " `trainer_kwargs(**kwargs)`."
            )
        defaults = _trainer_defaults()
        given = dict(trainer_config)
        at_default = {
            key: given.pop(key)
            for key in _PRESET_TRAINER_KEYS
            if key in given and key in defaults and _same(given[key], defaults[key])
        }
        out = self.trainer_kwargs(**given)
        for key, value in at_default.items():
            out.setdefault(key, value)
        return out

    # ---------------------------------------------------------------------------------------------- describe
    def describe(self) -> str:
        """A table of every knob: its value and why it is set.

        Example:
            >>> print(MemoryPreset.from_name("max-speed").describe().splitlines()[0])
            MemoryPreset 'max-speed'
        """
        rows = [
            (
                "precision",
                self.precision,
                "MemoryPrecision mode; 'auto' = bf16 on GPUs with native bf16, fp16+scaler on"
                " older GPUs, fp32 on CPU. Halves activation memory.",
            ),
            (
                "float32_matmul_precision",
                self.float32_matmul_precision or "unchanged",
                "'high' lets fp32 matmuls use TF32 on Ampere+; restored after fit.",
            ),
            (
                "gradient_checkpointing",
                self.gradient_checkpointing,
                "recompute block activations in backward: far less activation memory for ~1 extra forward.",
            ),
            (
                "checkpoint_modules",
                self.checkpoint_modules or "HF switch / nn.Transformer layers",
                "which blocks to checkpoint.",
            ),
            ("effective_batch_size", self.effective_batch_size, "samples per optimizer step over all ranks (kept)."),
            ("batch_size (micro)", self.batch_size, "samples per forward pass and rank: peak memory scales with it.")
            if not self.auto_micro_batch
            else (
                "batch_size (per device)",
                self.batch_size,
                "samples per DataLoader batch and rank (the whole per-device batch).",
            ),
            (
                "accumulate_grad_batches",
                self.accumulate_grad_batches,
                "effective / (micro x devices x nodes): same gradients as the full batch."
                if not self.auto_micro_batch
                else "AutoMicroBatch accumulates the micro-batches of each batch itself.",
            ),
            ("devices x num_nodes", f"{self.devices} x {self.num_nodes}", "world size used in the arithmetic."),
            ("auto_micro_batch", self.auto_micro_batch, self._auto_micro_batch_reason()),
            ("gradient_clip_val", self.gradient_clip_val, "gradient norm clipping (None = off)."),
            (
                "allocator_conf",
                self.allocator_conf or "unchanged",
                "expandable segments reduce fragmentation; applied before CUDA initialises.",
            ),
            ("memory_fraction", self.memory_fraction, "cap on this process's share of device memory (None = all)."),
            (
                "cache_clean_on_phase_end",
                self.cache_clean_on_phase_end,
                "CacheCleaner: return cached blocks between train and validation.",
            ),
            (
                "gc_every_n_steps",
                self.gc_every_n_steps or "off",
                "GarbageCollector: collect cycles holding tensors on all ranks at the same step.",
            ),
            ("monitor", self.monitor, "MemoryMonitor: per-phase peaks and threshold warnings."),
            (
                "dataloader",
                ", ".join(f"{k}={v}" for k, v in self.dataloader_kwargs().items() if k != "batch_size"),
                "recommended: batches prepared ahead cost num_workers x prefetch_factor x batch of host memory"
                " (preset.dataloader_kwargs()).",
            ),
        ]
        title = f"MemoryPreset {self.name!r}" + (f" (tier {self.tier})" if self.tier else "")
        width = max(len(r[0]) for r in rows)
        vwidth = max(len(str(r[1])) for r in rows)
        lines = [title, "-" * len(title)]
        lines += [f"{k:<{width}}  {v!s:<{vwidth}}  {why}" for k, v, why in rows]
        return "\n".join(lines)

    def _auto_micro_batch_reason(self) -> str:
        if not self.auto_micro_batch:
            return (
                "off: an out-of-memory error ends the run (True: AutoMicroBatch splits the per-device batch and"
                " halves on out-of-memory)."
            )
        start = "the whole batch" if self.micro_batch_size is None else f"{self.micro_batch_size}"
        size = f" ({self.batch_size})" if self.batch_size is not None else ""
        return (
            f"the DataLoader yields the whole per-device batch{size} and AutoMicroBatch splits it into"
            f" micro-batches (from {start}), halving on out-of-memory with the same effective batch."
        )

    def __str__(self) -> str:
        return self.describe()
