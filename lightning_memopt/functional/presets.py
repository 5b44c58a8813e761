"""Pure preset arithmetic: the preset table, GPU-size tiers, the checkpointed blocks and the accumulation split.

Nothing here touches a device or a Trainer: every decision takes plain values (total memory, batch sizes) so that it
can be tested on a machine without a GPU. The precision decision lives in :mod:`lightning_memopt.functional.precision`.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_memopt.functional.divisors import INT64_MAX, divisors
from lightning_memopt.utilities.checks import check_positive_int, check_positive_number
from lightning_memopt.utilities.formatting import WIDTH

__all__ = [
    "PRESETS",
    "PRESET_NAMES",
    "TIERS",
    "AccumulationPlan",
    "configure_model_recipe",
    "normalize_checkpoint_modules",
    "plan_accumulation",
    "plan_auto_micro_batch",
    "tier_for_memory",
]

#: The knobs of each named preset. ``target_accumulation`` is used only when ``micro_batch_size`` is not given.
PRESETS: dict[str, dict[str, Any]] = {
    "max-savings": {
        "precision": "auto",
        "gradient_checkpointing": True,
        "float32_matmul_precision": "high",
        "allocator_conf": "expandable_segments:True",
        "target_accumulation": 4,
        "cache_clean_on_phase_end": True,
        "gc_every_n_train_steps": 50,
        "monitor": True,
    },
    "balanced": {
        "precision": "auto",
        "gradient_checkpointing": False,
        "float32_matmul_precision": "high",
        "allocator_conf": "expandable_segments:True",
        "target_accumulation": 2,
        "cache_clean_on_phase_end": True,
        "gc_every_n_train_steps": 0,
        "monitor": True,
    },
    "max-speed": {
        "precision": "auto",
        "gradient_checkpointing": False,
        "float32_matmul_precision": "high",
        "allocator_conf": "",
        "target_accumulation": 1,
        "cache_clean_on_phase_end": False,
        "gc_every_n_train_steps": 0,
        "monitor": False,
    },
}
PRESET_NAMES = tuple(PRESETS)

#: GPU-size tiers: (upper bound in GiB, tier label, preset name). The last bound is open.
TIERS: tuple[tuple[float, str, str], ...] = (
    (12.0, "8GB", "max-savings"),
    (20.0, "16GB", "balanced"),
    (float("inf"), "24GB+", "max-speed"),
)


def tier_for_memory(total_memory_gib: float) -> tuple[str, str]:
    """The ``(tier label, preset name)`` for a device with ``total_memory_gib`` GiB.

    Cards up to 12 GiB get ``max-savings`` (the "8 GB" tier), up to 20 GiB ``balanced`` ("16 GB"), larger ones
    ``max-speed`` ("24 GB+").

    Examples:
        >>> tier_for_memory(7.8), tier_for_memory(15.9), tier_for_memory(79.1)
        (('8GB', 'max-savings'), ('16GB', 'balanced'), ('24GB+', 'max-speed'))
    """
    check_positive_number(
        "total_memory_gib", total_memory_gib, hint="Pass the GPU's total memory in GiB, e.g. 24 or 79.1."
    )
    for bound, label, name in TIERS:
        if total_memory_gib <= bound:
            return label, name
    raise AssertionError("unreachable")  # pragma: no cover


def normalize_checkpoint_modules(value: Any) -> tuple[type[nn.Module] | str, ...] | None:
    """``checkpoint_modules`` as a tuple: one entry or a list/tuple of module classes, class names or name patterns.

    Examples:
        >>> normalize_checkpoint_modules("T5Block"), normalize_checkpoint_modules([nn.Linear, "encoder.*"])
        (('T5Block',), (<class 'torch.nn.modules.linear.Linear'>, 'encoder.*'))
        >>> normalize_checkpoint_modules([])
        Traceback (most recent call last):
        ...
        ValueError: `checkpoint_modules` must be a non-empty list of module classes, class names or name patterns, ...
    """
    if value is None:
        return None
    entries = (value,) if isinstance(value, (str, type)) else value
    if not isinstance(entries, Sequence) or isinstance(entries, str) or not entries:
        raise ValueError(
            f"`checkpoint_modules` must be a non-empty list of module classes, class names or name patterns, or None,"
            f" got {value!r} ({type(value).__name__}). Example: ['TransformerEncoderLayer', 'encoder.layers.*'];"
            " None checkpoints the default blocks."
        )
    for entry in entries:
        if not (isinstance(entry, str) and entry) and not (isinstance(entry, type) and issubclass(entry, nn.Module)):
            raise ValueError(
                f"`checkpoint_modules` entries must be non-empty class names, name patterns or nn.Module classes, got"
                f" {entry!r} in {value!r}. Example: ['TransformerEncoderLayer', 'encoder.layers.*']."
            )
    return tuple(entries)


@dataclass(frozen=True)
class AccumulationPlan:
    """How an effective batch is split: ``micro_batch_size x accumulate_grad_batches x world_size``."""

    effective_batch_size: int
    micro_batch_size: int
    accumulate_grad_batches: int
    world_size: int


def plan_accumulation(
    effective_batch_size: int,
    micro_batch_size: int | None = None,
    devices: int = 1,
    num_nodes: int = 1,
    target_accumulation: int = 1,
) -> AccumulationPlan:
    """Split ``effective_batch_size`` into micro-batches per rank and gradient-accumulation steps.

    ``accumulate_grad_batches = effective / (micro x devices x num_nodes)``. The effective batch is never changed
    silently: when the division is not exact a ``ValueError`` names the nearest effective batches and the micro-batch
    sizes that do divide. When ``micro_batch_size`` is ``None`` the smallest number of accumulation steps
    ``>= target_accumulation`` that divides the per-rank batch is used (micro-batch 1 at worst).

    Examples:
        >>> plan_accumulation(128, 16)
        AccumulationPlan(effective_batch_size=128, micro_batch_size=16, accumulate_grad_batches=8, world_size=1)
        >>> plan_accumulation(128, 8, devices=4, num_nodes=2).accumulate_grad_batches
        2
        >>> plan_accumulation(96, target_accumulation=5).micro_batch_size  # 6 steps of 16
        16
    """
    check_positive_int("effective_batch_size", effective_batch_size)
    if effective_batch_size > INT64_MAX:
        raise ValueError(
            f"`effective_batch_size` must be at most 2**63 - 1 (the largest int64), got {effective_batch_size!r}."
            " Give the number of samples per optimizer step."
        )
    check_positive_int("micro_batch_size", micro_batch_size, allow_none=True)
    check_positive_int("devices", devices, hint="Pass the number of devices per node, as given to the Trainer.")
    check_positive_int("num_nodes", num_nodes)
    check_positive_int("target_accumulation", target_accumulation)
    world = devices * num_nodes
    micro = micro_batch_size or 1
    if effective_batch_size < micro * world:
        raise ValueError(
            f"`effective_batch_size` must be at least `micro_batch_size` x `devices` x `num_nodes` ="
            f" {micro} x {devices} x {num_nodes} = {micro * world}, got {effective_batch_size}."
            f" Raise `effective_batch_size` to a multiple of {micro * world} or lower `micro_batch_size`."
        )
    if effective_batch_size % world:
        lower, upper = (effective_batch_size // world) * world, (effective_batch_size // world + 1) * world
        raise ValueError(
            f"`effective_batch_size`={effective_batch_size} is not divisible by the world size"
            f" {world} (`devices`={devices} x `num_nodes`={num_nodes}). Use {lower} or {upper}."
        )
    per_rank = effective_batch_size // world
    if micro_batch_size is None:
        options = divisors(per_rank)
        accumulation = options[bisect.bisect_left(options, min(target_accumulation, per_rank))]
        return AccumulationPlan(effective_batch_size, per_rank // accumulation, accumulation, world)
    if per_rank % micro_batch_size:
        step = micro_batch_size * world
        lower = (effective_batch_size // step) * step
        micros = [d for d in divisors(per_rank) if d <= micro_batch_size][-3:]
        raise ValueError(
            f"`effective_batch_size`={effective_batch_size} is not divisible by `micro_batch_size` x world size ="
            f" {micro_batch_size} x {world} = {step}. Use `effective_batch_size`={lower} or {lower + step}, or"
            f" `micro_batch_size` in {micros} (the effective batch is never rounded silently)."
        )
    return AccumulationPlan(effective_batch_size, micro_batch_size, per_rank // micro_batch_size, world)


def plan_auto_micro_batch(
    effective_batch_size: int,
    micro_batch_size: int | None = None,
    devices: int = 1,
    num_nodes: int = 1,
) -> AccumulationPlan:
    """The split for ``AutoMicroBatch``: the DataLoader yields the whole per-rank batch, no Lightning accumulation.

    The plan's ``micro_batch_size`` is what the DataLoader yields per rank (``effective / (devices x num_nodes)``)
    and ``accumulate_grad_batches`` is 1: ``AutoMicroBatch`` splits each batch into micro-batches itself.
    ``micro_batch_size``, where ``AutoMicroBatch`` starts, is checked as in :func:`plan_accumulation` (it must divide
    the per-rank batch), with the same messages; the effective batch is never changed.

    Examples:
        >>> plan_auto_micro_batch(128, devices=4)
        AccumulationPlan(effective_batch_size=128, micro_batch_size=32, accumulate_grad_batches=1, world_size=4)
        >>> plan_auto_micro_batch(128, 16, devices=4).micro_batch_size  # AutoMicroBatch starts at 16 of the 32
        32
    """
    start = plan_accumulation(effective_batch_size, micro_batch_size, devices, num_nodes)
    return AccumulationPlan(effective_batch_size, effective_batch_size // start.world_size, 1, start.world_size)


def _names_literal(names: Sequence[str], indent: str) -> str:
    """A Python list of ``names``; runs ``prefix.i, prefix.i+1, ...`` written as one ``range`` (a model's 24 layers
    are one line)."""
    items: list[str] = []
    run: list[tuple[str, int]] = []

    def flush() -> None:
        if len(run) > 2:
            (prefix, first), last = run[0], run[-1][1]
            items.append(f'*(f"{prefix}.{{i}}" for i in range({first}, {last + 1}))')
        else:
            items.extend(repr(f"{prefix}.{i}") for prefix, i in run)
        run.clear()

    for name in names:
        match = re.fullmatch(r"(.+)\.(\d+)", name)
        if match and run and run[-1] == (match[1], int(match[2]) - 1):
            run.append((match[1], int(match[2])))
            continue
        flush()
        if match:
            run.append((match[1], int(match[2])))
        else:
            items.append(repr(name))
    flush()
    one_line = f"[{', '.join(items)}]"
    if len(one_line) + len(indent) <= WIDTH:
        return one_line
    inner = indent + "    "
    return "[\n" + "".join(f"{inner}{item},\n" for item in items) + f"{indent}]"


def configure_model_recipe(
    world_size: int,
    blocks: Sequence[str] | None,
    roots: Sequence[str] | None,
    reshard_after_forward: bool,
    cpu_offload: bool,
    mp_policy: str | None = None,
) -> str:
    """The ``configure_model`` to paste into a LightningModule trained with
    ``ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)``: ``fully_shard`` on each of
    ``blocks`` (qualified names), then on each of ``roots`` (``""``: the module itself), over Lightning's
    ``"data_parallel"`` mesh, as the planner estimated it. ``blocks`` ``None``: the module's own ``configure_model``
    shards it (the plan estimated that one): the recipe says to keep it. ``mp_policy``: FSDP2's own mixed precision
    (:func:`~lightning_memopt.functional.precision.fsdp2_policy`'s code), given to every ``fully_shard``; the Trainer
    then runs at ``precision="32-true"``.

    Examples:
        >>> print(configure_model_recipe(2, ["blocks.0", "blocks.1", "blocks.2", "head"], [""], True, False))
        # in your LightningModule, trained with
        # Trainer(strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)):
        def configure_model(self):
            from torch.distributed.fsdp import fully_shard
        <BLANKLINE>
            model = self  # the module that was planned: e.g. `self.model` if the plan was made on it
            options = {"mesh": self.device_mesh["data_parallel"], "reshard_after_forward": True}
            for name in [*(f"blocks.{i}" for i in range(0, 3)), 'head']:  # the blocks first
                fully_shard(model.get_submodule(name), **options)
            for name in ['']:  # then the roots ("": the module itself)
                fully_shard(model.get_submodule(name), **options)
    """
    trainer_precision = 'precision="32-true", ' if mp_policy else ""
    head = (
        "# in your LightningModule, trained with\n"
        f"# Trainer({trainer_precision}strategy=ModelParallelStrategy(data_parallel_size={world_size},"
        " tensor_parallel_size=1)):"
    )
    if blocks is None or roots is None:
        return (
            f"{head}\n# keep your own configure_model: the plan estimated the sharding it applies"
            f" (with reshard_after_forward={reshard_after_forward}{', CPU offload' if cpu_offload else ''})."
        )
    offload = ", CPUOffloadPolicy" if cpu_offload else ""
    policy = ', "offload_policy": CPUOffloadPolicy()' if cpu_offload else ""
    if mp_policy:
        offload += ", MixedPrecisionPolicy"
    lines = [
        head,
        "def configure_model(self):",
        *(["    import torch"] if mp_policy else []),
        f"    from torch.distributed.fsdp import fully_shard{offload}",
        "",
        "    model = self  # the module that was planned: e.g. `self.model` if the plan was made on it",
        f'    options = {{"mesh": self.device_mesh["data_parallel"], "reshard_after_forward": {reshard_after_forward}'
        f"{policy}}}",
        *([f'    options["mp_policy"] = {mp_policy}'] if mp_policy else []),
    ]
    if blocks:
        lines += [
            f"    for name in {_names_literal(blocks, '    ')}:  # the blocks first",
            "        fully_shard(model.get_submodule(name), **options)",
        ]
    lines += [
        f'    for name in {_names_literal(roots, "    ")}:  # then the roots ("": the module itself)',
        "        fully_shard(model.get_submodule(name), **options)",
    ]
    return "\n".join(lines)
