"""MemoryPreset: named memory presets and GPU-size tiers that keep the effective batch -> ``Trainer(**kwargs)``."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from lightning_memopt.functional.allocator import check_alloc_conf
from lightning_memopt.functional.presets import (
    PRESET_NAMES,
    PRESETS,
    AccumulationPlan,
    PrecisionInput,
    normalize_precision,
    plan_accumulation,
    plan_auto_micro_batch,
    tier_for_memory,
)
from lightning_memopt.plugins.precision import MemoryPrecision
from lightning_memopt.presets.printing import describe
from lightning_memopt.presets.table import DEFAULT_BATCH_SIZE, KNOBS, PresetName, checkpoint_modules
from lightning_memopt.presets.trainer_config import build_trainer_kwargs, callback_factories, merge_trainer_config
from lightning_memopt.utilities.checks import (
    check_bool,
    check_choice,
    check_fraction,
    check_non_negative_int,
    check_non_negative_number,
    check_positive_int,
    check_str,
)

__all__ = ["MemoryPreset"]


@dataclass(frozen=True)
class MemoryPreset:
    """A named bundle of memory knobs that keeps the effective batch and turns into ``Trainer`` arguments.

    Three presets, ``max-savings``, ``balanced`` and ``max-speed``, set precision (``"auto"``: resolved by
    :class:`~lightning_memopt.MemoryPrecision` on the training device), TF32, gradient checkpointing, the
    accumulation target, the allocator settings and the memory callbacks; :meth:`for_device` picks one from the GPU
    size. ``accumulate_grad_batches = effective_batch_size / (micro_batch_size x devices x num_nodes)``, never
    rounded: a split that does not divide raises a ``ValueError`` naming the nearest valid sizes. Pass
    :attr:`batch_size` to your DataLoader and :meth:`trainer_kwargs` to the Trainer. A callback you pass of a type
    the preset adds replaces the preset's. Knob fields left ``None`` take the preset's value; turn a knob off with
    ``False``, ``0`` or ``""``. The tiers, what each preset turns on, ``auto_micro_batch``, the short last window,
    LightningCLI and :meth:`merge_trainer_config` are explained in ``docs/presets.md``.

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
        for knob in KNOBS:
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
        object.__setattr__(
            self, "memory_fraction", check_fraction("memory_fraction", self.memory_fraction, allow_none=True)
        )
        check_str("allocator_conf", self.allocator_conf, hint="Example: 'expandable_segments:True'.")
        check_alloc_conf(self.allocator_conf)
        check_non_negative_number(
            "gradient_clip_val", self.gradient_clip_val, allow_none=True, hint="Use None for no clipping."
        )
        check_str("tier", self.tier, allow_none=True, hint="It is set by `MemoryPreset.for_device()`, e.g. '16GB'.")
        object.__setattr__(self, "checkpoint_modules", checkpoint_modules(self.checkpoint_modules))
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
        return cls(name=cast(PresetName, name), **overrides)

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
        plugin = MemoryPrecision(
            cast(PrecisionInput, self.precision),
            float32_matmul_precision=cast(Any, self.float32_matmul_precision or None),
            allow_emulated_bf16=self.allow_emulated_bf16,
        )
        plugin.setting = "MemoryPreset(precision={0!r})` (`memory.precision: {0}` in a LightningCLI config)"
        return plugin

    def _callback_factories(self) -> list[tuple[type, Any]]:
        """``(type, build)`` for each callback the preset implies, in order; nothing is built yet."""
        return callback_factories(self)

    def callbacks(self, exclude: tuple[type, ...] = ()) -> list[Any]:
        """The callbacks the preset implies, built fresh on every call, leaving out those of the ``exclude`` types."""
        return [build() for kind, build in callback_factories(self) if not issubclass(kind, exclude)]

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

    def trainer_kwargs(self, **trainer_kwargs: Any) -> dict[str, Any]:
        """Arguments for ``Trainer(**kwargs)``, merged with your own ``trainer_kwargs``.

        Returns ``plugins=[MemoryPrecision(...)]`` (or ``precision="..."`` for FSDP/DeepSpeed strategies, which need
        their own precision classes), ``accumulate_grad_batches``, ``gradient_clip_val``, ``callbacks`` (yours first,
        then the preset's; with ``auto_micro_batch`` an ``AutoMicroBatch`` of yours replaces the preset's) and, with
        an effective batch, ``devices`` and ``num_nodes``. Building them changes nothing in the process: the
        ``AllocatorSettings`` callback built here applies the allocator settings at ``setup`` and gives them back at
        teardown (see its docstring for the keys that take effect once CUDA is initialised).

        Raises:
            ValueError: when one of ``trainer_kwargs`` contradicts the preset; the message says which to drop.

        Example:
            >>> preset = MemoryPreset(effective_batch_size=64, micro_batch_size=8)
            >>> preset.trainer_kwargs(precision="16-mixed")  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: Both `precision='16-mixed'` and the preset's MemoryPrecision plugin were given. Drop ...
        """
        return build_trainer_kwargs(self, trainer_kwargs)

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
        return merge_trainer_config(self, trainer_config)

    # ---------------------------------------------------------------------------------------------- describe
    def describe(self) -> str:
        """A table of every knob: its value and why it is set.

        Example:
            >>> print(MemoryPreset.from_name("max-speed").describe().splitlines()[0])
            MemoryPreset 'max-speed'
        """
        return describe(self)

    def __str__(self) -> str:
        return self.describe()
