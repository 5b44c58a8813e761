"""FSDP2 on a fake twin in one process: a fake process group of N ranks, Lightning's device mesh, the default
per-block sharding, and what the live-storage counter needs to know about FSDP2's buffers.

The estimate of one rank of an N-rank ``fully_shard`` run needs no cluster: torch's ``"fake"`` process-group backend
(:func:`fake_process_group`) answers every collective without communicating, so one process builds an N-way device
mesh, shards the fake twin with the shapes of rank 0 and runs the training steps; the counter sees every local shard
(a ``DTensor`` counts as its local tensor) and every storage FSDP2 frees and re-creates by resizing it. On the CPU the
count equals the per-rank peak of a real N-process gloo run (``tests/scripts/fsdp2_peak.py``), as torch's
``FSDPMemTracker`` does; what differs from it is the rest of the estimate (Lightning's step, the CUDA model, the
breakdown).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_memopt.functional.checkpointing import module_matches
from lightning_memopt.functional.footprint.sharding import fsdp2_units

__all__ = [
    "OFFLOADED_LABELS",
    "PlannedSharding",
    "collective_labels",
    "child_roots",
    "default_shard_blocks",
    "describe_sharding",
    "fake_process_group",
    "is_sharded",
    "set_reshard_after_forward",
    "shard_model",
]

#: What lives on the host under CPU offload (``CPUOffloadPolicy``): the sharded parameters, their gradients, the
#: optimizer states and the optimizer step, which runs on the CPU.
OFFLOADED_LABELS = ("parameters", "gradients", "optimizer_states", "optimizer step")

#: Lightning's ``ModelParallelStrategy`` names the dimensions of its device mesh so.
MESH_DIM_NAMES = ("data_parallel", "tensor_parallel")


def _fsdp() -> Any:
    """torch's FSDP2 package (imported when a sharded estimate runs: most estimates never need it)."""
    import torch.distributed.fsdp as fsdp

    return fsdp


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[Any]:
    """A fake process group of ``world_size`` ranks (this process is rank 0) and Lightning's device mesh over it.

    Yields the mesh of ``ModelParallelStrategy(data_parallel_size=world_size, tensor_parallel_size=1)``: dimensions
    ``"data_parallel"`` (``world_size``) and ``"tensor_parallel"`` (1), on the CPU. Collectives do not communicate
    (torch's ``"fake"`` backend); the group is destroyed on the way out.

    Raises:
        ValueError: a process group is initialised already (a real run, or another estimate): the fake one would
            replace it.

    Examples:
        >>> with fake_process_group(4) as mesh:
        ...     mesh["data_parallel"].size(), dist.get_world_size()
        (4, 4)
        >>> dist.is_initialized()
        False
    """
    if not dist.is_available():
        raise ValueError(f"`world_size`={world_size} needs torch.distributed, which this torch build does not have.")
    if dist.is_initialized():
        raise ValueError(
            f"`world_size`={world_size}: a process group is initialised already (backend"
            f" {dist.get_backend()!r}, world size {dist.get_world_size()}). A sharded estimate runs in a fake process"
            " group of its own: call `estimate_memory` before `init_process_group` (or outside the training run),"
            " or after `destroy_process_group()`."
        )
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("fake", rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size, 1), mesh_dim_names=MESH_DIM_NAMES)
    finally:
        dist.destroy_process_group()


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def default_shard_blocks(model: nn.Module, shard_modules: Sequence[type[nn.Module] | str] | None = None) -> list[str]:
    """The qualified names of the blocks to ``fully_shard`` before the root, outermost first.

    With ``shard_modules`` (module classes, class names or ``fnmatch`` patterns over qualified names, as
    ``checkpoint_modules``), the matching submodules; without, the repeated blocks: the children holding parameters
    of every ``nn.ModuleList`` and ``nn.Sequential`` (the root's own, when it is one). A block inside a chosen block is
    not chosen again.

    Examples:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
        >>> default_shard_blocks(model)
        ['0', '2']
        >>> default_shard_blocks(model, ["2.*"])
        ['2.0', '2.1']
    """
    chosen: list[str] = []
    containers = (nn.ModuleList, nn.Sequential)
    for name, module in model.named_modules():
        if not name or any(name.startswith(f"{outer}.") for outer in chosen):
            continue
        if shard_modules is not None:
            picked = module_matches(name, module, shard_modules)
        else:
            parent = model.get_submodule(name.rpartition(".")[0])
            picked = isinstance(parent, containers)
        if picked and _holds_parameters(module):
            chosen.append(name)
    return chosen


def shard_model(
    model: nn.Module,
    mesh: Any,
    blocks: Sequence[str],
    *,
    reshard_after_forward: bool,
    cpu_offload: bool,
    roots: Sequence[str] = ("",),
    param_dtype: torch.dtype | None = None,
) -> None:
    """``fully_shard`` each of ``blocks``, then each of ``roots`` (qualified names; ``""``: ``model``), over
    ``mesh``'s ``"data_parallel"`` dimension, as a ``configure_model`` for Lightning's ``ModelParallelStrategy``
    does; with ``param_dtype``, FSDP2's own mixed precision: ``MixedPrecisionPolicy(param_dtype=param_dtype,
    reduce_dtype=torch.float32)``."""
    fsdp = _fsdp()
    options: dict[str, Any] = {"mesh": mesh["data_parallel"], "reshard_after_forward": reshard_after_forward}
    if cpu_offload:
        options["offload_policy"] = fsdp.CPUOffloadPolicy(pin_memory=False)
    if param_dtype is not None:
        options["mp_policy"] = fsdp.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for name in [*blocks, *roots]:
        fsdp.fully_shard(model.get_submodule(name), **options)


def child_roots(model: nn.Module, blocks: Sequence[str]) -> list[str]:
    """The roots of a LightningModule's default sharding: its children holding parameters that are not blocks.

    FSDP2 gathers a root's own parameters only when the root itself is called; a ``training_step`` calls its
    submodules (``self.model(**batch)``) more often than ``self(...)``, so each child is a root of its own.

    Examples:
        >>> child_roots(nn.ModuleDict({"encoder": nn.Linear(2, 2), "act": nn.ReLU(), "head": nn.Linear(2, 2)}), [])
        ['encoder', 'head']
    """
    return [name for name, child in model.named_children() if name not in blocks and _holds_parameters(child)]


def set_reshard_after_forward(model: nn.Module, reshard_after_forward: bool) -> None:
    """Change ``reshard_after_forward`` on every FSDP2 unit of ``model`` (sharded by its own ``configure_model``)."""
    for module in fsdp2_units(model).values():
        module.set_reshard_after_forward(reshard_after_forward, recurse=False)  # type: ignore[operator]  # an FSDPModule


@dataclass(frozen=True)
class PlannedSharding:
    """How the planner sharded the model it estimated: FSDP2 units over ``world_size`` ranks (what a rank of a real
    run observes is :class:`~lightning_memopt.functional.footprint.sharding.Sharding`).

    Attributes:
        world_size: ranks the parameters are sharded over.
        units: the qualified names of the ``fully_shard`` units, inner ones first (``""``: the root, last).
        source: ``"configure_model"`` (the LightningModule sharded itself), ``"default"`` (per block, then the
            root) or ``"default children"`` (a LightningModule: per block, then each child as a root).
        reshard_after_forward: the value applied (``None``: as ``configure_model`` set it).
        cpu_offload: parameters, gradients and optimizer states counted on the host.
        unsharded_parameter_bytes: the parameters' bytes before sharding (the whole model).
        param_dtype: the ``MixedPrecisionPolicy.param_dtype`` the default sharding applied (``None``: none).
    """

    world_size: int
    units: tuple[str, ...]
    source: str
    reshard_after_forward: bool | None
    cpu_offload: bool
    unsharded_parameter_bytes: int
    param_dtype: torch.dtype | None = None

    def __str__(self) -> str:
        names = [n or "root" for n in self.units]
        shown = ", ".join(names if len(names) <= 6 else [*names[:5], "...", names[-1]])
        how = {
            "configure_model": "by configure_model",
            "default": "per block, then the root",
            "default children": "per block, then each child of the LightningModule",
        }.get(self.source, self.source)
        reshard = "as configure_model set it" if self.reshard_after_forward is None else self.reshard_after_forward
        offload = ", CPU offload of parameters, gradients and optimizer states" if self.cpu_offload else ""
        policy = f", MixedPrecisionPolicy(param_dtype={self.param_dtype}, reduce_dtype=torch.float32)"
        return (
            f"FSDP2 over {self.world_size} ranks, {len(names)} units {how} ({shown}),"
            f" reshard_after_forward={reshard}{offload}{policy if self.param_dtype is not None else ''}"
        )


def _inner_units_first(name: str) -> int:
    """A sort key putting units nested deeper (more dotted parts in the name) first and the root (``""``) last."""
    if name:
        return -len(name.split("."))
    return 0


def describe_sharding(
    model: nn.Module,
    world_size: int,
    source: str,
    reshard_after_forward: bool | None,
    cpu_offload: bool,
    param_dtype: torch.dtype | None = None,
) -> PlannedSharding:
    """What :class:`PlannedSharding` says of a sharded ``model``; the unsharded bytes come from the parameters'
    global shapes (a ``DTensor``'s ``numel`` is the global one; ``parameters()`` gives a tied one once)."""
    params = list(model.parameters())
    return PlannedSharding(
        world_size=world_size,
        # inner units before the units around them, the order fully_shard is applied in
        units=tuple(sorted(fsdp2_units(model), key=_inner_units_first)),
        source=source,
        reshard_after_forward=reshard_after_forward,
        cpu_offload=cpu_offload,
        unsharded_parameter_bytes=sum(p.numel() * p.element_size() for p in params),
        param_dtype=param_dtype,
    )


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds an FSDP2 unit (its ``configure_model`` called ``fully_shard``)."""
    return bool(fsdp2_units(model))


def collective_labels(func: Any, args: tuple, kwargs: dict) -> Iterable[tuple[Tensor, str]]:
    """What FSDP2's operators' arguments are (see :class:`~.counter.LiveBytes`' ``labels``): the flat all-gather
    output and reduce-scatter input are ``"communication"`` buffers; the tensors the all-gather output is copied out
    into are the ``"unsharded_parameters"`` (FSDP2 keeps their storages, resized to 0 between uses)."""
    name = getattr(func, "__name__", "")
    namespace = getattr(func, "namespace", "")
    if namespace == "c10d" and name.startswith("_allgather_base_"):
        return [(args[0], "communication")]
    if namespace == "c10d" and name.startswith("_reduce_scatter_base_"):
        return [(args[1], "communication")]
    if namespace == "fsdp" and name.startswith("split_with_sizes_copy"):
        return [(t, "unsharded_parameters") for t in kwargs.get("out", ())]
    return ()
