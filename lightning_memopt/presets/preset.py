"""MemoryPreset: named memory presets and GPU-size tiers that keep the effective batch -> ``Trainer(**kwargs)``.

The dataclass, its table and printout, then how a preset becomes Trainer arguments (its callbacks, its precision
plugin or string, the accumulation and world size it pins, merged with the user's own arguments or LightningCLI's
config). The LightningCLI integration is ``cli.py``.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import textwrap
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

import torch
from torch import nn

from lightning_memopt.callbacks import (
    AllocatorSettings,
    AutoMicroBatch,
    CacheCleaner,
    GarbageCollector,
    GradientCheckpointing,
    MemoryMonitor,
)
from lightning_memopt.functional.allocator import check_alloc_conf
from lightning_memopt.functional.precision import (
    PrecisionInput,
    choose_precision,
    fsdp2_policy,
    has_own_precision,
    normalize_precision,
)
from lightning_memopt.functional.presets import (
    PRESET_NAMES,
    PRESETS,
    AccumulationPlan,
    configure_model_recipe,
    normalize_checkpoint_modules,
    plan_accumulation,
    plan_auto_micro_batch,
    tier_for_memory,
)
from lightning_memopt.plugins.precision import MemoryPrecision
from lightning_memopt.utilities.checks import (
    check_bool,
    check_choice,
    check_fraction,
    check_non_negative_int,
    check_non_negative_number,
    check_positive_int,
    check_str,
)
from lightning_memopt.utilities.formatting import WIDTH
from lightning_memopt.utilities.namespaces import classes, is_instance, rank_zero_info

if TYPE_CHECKING:
    from lightning_memopt.planner import MemoryPlan

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "KNOBS",
    "MemoryPreset",
    "PLANNED",
    "PRESET_TRAINER_KEYS",
    "PresetName",
    "device_count",
]

#: The DataLoader batch per device when a preset has neither ``effective_batch_size`` nor ``micro_batch_size``.
DEFAULT_BATCH_SIZE = 32

#: The preset names (a ``Literal``, so LightningCLI lists them in ``--help`` and refuses a typo while parsing).
PresetName = Literal["max-savings", "balanced", "max-speed"]

#: The fields a preset fills from its table entry (:data:`~lightning_memopt.functional.presets.PRESETS`) when they
#: are left ``None``.
KNOBS = (
    "precision",
    "float32_matmul_precision",
    "gradient_checkpointing",
    "allocator_conf",
    "cache_clean_on_phase_end",
    "gc_every_n_train_steps",
    "monitor",
)
#: The fields a :class:`~lightning_memopt.MemoryPlan` decides (:meth:`MemoryPreset.from_plan` takes them from it).
PLANNED = (
    "effective_batch_size",
    "micro_batch_size",
    "eval_batch_size",
    "devices",
    "num_nodes",
    "precision",
    "gradient_checkpointing",
    "checkpoint_modules",
    "strategy",
    "reshard_after_forward",
    "cpu_offload",
    "shard_blocks",
    "shard_roots",
)
#: What ``MemoryPreset(strategy=...)`` accepts: ``None`` (the Trainer's own choice), ``"ddp"`` or ``"fsdp2"``
#: (Lightning's ``ModelParallelStrategy`` with ``fully_shard`` in ``configure_model``).
PresetStrategy = Literal["ddp", "fsdp2"]


@dataclass(frozen=True)
class MemoryPreset:
    """A named bundle of memory knobs that keeps the effective batch and turns into ``Trainer`` arguments.

    Three presets, ``max-savings``, ``balanced`` and ``max-speed``, set precision (``"auto"``: resolved by
    :class:`~lightning_memopt.MemoryPrecision` on the training device), TF32, gradient checkpointing, the
    accumulation target, the allocator settings and the memory callbacks; :meth:`for_device` picks one from the GPU
    size. ``accumulate_grad_batches = effective_batch_size / (micro_batch_size x devices x num_nodes)``, never
    rounded: a split that does not divide raises a ``ValueError`` naming the nearest valid sizes. Pass
    :attr:`batch_size` to your DataLoader and :meth:`trainer_kwargs` to the Trainer; :meth:`from_plan` builds the
    preset of a :func:`~lightning_memopt.plan_memory` plan. A callback you pass of a type
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
        checkpoint_modules: the blocks :class:`~lightning_memopt.GradientCheckpointing` wraps: class names, name
            patterns or module classes; ``None``: the model's own switch, else PyTorch transformer layers.
        gradient_clip_val: passed to the Trainer (``None`` = no clipping).
        allocator_conf: CUDA caching-allocator settings, e.g. ``"expandable_segments:True"``.
        memory_fraction: fraction of device memory this process may use, in (0, 1].
        cache_clean_on_phase_end: add ``CacheCleaner`` emptying the CUDA cache at phase ends.
        gc_every_n_train_steps: add ``GarbageCollector`` collecting every that many optimizer steps; ``0`` = none.
        monitor: add ``MemoryMonitor``.
        allow_emulated_bf16: allow bf16 on GPUs that only emulate it.
        tier: set by :meth:`for_device` (the GPU-size tier label); informational.
        auto_micro_batch: the DataLoader yields the whole per-device batch and ``AutoMicroBatch`` splits it,
            halving on out-of-memory; ``micro_batch_size`` is then where it starts (``None``: the whole batch).
        strategy: ``None`` leaves the Trainer's strategy alone; ``"ddp"`` passes ``strategy="ddp"``; ``"fsdp2"``
            passes ``ModelParallelStrategy(data_parallel_size=devices x num_nodes, tensor_parallel_size=1)`` (and
            a precision string, as that strategy needs): paste :attr:`configure_model_recipe` into the
            LightningModule. :meth:`from_plan` sets it from the plan.
        reshard_after_forward: FSDP2's option in the recipe (``"fsdp2"`` only).
        cpu_offload: FSDP2's CPU offload in the recipe (``"fsdp2"`` only).
        shard_blocks: the qualified names of the blocks the recipe applies ``fully_shard`` to, before the roots;
            ``None``: the LightningModule's own ``configure_model`` shards (``"fsdp2"`` only).
        shard_roots: the qualified names the recipe applies ``fully_shard`` to after the blocks (``""``: the
            module); ``None``: as ``shard_blocks`` (``"fsdp2"`` only).
        eval_batch_size: the batch per rank of the validation, test and predict DataLoaders (evaluation holds no
            gradients or optimizer states, so it often fits a larger one); ``None``: :attr:`batch_size`.
            :meth:`from_plan` sets it from ``plan_memory(evaluation=...)``; read it through
            :attr:`evaluation_batch_size`.
        mixed_precision_policy: with ``strategy="fsdp2"`` and a ``"bf16-mixed"`` or ``"16-mixed"`` precision, FSDP2
            owns the mixed precision: the recipe gives ``fully_shard`` a ``MixedPrecisionPolicy`` (that dtype,
            gradients reduced in float32) and the Trainer runs at ``"32-true"`` (no autocast, no double cast). It
            usually needs less memory per rank (``plan.policy_estimate`` says how much).

    Examples:
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
    gc_every_n_train_steps: int | None = None
    monitor: bool | None = None
    allow_emulated_bf16: bool = False
    tier: str | None = None
    auto_micro_batch: bool = False
    strategy: PresetStrategy | None = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    shard_blocks: tuple[str, ...] | None = None
    shard_roots: tuple[str, ...] | None = None
    eval_batch_size: int | None = None
    mixed_precision_policy: bool = False
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
        check_non_negative_int(
            "gc_every_n_train_steps", self.gc_every_n_train_steps, hint="Use 0 for no garbage collector."
        )
        object.__setattr__(
            self, "memory_fraction", check_fraction("memory_fraction", self.memory_fraction, allow_none=True)
        )
        check_str("allocator_conf", self.allocator_conf, hint="Example: 'expandable_segments:True'.")
        check_alloc_conf(self.allocator_conf)
        check_non_negative_number(
            "gradient_clip_val", self.gradient_clip_val, allow_none=True, hint="Use None for no clipping."
        )
        check_str("tier", self.tier, allow_none=True, hint="It is set by `MemoryPreset.for_device()`, e.g. '16GB'.")
        object.__setattr__(self, "checkpoint_modules", normalize_checkpoint_modules(self.checkpoint_modules))
        check_positive_int("devices", self.devices, hint="Pass the number of devices per node, as for the Trainer.")
        check_positive_int("num_nodes", self.num_nodes)
        check_positive_int("micro_batch_size", self.micro_batch_size, allow_none=True)
        check_positive_int("eval_batch_size", self.eval_batch_size, allow_none=True, hint="None: the training batch.")
        check_bool("mixed_precision_policy", self.mixed_precision_policy)
        if self.mixed_precision_policy and (self.strategy != "fsdp2" or fsdp2_policy(self.precision) is None):
            raise ValueError(
                f"`mixed_precision_policy=True` is FSDP2's own mixed precision: it needs `strategy='fsdp2'` and a"
                f" `precision` of 'bf16-mixed' or '16-mixed', got strategy={self.strategy!r},"
                f" precision={self.precision!r}."
            )
        _check_sharding(self)
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

        Examples:
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
    def from_plan(cls, plan: MemoryPlan, **overrides: Any) -> MemoryPreset:
        """The preset of a :func:`~lightning_memopt.plan_memory` plan, with ``overrides`` for the fields it leaves.

        The plan decides the effective batch, the micro-batch, the world, the precision, the checkpointing and the
        strategy (``"ddp"`` over several ranks; ``"fsdp2"`` with its blocks, roots and options: the Trainer gets
        ``ModelParallelStrategy`` and :attr:`configure_model_recipe` is the LightningModule's hook); the preset is
        its budget's GPU-size tier (``plan.preset_name``, ``tier`` = the budget's label) unless ``overrides`` name
        another. ``overrides`` may set any other field (``name``, ``monitor``,
        ``auto_micro_batch``, ...); a field the plan decides is refused: plan with it instead.

        Raises:
            ValueError: nothing fits (the message is the plan's advice), or ``overrides`` names a planned field.

        Examples:
            >>> from lightning_memopt import plan_memory
            >>> plan = plan_memory(nn.Linear(64, 64), lambda b: torch.randn(b, 64), effective_batch_size=8,
            ...                    budget="4GB", device="cpu")
            >>> preset = MemoryPreset.from_plan(plan, monitor=False)
            >>> preset.name, preset.tier, preset.batch_size, preset.accumulate_grad_batches, preset.precision
            ('max-savings', '4GB', 8, 1, '32-true')
        """
        if not plan.feasible:
            raise ValueError(f"No setting fits {plan.budget_label}: {plan.advice}")
        planned = sorted(set(overrides) & set(PLANNED))
        if planned:
            raise ValueError(
                f"`{planned[0]}` is decided by the plan ({planned[0]}={getattr(plan, planned[0])!r}), got"
                f" {overrides[planned[0]]!r} in `MemoryPreset.from_plan(plan, ...)`. Pass it to `plan_memory` instead,"
                " or build the preset with `MemoryPreset.from_name`."
            )
        fields = {"name": plan.preset_name, "tier": plan.budget_label, **_planned_fields(plan)}
        fields.update(overrides)
        return cls.from_name(**fields)

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
        training step on fake tensors and picks the micro-batch, precision and checkpointing that fit (10 % margin),
        and :meth:`from_plan` builds the preset with the other ``overrides``. If nothing fits, ``ValueError`` says
        what would (8-bit optimizer states, or FSDP over N GPUs).

        Examples:
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
        """:meth:`for_device` with a model: ``plan_memory`` with the planned fields of ``overrides``, then
        :meth:`from_plan` with the rest."""
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
        asked = {name: overrides.pop(name) for name in PLANNED if name in overrides}
        checkpointing = asked.get("gradient_checkpointing")
        checkpoint_modules = None
        if checkpointing is not False:
            checkpoint_modules = asked.get("checkpoint_modules")
        plan = plan_memory(
            module,
            batch_fn,
            effective_batch_size=asked["effective_batch_size"],
            budget=None if total_memory_gib is None else int(total_memory_gib * 1024**3),
            devices=asked.get("devices", 1),
            num_nodes=asked.get("num_nodes", 1),
            precision=normalize_precision(asked.get("precision") or "auto"),
            gradient_checkpointing="auto" if checkpointing is None else checkpointing,
            checkpoint_modules=checkpoint_modules,
        )
        if not plan.feasible:
            raise ValueError(f"No micro-batch fits {plan.budget_label}: {plan.advice}")
        return cls.from_plan(plan, **overrides)

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
    def evaluation_batch_size(self) -> int:
        """The batch per rank of the validation, test and predict DataLoaders: ``eval_batch_size``, else
        :attr:`batch_size`."""
        return self.eval_batch_size if self.eval_batch_size is not None else self.batch_size

    @property
    def auto_micro_batch_start(self) -> int | str | None:
        """Where the preset's ``AutoMicroBatch`` starts: ``micro_batch_size`` or ``"auto"``; ``None`` without it."""
        if not self.auto_micro_batch:
            return None
        return self.micro_batch_size if self.micro_batch_size is not None else "auto"

    @property
    def world_size(self) -> int:
        """Data-parallel ranks: ``devices x num_nodes``."""
        return self.devices * self.num_nodes

    @property
    def configure_model_recipe(self) -> str:
        """With ``strategy="fsdp2"``: the ``configure_model`` to paste into the LightningModule (``fully_shard`` per
        block, then the roots, with the preset's options), as text; ``""`` otherwise. Also in ``print(preset)``."""
        if self.strategy != "fsdp2":
            return ""
        policy = None
        if self.mixed_precision_policy:
            policy = fsdp2_policy(self.precision)
        return configure_model_recipe(
            self.world_size, self.shard_blocks, self.shard_roots, self.reshard_after_forward, self.cpu_offload, policy
        )

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

    def callbacks(self, exclude: tuple[type, ...] = ()) -> list[Any]:
        """The callbacks the preset implies, built fresh on every call, leaving out those of the ``exclude`` types."""
        return [build() for kind, build in preset_callbacks(self) if not issubclass(kind, exclude)]

    def dataloader_kwargs(self, cpu_count: int | None = None, cuda: bool | None = None) -> dict[str, Any]:
        """DataLoader settings for this preset's memory tier (``DataLoader(dataset, **preset.dataloader_kwargs())``).

        Batches prepared ahead cost ``num_workers x prefetch_factor x batch`` host memory (and as much again pinned
        with ``pin_memory``): ``max-savings`` keeps 2 workers with 1 batch each ahead, ``balanced`` up to 4 workers
        with 2 (PyTorch's default), ``max-speed`` up to 8 with 2 and persistent workers. Workers are capped at the
        CPU cores per device; ``pin_memory`` only where CUDA is there to copy to.

        Examples:
            >>> MemoryPreset("max-savings").dataloader_kwargs(cpu_count=16, cuda=True)
            {'batch_size': 32, 'num_workers': 2, 'prefetch_factor': 1, 'pin_memory': True, 'persistent_workers': False}
        """
        cores = cpu_count
        if cores is None:
            cores = os.cpu_count() or 1
        if cuda is None:
            cuda = torch.cuda.is_available()
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

        Returns ``plugins=[MemoryPrecision(...)]`` (or ``precision="..."`` for FSDP/DeepSpeed/model-parallel
        strategies, which need their own precision classes), the preset's ``strategy`` (when it sets one),
        ``accumulate_grad_batches``, ``gradient_clip_val``, ``callbacks`` (yours first,
        then the preset's; with ``auto_micro_batch`` an ``AutoMicroBatch`` of yours replaces the preset's) and, with
        an effective batch, ``devices`` and ``num_nodes``. Building them changes nothing in the process: the
        ``AllocatorSettings`` callback built here applies the allocator settings at ``setup`` and gives them back at
        teardown (see its docstring for the keys that take effect once CUDA is initialised).

        Raises:
            ValueError: when one of ``trainer_kwargs`` contradicts the preset; the message says which to drop.

        Examples:
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

        Examples:
            >>> preset = MemoryPreset.from_name("max-speed", effective_batch_size=32, micro_batch_size=8)
            >>> kwargs = preset.merge_trainer_config({"accumulate_grad_batches": 1, "devices": "auto", "max_steps": 9})
            >>> kwargs["accumulate_grad_batches"], kwargs["devices"], kwargs["max_steps"]
            (4, 1, 9)
        """
        return merge_trainer_config(self, trainer_config)

    # ---------------------------------------------------------------------------------------------- describe
    def describe(self) -> str:
        """A table of every knob: its value and why it is set; no line is wider than 100 columns.

        Examples:
            >>> print(MemoryPreset.from_name("max-speed").describe().splitlines()[0])
            MemoryPreset 'max-speed'
        """
        title = f"MemoryPreset {self.name!r}" + (f" (tier {self.tier})" if self.tier else "")
        recipe = self.configure_model_recipe
        return _table(title, _describe_rows(self)) + (f"\n\nconfigure_model (FSDP2):\n{recipe}" if recipe else "")

    def __str__(self) -> str:
        return self.describe()


def _describe_rows(preset: MemoryPreset) -> list[tuple[str, Any, str]]:
    """``(knob, value, why)`` for every knob of ``preset``."""
    auto = preset.auto_micro_batch
    loader = ", ".join(f"{k}={v}" for k, v in preset.dataloader_kwargs().items() if k != "batch_size")
    blocks = preset.checkpoint_modules
    modules = "default"
    if blocks:
        modules = ", ".join(b if isinstance(b, str) else b.__name__ for b in blocks)
    if auto:
        batch_why = "samples per DataLoader batch and rank (the whole per-device batch)."
        accumulate_why = "AutoMicroBatch accumulates the micro-batches of each batch itself."
    else:
        batch_why = "samples per forward pass and rank: peak memory scales with it."
        accumulate_why = "effective / (micro x devices x nodes): same gradients as the full batch."
    rows: list[tuple[str, Any, str]] = [
        (
            "precision",
            preset.precision,
            "MemoryPrecision mode; 'auto' = bf16 on GPUs with native bf16, fp16+scaler on older GPUs, fp32 on CPU."
            " Halves activation memory.",
        ),
        (
            "float32_matmul_precision",
            preset.float32_matmul_precision or "unchanged",
            "'high' lets fp32 matmuls use TF32 on Ampere+; restored after fit.",
        ),
        (
            "gradient_checkpointing",
            preset.gradient_checkpointing,
            "recompute block activations in backward: far less activation memory for ~1 extra forward.",
        ),
        (
            "checkpoint_modules",
            modules,
            "which blocks to checkpoint (default: the model's own switch, else nn.Transformer layers).",
        ),
        ("effective_batch_size", preset.effective_batch_size, "samples per optimizer step over all ranks (kept)."),
        (
            "batch_size (per device)" if auto else "batch_size (micro)",
            preset.batch_size,
            batch_why,
        ),
        ("accumulate_grad_batches", preset.accumulate_grad_batches, accumulate_why),
    ]
    if preset.eval_batch_size is not None:
        rows.append(
            ("eval_batch_size", preset.eval_batch_size, "validation/test/predict DataLoader batch per rank (planned).")
        )
    rows += [
        ("devices x num_nodes", f"{preset.devices} x {preset.num_nodes}", "world size used in the arithmetic."),
        ("strategy", preset.strategy or "Trainer's", _strategy_reason(preset)),
        ("auto_micro_batch", preset.auto_micro_batch, _auto_micro_batch_reason(preset)),
        ("gradient_clip_val", preset.gradient_clip_val, "gradient norm clipping (None = off)."),
        (
            "allocator_conf",
            preset.allocator_conf or "unchanged",
            "expandable segments reduce fragmentation; applied at setup, given back at teardown.",
        ),
        ("memory_fraction", preset.memory_fraction, "cap on this process's share of device memory (None = all)."),
        (
            "cache_clean_on_phase_end",
            preset.cache_clean_on_phase_end,
            "CacheCleaner: return cached blocks between train and validation.",
        ),
        (
            "gc_every_n_train_steps",
            preset.gc_every_n_train_steps or "off",
            "GarbageCollector: collect cycles holding tensors on all ranks at the same step.",
        ),
        ("monitor", preset.monitor, "MemoryMonitor: per-phase peaks and threshold warnings."),
        (
            "dataloader",
            loader,
            "recommended (preset.dataloader_kwargs()): batches prepared ahead cost num_workers x prefetch_factor x"
            " batch of host memory.",
        ),
    ]
    return rows


def _strategy_reason(preset: MemoryPreset) -> str:
    if preset.strategy == "fsdp2":
        offload = ", CPU offload of parameters, gradients and optimizer states" if preset.cpu_offload else ""
        return (
            f"ModelParallelStrategy(data_parallel_size={preset.world_size}): FSDP2 shards the model over the ranks"
            f" (reshard_after_forward={preset.reshard_after_forward}{offload}); paste configure_model below."
        )
    if preset.strategy == "ddp":
        return "every rank holds the whole model (no all-gathers: fastest where it fits)."
    return "not set by the preset."


def _check_sharding(preset: MemoryPreset) -> None:
    """``strategy`` and the FSDP2 fields: known values, and the FSDP2 ones only with ``strategy="fsdp2"``."""
    check_choice(
        "strategy", preset.strategy, (None, *get_args(PresetStrategy)), hint="None leaves the Trainer's strategy alone."
    )
    check_bool("reshard_after_forward", preset.reshard_after_forward)
    check_bool("cpu_offload", preset.cpu_offload)
    for key in ("shard_blocks", "shard_roots"):
        value = getattr(preset, key)
        if value is None:
            continue
        names = (value,) if isinstance(value, str) else value
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise ValueError(
                f'`{key}` must be a list of qualified module names ("": the module itself) or None, got {value!r}.'
            )
        object.__setattr__(preset, key, tuple(names))
    sharding = [k for k in ("shard_blocks", "shard_roots") if getattr(preset, k) is not None]
    sharding += ["cpu_offload"] if preset.cpu_offload else []
    if preset.strategy != "fsdp2" and sharding:
        raise ValueError(
            f"`{sharding[0]}` shapes FSDP2's configure_model, but `strategy`={preset.strategy!r}. Pass"
            f" `strategy='fsdp2'`, or drop `{sharding[0]}`."
        )
    if preset.strategy == "fsdp2" and preset.world_size == 1:
        raise ValueError(
            "`strategy`='fsdp2' shards over `devices` x `num_nodes` = 1 rank: nothing to shard. Pass the GPUs"
            " (`devices`, `num_nodes`), or drop `strategy`."
        )


def _planned_fields(plan: MemoryPlan) -> dict[str, Any]:
    """The preset's fields a plan decides (:data:`PLANNED`)."""
    fields = {n: getattr(plan, n) for n in PLANNED if n not in ("strategy", "reshard_after_forward")}
    fields["strategy"] = plan.preset_strategy
    if plan.sharded:
        fields["reshard_after_forward"] = bool(plan.reshard_after_forward)
    return fields


def _auto_micro_batch_reason(preset: MemoryPreset) -> str:
    if not preset.auto_micro_batch:
        return (
            "off: an out-of-memory error ends the run (True: AutoMicroBatch splits the per-device batch and"
            " halves on out-of-memory)."
        )
    start = "the whole batch" if preset.micro_batch_size is None else f"{preset.micro_batch_size}"
    return (
        f"the DataLoader yields the whole per-device batch ({preset.batch_size}) and AutoMicroBatch splits it into"
        f" micro-batches (from {start}), halving on out-of-memory with the same effective batch."
    )


def _table(title: str, rows: list[tuple[str, Any, str]], width: int = WIDTH) -> str:
    """``title`` over three columns (knob, value, why), the last wrapped so that no line is wider than ``width``; a
    value wider than its column gets a line of its own, the reason below it."""
    knob = max(len(k) for k, _, _ in rows)
    value = min(max(len(str(v)) for _, v, _ in rows), 10)
    indent = " " * (knob + value + 4)
    lines = [title, "-" * len(title)]
    for k, v, why in rows:
        reason = textwrap.wrap(why, width - len(indent))
        text = str(v)
        if len(text) > value:
            lines += textwrap.wrap(
                text, width, initial_indent=f"{k:<{knob}}  ", subsequent_indent=" " * (knob + 2), break_on_hyphens=False
            )
            lines += [indent + r for r in reason]
        else:
            lines.append(f"{k:<{knob}}  {text:<{value}}  {reason[0]}")
            lines += [indent + r for r in reason[1:]]
    return "\n".join(lines)


# ------------------------------------------------------------------ from a preset to Trainer arguments
#: Trainer arguments that ``MemoryPreset.trainer_kwargs`` decides.
PRESET_TRAINER_KEYS = (
    "precision",
    "plugins",
    "accumulate_grad_batches",
    "gradient_clip_val",
    "devices",
    "num_nodes",
    "callbacks",
    "strategy",
)


def device_count(accelerator: Any, devices: Any) -> int | None:
    """How many devices per node ``Trainer(accelerator=..., devices=...)`` trains on; ``None`` if it cannot tell.

    Counts as Lightning does: a list (or ``"0,1"``) by its length, a positive int (or its string) as is, ``"auto"``
    and ``-1`` as every CUDA GPU for a CUDA accelerator, one device for the CPU and others.

    Examples:
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


def _trainer_defaults() -> dict[str, Any]:
    """Defaults of the Trainer's arguments (the first installed namespace's), read from its signature."""
    Trainer = classes("Trainer")[0]
    params = inspect.signature(Trainer).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def _same(value: Any, default: Any) -> bool:
    """``value == default`` for plain values only (plugin or callback objects are never "at the default")."""
    if default is None:
        return value is None
    return type(value) is type(default) and value == default


def preset_callbacks(preset: MemoryPreset) -> list[tuple[type, Any]]:
    """``(type, build)`` for each callback the preset implies, in order; nothing is built yet (``AllocatorSettings``
    sets the allocator's environment when it is made)."""
    out: list[tuple[type, Any]] = []
    if preset.monitor:
        out.append((MemoryMonitor, MemoryMonitor))
    if preset.cache_clean_on_phase_end:
        out.append(
            (
                CacheCleaner,
                lambda: CacheCleaner(every_n_train_steps=None, every_n_val_batches=None, on_phase_end=True),
            )
        )
    if preset.gc_every_n_train_steps:
        out.append((GarbageCollector, lambda: GarbageCollector(every_n_train_steps=preset.gc_every_n_train_steps)))
    if preset.gradient_checkpointing:
        modules = list(preset.checkpoint_modules) if preset.checkpoint_modules else None
        out.append((GradientCheckpointing, lambda: GradientCheckpointing(checkpoint_modules=modules)))
    if preset.auto_micro_batch:
        out.append((AutoMicroBatch, lambda: AutoMicroBatch(micro_batch_size=preset.micro_batch_size or "auto")))
    if preset.allocator_conf or preset.memory_fraction is not None:
        conf, fraction = preset.allocator_conf or None, preset.memory_fraction
        out.append((AllocatorSettings, lambda: AllocatorSettings(conf, fraction)))
    return out


def precision_string(preset: MemoryPreset) -> str:
    """A Lightning precision string for strategies with their own precision classes, resolved on this machine."""
    mode = str(preset.precision)  # normalized by the preset
    if preset.mixed_precision_policy:  # FSDP2's MixedPrecisionPolicy casts: no autocast on top of it
        return "32-true"
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        name = torch.cuda.get_device_name(index)
        return choose_precision(mode, "cuda", (major, minor), name, preset.allow_emulated_bf16).precision
    return choose_precision(mode, "cpu").precision


def _precision_kwargs(preset: MemoryPreset, given: Mapping[str, Any]) -> dict[str, Any]:
    """``precision`` (strategies with their own precision classes) or ``plugins`` with the preset's MemoryPrecision."""
    if has_own_precision(given.get("strategy")):
        if "precision" in given:
            return {}  # the user chose for it
        return {"precision": precision_string(preset)}
    plugins = given.get("plugins") or []
    plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
    if given.get("precision") is not None:
        raise ValueError(
            f"Both `precision={given['precision']!r}` and the preset's MemoryPrecision plugin were"
            f" given. Drop `precision=` from the Trainer arguments and set"
            f" `MemoryPreset(precision={given['precision']!r})` instead."
        )
    theirs = [p for p in plugins if is_instance(p, "plugins.precision.Precision")]
    if theirs:
        raise ValueError(
            f"Both `plugins=[{type(theirs[0]).__name__}(...)]` and the preset's MemoryPrecision plugin were"
            " given. Drop that precision plugin from `plugins` (set `MemoryPreset(precision=...)` instead)."
        )
    return {"plugins": [*plugins, preset.precision_plugin()]}


def _pinned_kwargs(preset: MemoryPreset, given: Mapping[str, Any]) -> dict[str, Any]:
    """``accumulate_grad_batches`` and ``gradient_clip_val``: the preset's, unless yours agrees (or the preset has no
    effective batch to keep, for the accumulation)."""
    out = {}
    for key, value in (
        ("accumulate_grad_batches", preset.accumulate_grad_batches),
        ("gradient_clip_val", preset.gradient_clip_val),
    ):
        yours = given.get(key)
        if yours is None:
            out[key] = value
        elif value is not None and yours != value and not (key == "accumulate_grad_batches" and preset.plan is None):
            if preset.auto_micro_batch:
                why = (
                    "with `auto_micro_batch=True` the DataLoader yields the whole per-device batch and"
                    " AutoMicroBatch splits it"
                )
            else:
                why = "the preset computes it from `effective_batch_size`"
            raise ValueError(
                f"`{key}={yours!r}` contradicts the preset's {key}={value!r}. Drop `{key}=` from the Trainer"
                f" arguments ({why}) or change the preset."
            )
    return out


def _world_kwargs(preset: MemoryPreset, given: Mapping[str, Any]) -> dict[str, Any]:
    """``devices`` and ``num_nodes`` of a preset with an effective batch; yours when it is the same number."""
    if preset.plan is None:
        return {}
    out = {}
    for key in ("devices", "num_nodes"):
        value = getattr(preset, key)
        yours = given.get(key)
        count = yours
        if key == "devices":
            count = device_count(given.get("accelerator", "auto"), yours)
        if yours is not None and count == value:
            continue  # the same number, written your way (e.g. devices=[0, 1] or "2")
        if yours is not None and yours != value:
            raise ValueError(
                f"`{key}={yours!r}` differs from the preset's `{key}={value}`, so the effective batch would"
                f" not be {preset.effective_batch_size}. Drop `{key}=` from the Trainer arguments or build the"
                f" preset with `{key}={yours!r}`."
            )
        out[key] = value
    return out


def _strategy_kwargs(preset: MemoryPreset, given: Mapping[str, Any]) -> dict[str, Any]:
    """``strategy`` of a preset that sets one: ``"ddp"``, or ``ModelParallelStrategy(data_parallel_size=devices x
    num_nodes, tensor_parallel_size=1)`` for ``"fsdp2"``; yours when it is the same kind (e.g. configured further)."""
    if preset.strategy is None:
        return {}
    yours = given.get("strategy")
    if yours is None or yours == "auto":
        if preset.strategy == "ddp":
            return {"strategy": "ddp"}
        found = classes("strategies.ModelParallelStrategy")
        if not found:
            raise ValueError(
                "`strategy`='fsdp2' runs on Lightning's ModelParallelStrategy, which came with Lightning 2.3: upgrade"
                " Lightning, or pass `strategy='ddp'`."
            )
        return {"strategy": found[0](data_parallel_size=preset.world_size, tensor_parallel_size=1)}
    if preset.strategy == "fsdp2":
        same = is_instance(yours, "strategies.ModelParallelStrategy")
    else:
        same = (isinstance(yours, str) and yours.startswith("ddp")) or is_instance(yours, "strategies.DDPStrategy")
    if not same:
        wanted = "a ModelParallelStrategy" if preset.strategy == "fsdp2" else "'ddp' (or a DDPStrategy)"
        raise ValueError(
            f"`strategy={yours!r}` contradicts the preset's strategy={preset.strategy!r}, which needs {wanted}. Drop"
            " `strategy=` from the Trainer arguments or build the preset with another `strategy`."
        )
    return {}


def _callbacks(preset: MemoryPreset, given: Mapping[str, Any]) -> list[Any]:
    """Yours first, then the preset's; one of yours of a type the preset adds replaces the preset's."""
    yours = given.get("callbacks") or []
    yours = list(yours) if isinstance(yours, (list, tuple)) else [yours]
    kinds = [kind for kind, _ in preset_callbacks(preset)]
    replaced = tuple(kind for kind in kinds if any(isinstance(c, kind) for c in yours))
    for kind in replaced:
        if kind.__name__ not in preset._said:
            preset._said.add(kind.__name__)
            rank_zero_info(f"MemoryPreset {preset.name!r}: your {kind.__name__} is used instead of the preset's.")
    return [*yours, *preset.callbacks(exclude=replaced)]


def build_trainer_kwargs(preset: MemoryPreset, trainer_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``preset.trainer_kwargs(**trainer_kwargs)``: see :meth:`MemoryPreset.trainer_kwargs`."""
    out: dict[str, Any] = dict(trainer_kwargs)
    strategy = _strategy_kwargs(preset, trainer_kwargs)
    out.update(strategy)
    precision = _precision_kwargs(preset, {**trainer_kwargs, **strategy})
    if "plugins" in precision:
        out.pop("precision", None)  # MemoryPrecision decides (a `precision=None` of yours said nothing)
    out.update(precision)
    out.update(_pinned_kwargs(preset, trainer_kwargs))
    out.update(_world_kwargs(preset, trainer_kwargs))
    out["callbacks"] = _callbacks(preset, trainer_kwargs)
    return out


def merge_trainer_config(preset: MemoryPreset, trainer_config: Mapping[str, Any]) -> dict[str, Any]:
    """``preset.merge_trainer_config(trainer_config)``: see :meth:`MemoryPreset.merge_trainer_config`."""
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
        for key in PRESET_TRAINER_KEYS
        if key in given and key in defaults and _same(given[key], defaults[key])
    }
    out = build_trainer_kwargs(preset, given)
    for key, value in at_default.items():
        out.setdefault(key, value)
    return out
