"""How a model is sharded: FSDP2 (``fully_shard``) units, DTensor parameters, local shard bytes and the whole.

Read from the module alone (no Trainer, no communication): safe on the one rank that runs out of memory.
:class:`~lightning_memopt.callbacks.OOMReporter` writes it as the report's ``sharding`` part and
:class:`~lightning_memopt.callbacks.MemoryAudit` prints it beside the footprint, whose bytes are this rank's shards.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from lightning_memopt.functional.footprint.storage import plain_tensor
from lightning_memopt.utilities import _torch_private
from lightning_memopt.utilities.formatting import format_bytes

__all__ = ["Sharding", "fsdp2_units", "fsdp_units", "model_sharding", "parameter_shards", "shard_rows"]

#: Mesh dimension names that mean data parallelism (Lightning's ``ModelParallelStrategy`` names it ``data_parallel``).
_DATA_PARALLEL_NAMES = ("data_parallel", "dp", "dp_shard")


@dataclass(frozen=True)
class Sharding:
    """How a model's parameters are sharded on this rank.

    Args:
        kind: ``"fsdp2"`` (``fully_shard`` units or DTensor parameters), ``"fsdp1"`` (``FullyShardedDataParallel``
            wrappers) or ``None`` (not sharded).
        data_parallel_size: Ranks the parameters are sharded over (the mesh's data-parallel dimension), ``None`` when
            unknown.
        mesh_shape: Shape of the parameters' device mesh (``[]`` without DTensors).
        num_parameters: Parameters of the module.
        num_dtensor_parameters: Of them, ``DTensor`` parameters (FSDP2 shards them so).
        num_units: ``fully_shard`` (or FSDP1) units in the module.
        unit_names: Their qualified names (``""`` is the module itself), outermost first.
        reshard_after_forward: Whether every unit below the outermost one frees its gathered parameters after
            forward (``False`` if one does not; ``None`` when not readable or when there is no inner unit).
        kept_unsharded: Units below the outermost one with ``reshard_after_forward=False``.
        cpu_offload: Whether a unit offloads its parameters to the CPU (``CPUOffloadPolicy``), ``None`` if unknown.
        param_dtype: The ``MixedPrecisionPolicy.param_dtype`` of the units (``None``: unset or unknown).
        local_parameter_bytes: Bytes of this rank's parameter shards (what the footprint counts).
        unsharded_parameter_bytes: Bytes of the whole parameters, as one rank would hold them unsharded.

    Examples:
        >>> facts = model_sharding(torch.nn.Linear(4, 2))
        >>> facts.sharded, facts.local_parameter_bytes, facts.unsharded_parameter_bytes
        (False, 40, 40)
    """

    kind: str | None
    data_parallel_size: int | None
    mesh_shape: list[int]
    num_parameters: int
    num_dtensor_parameters: int
    num_units: int
    unit_names: list[str]
    reshard_after_forward: bool | None
    kept_unsharded: list[str] = field(default_factory=list)
    cpu_offload: bool | None = None
    param_dtype: str | None = None
    local_parameter_bytes: int = 0
    unsharded_parameter_bytes: int = 0

    @property
    def sharded(self) -> bool:
        """Whether the parameters are sharded over more than one rank (or by FSDP units)."""
        return self.kind is not None

    def as_dict(self) -> dict[str, Any]:
        """The report's ``sharding`` part (``ShardingSection``)."""
        return {"sharded": self.sharded, **asdict(self)}

    def text(self) -> str:
        """One line for printouts: how it is sharded and the local bytes beside the whole.

        Examples:
            >>> model_sharding(torch.nn.Linear(4, 2)).text()
            'not sharded: parameters 40 B on this rank'
        """
        local, whole = format_bytes(self.local_parameter_bytes), format_bytes(self.unsharded_parameter_bytes)
        if not self.sharded:
            return f"not sharded: parameters {local} on this rank"
        ranks = "?" if self.data_parallel_size is None else str(self.data_parallel_size)
        return (
            f"sharded ({self.kind}, {self.num_units} units, over {ranks} ranks): parameters {local} on this rank"
            f" ({self.local_parameter_bytes} bytes) of {whole} unsharded ({self.unsharded_parameter_bytes} bytes);"
            " gradients and optimizer states are shards too"
        )


def _dtensor_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def _unit_types() -> dict[type, str]:
    """The FSDP module classes of this torch build and their kind."""
    if not torch.distributed.is_available():
        return {}
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return {FSDPModule: "fsdp2", FullyShardedDataParallel: "fsdp1"}


def fsdp_units(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, str]]:
    """``(name, unit, kind)`` of every FSDP unit in ``module``, outermost first (as ``named_modules`` walks); ``kind``
    is ``"fsdp2"`` (``fully_shard``) or ``"fsdp1"`` (``FullyShardedDataParallel``).

    Examples:
        >>> list(fsdp_units(torch.nn.Linear(2, 2)))
        []
    """
    types = _unit_types()
    for name, child in module.named_modules():
        kind = next((kind for cls, kind in types.items() if isinstance(child, cls)), None)
        if kind is not None:
            yield name, child, kind


def fsdp2_units(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modules ``fully_shard`` was applied to in ``module``, by name, outermost first.

    Examples:
        >>> fsdp2_units(torch.nn.Linear(2, 2))
        {}
    """
    return {name: unit for name, unit, kind in fsdp_units(module) if kind == "fsdp2"}


def _is_inner(name: str, names: list[str]) -> bool:
    """Whether unit ``name`` lies inside another of ``names``."""
    return any(other != name and (other == "" or name.startswith(other + ".")) for other in names)


def _data_parallel_size(mesh: Any) -> int | None:
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    for wanted in _DATA_PARALLEL_NAMES:
        if wanted in names:
            return int(mesh.size(names.index(wanted)))
    if mesh.ndim == 1:
        return int(mesh.size())
    return None


def _policies(units: list[tuple[str, torch.nn.Module, str]]) -> tuple[bool | None, list[str], bool | None, str | None]:
    """``reshard_after_forward``, the inner units kept unsharded, CPU offload and the param dtype of FSDP2 units."""
    names = [name for name, _, _ in units]
    read = {name: _torch_private.fsdp2_unit_policy(unit) for name, unit, kind in units if kind == "fsdp2"}
    known = {name: policy for name, policy in read.items() if policy is not None}
    if not known:
        return None, [], None, None
    # FSDP2 keeps the outermost unit gathered after forward once training started (its parameters are needed first
    # in backward): only the inner units' setting is the user's to choose.
    inner = {name: policy for name, policy in known.items() if _is_inner(name, names)}
    kept = [name for name, policy in inner.items() if not policy["reshard_after_forward"]]
    dtypes = [policy["param_dtype"] for policy in known.values() if policy["param_dtype"] is not None]
    offload = any(policy["cpu_offload"] for policy in known.values())
    return (not kept) if inner else None, kept, offload, dtypes[0] if dtypes else None


def parameter_shards(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(qualified name, sharded parameter)`` of every parameter an FSDP2 unit in ``module`` manages.

    While a unit has gathered its parameters (inside its forward and backward, or after a no-grad forward of a unit
    with ``reshard_after_forward=False``), ``module.named_parameters()`` gives the whole tensors; the shards, which
    the optimizer updates, are these. Empty for a module without FSDP2 units.
    """
    found = _torch_private.fsdp2_sharded_parameters(module)
    if not found:
        return []
    prefixes = {id(sub): name for name, sub in module.named_modules(remove_duplicate=False)}
    shards = []
    for owner, name, shard in found:
        prefix = prefixes.get(id(owner))
        if prefix is not None:
            shards.append((f"{prefix}.{name}" if prefix else name, shard))
    return shards


def shard_rows(param: torch.Tensor) -> tuple[tuple[int, ...], slice] | None:
    """``(whole shape, rows)`` of a ``DTensor`` sharded on its first dimension over a 1-D mesh (FSDP2's default):
    the rows of the whole parameter that this rank's shard holds (``torch.chunk``'s split). ``None`` for any other
    tensor or placement. Read from the DTensor's metadata: nothing is gathered.

    Examples:
        >>> shard_rows(torch.zeros(3)) is None
        True
    """
    dtensor = _dtensor_type()
    if dtensor is None or not isinstance(param, dtensor):
        return None
    mesh = getattr(param, "device_mesh", None)
    placements: tuple[Any, ...] = tuple(getattr(param, "placements", ()))
    if mesh is None or mesh.ndim != 1 or len(placements) != 1 or not placements[0].is_shard(dim=0):
        return None
    whole = tuple(int(s) for s in param.shape)
    if not whole:
        return None
    chunk = -(-whole[0] // int(mesh.size()))  # ceil: the first ranks take the larger chunks
    start = min(int(mesh.get_local_rank()) * chunk, whole[0])
    return whole, slice(start, min(start + chunk, whole[0]))


def _sharded_view(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Each parameter of ``module`` once, as its shard where an FSDP2 unit keeps one."""
    shards = dict(parameter_shards(module))
    seen: set[int] = set()
    for name, param in module.named_parameters(remove_duplicate=False):
        tensor = shards.get(name, param)
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield tensor


def model_sharding(module: torch.nn.Module) -> Sharding:
    """How ``module``'s parameters are sharded on this rank (see :class:`Sharding`); reads only, never communicates.

    Each parameter is counted once (tied weights too): its local shard's bytes (``DTensor.to_local()``), and its
    whole bytes (``numel() * element_size()``, the global shape for a ``DTensor``). A unit that has gathered its
    parameters at the moment of reading still counts its shards (:func:`parameter_shards`).
    """
    dtensor = _dtensor_type()
    num = num_dtensors = local = whole = 0
    mesh = None
    for param in _sharded_view(module):
        num += 1
        plain = plain_tensor(param)
        local += int(plain.numel()) * plain.element_size()
        whole += int(param.numel()) * param.element_size()
        if dtensor is not None and isinstance(param, dtensor):
            num_dtensors += 1
            mesh = getattr(param, "device_mesh", None) if mesh is None else mesh
    units = list(fsdp_units(module))
    kinds = {kind for _, _, kind in units}
    kind: str | None = None
    if "fsdp1" in kinds:
        kind = "fsdp1"
    elif kinds or num_dtensors:
        kind = "fsdp2"
    reshard, kept, offload, param_dtype = _policies(units)
    data_parallel_size = None
    mesh_shape: list[int] = []
    if mesh is not None:
        data_parallel_size = _data_parallel_size(mesh)
        mesh_shape = [int(s) for s in mesh.shape]
    return Sharding(
        kind=kind,
        data_parallel_size=data_parallel_size,
        mesh_shape=mesh_shape,
        num_parameters=num,
        num_dtensor_parameters=num_dtensors,
        num_units=len(units),
        unit_names=[name for name, _, _ in units],
        reshard_after_forward=reshard,
        kept_unsharded=kept,
        cpu_offload=offload,
        param_dtype=param_dtype,
        local_parameter_bytes=local,
        unsharded_parameter_bytes=whole,
    )
