"""What a model and its optimizers hold: parameters, buffers, gradients and optimizer states, by dtype and device."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lightning_memopt.functional.footprint.sharding import parameter_shards
from lightning_memopt.functional.footprint.storage import (
    StorageKey,
    device_matches,
    plain_tensor,
    storage_bytes,
    storage_key,
)
from lightning_memopt.utilities.formatting import format_bytes

__all__ = ["CATEGORIES", "Footprint", "FootprintRow", "model_footprint", "tensor_names", "unexplained_bytes"]

#: The categories of a :class:`Footprint`, in the order they are accounted (a storage goes to the first).
CATEGORIES: tuple[str, ...] = ("parameters", "buffers", "gradients", "optimizer_states")


@dataclass(frozen=True)
class FootprintRow:
    """Bytes of one ``(category, dtype, device)`` group of tensors.

    Args:
        category: ``"parameters"``, ``"gradients"``, ``"optimizer_states"`` or ``"buffers"``.
        dtype: The dtype, e.g. ``"torch.float32"``.
        device: The device, e.g. ``"cuda:0"`` or ``"cpu"``.
        num_tensors: How many tensors of the group were seen (a tied weight counts once).
        bytes: Storage bytes; storages shared between tensors (also across categories) counted once.
    """

    category: str
    dtype: str
    device: str
    num_tensors: int
    bytes: int


@dataclass(frozen=True)
class Footprint:
    """What a model and its optimizers hold, as rows of :class:`FootprintRow`.

    Examples:
        >>> fp = model_footprint(torch.nn.Linear(4, 2))
        >>> fp.bytes_by_category()
        {'parameters': 40, 'buffers': 0, 'gradients': 0, 'optimizer_states': 0}
        >>> fp.total_bytes("cpu"), fp.total_bytes("cuda")
        (40, 0)
    """

    rows: tuple[FootprintRow, ...]

    def bytes_by_category(self, device: str | torch.device | None = None) -> dict[str, int]:
        """Bytes per category (every category present, zero if empty), optionally on one device.

        ``device`` may be ``"cuda:0"`` (exact) or a type (``"cuda"``: every CUDA device).
        """
        out = dict.fromkeys(CATEGORIES, 0)
        for row in self.rows:
            if device_matches(row.device, device):
                out[row.category] = out.get(row.category, 0) + row.bytes
        return out

    def total_bytes(self, device: str | torch.device | None = None) -> int:
        """Bytes of every category together, optionally on one device."""
        return sum(self.bytes_by_category(device).values())

    def devices(self) -> list[str]:
        """The devices that hold any of the accounted tensors, sorted."""
        return sorted({row.device for row in self.rows})

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict: ``rows``, ``bytes_by_category`` and ``total_bytes``."""
        return {
            "rows": [asdict(row) for row in self.rows],
            "bytes_by_category": self.bytes_by_category(),
            "total_bytes": self.total_bytes(),
        }

    def table(self) -> str:
        """The rows as an aligned text table with a total line (for printing)."""
        header = ("category", "dtype", "device", "tensors", "bytes", "size")
        lines = [header] + [
            (
                r.category,
                r.dtype.replace("torch.", ""),
                r.device,
                str(r.num_tensors),
                str(r.bytes),
                format_bytes(r.bytes),
            )
            for r in self.rows
        ]
        total = self.total_bytes()
        lines.append(("total", "", "", str(sum(r.num_tensors for r in self.rows)), str(total), format_bytes(total)))
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        return "\n".join(
            "  ".join(_align_cell(i, cell, w) for i, (cell, w) in enumerate(zip(line, widths))) for line in lines
        )


def _align_cell(column: int, cell: str, width: int) -> str:
    """``cell`` padded to ``width``: the three text columns left-aligned, the numbers right-aligned."""
    if column < 3:
        return cell.ljust(width)
    return cell.rjust(width)


#: A tensor the model or its optimizers own: ``(category, name, tensor)``.
_Owned = tuple[str, str, torch.Tensor]


def _unwrap_optimizer(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer wraps the real one


def _named_parameters(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's parameters, then the shards FSDP2 keeps of those it has gathered now (``"name (shard)"``)."""
    named = list(module.named_parameters(remove_duplicate=False))
    current = {id(param) for _, param in named}
    shards = [(f"{name} (shard)", shard) for name, shard in parameter_shards(module) if id(shard) not in current]
    return named + shards


#: ``(name, parameter)`` of a module, from :func:`_named_parameters` (read once per accounting).
_Named = Sequence[tuple[str, torch.Tensor]]


def _param_names(named: _Named) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, param in named:
        names.setdefault(id(param), name)
    return names


def _param_groups(optimizers: Sequence[Any]) -> Iterator[tuple[int, int, Mapping[str, Any]]]:
    """``(optimizer index, group index, param group)`` of every (unwrapped) optimizer."""
    for i, opt in enumerate(optimizers):
        for g, group in enumerate(getattr(opt, "param_groups", ())):
            yield i, g, group


def _parameters(named: _Named, optimizers: Sequence[Any], names: dict[int, str]) -> Iterator[_Owned]:
    """The module's parameters (and FSDP2's shards of gathered ones), then the optimizers' (named after the module's
    where they are the same tensor)."""
    for name, param in named:
        yield "parameters", name, param
    for i, g, group in _param_groups(optimizers):
        for j, param in enumerate(group.get("params", ())):
            if isinstance(param, torch.Tensor):
                yield "parameters", names.get(id(param), f"optimizer{i}.param_groups[{g}].params[{j}]"), param


def _buffers(module: torch.nn.Module) -> Iterator[_Owned]:
    for name, buf in module.named_buffers(remove_duplicate=False):
        if isinstance(buf, torch.Tensor):
            yield "buffers", name, buf


def _gradients(named: _Named, optimizers: Sequence[Any], names: dict[int, str]) -> Iterator[_Owned]:
    """The gradients of the module's parameters, then of the optimizers' parameters the module does not have."""
    for name, param in named:
        if param.grad is not None:
            yield "gradients", f"{name}.grad", param.grad
    for i, g, group in _param_groups(optimizers):
        for param in group.get("params", ()):
            if isinstance(param, torch.Tensor) and id(param) not in names and param.grad is not None:
                yield "gradients", f"optimizer{i}.param_groups[{g}].params.grad", param.grad


def _optimizer_states(optimizers: Sequence[Any], names: dict[int, str]) -> Iterator[_Owned]:
    """The tensors of each optimizer's per-parameter state (``exp_avg``, ...)."""
    for i, opt in enumerate(optimizers):
        for param, param_state in list(getattr(opt, "state", {}).items()):
            if not isinstance(param_state, Mapping):
                continue
            pname = names.get(id(param), "?")
            for key, value in param_state.items():
                if isinstance(value, torch.Tensor):
                    yield "optimizer_states", f"optimizer{i}.state[{pname}].{key}", value


def _owned(module: torch.nn.Module, optimizers: Sequence[Any]) -> Iterator[_Owned]:
    """``(category, name, tensor)`` for every tensor the module and optimizers own, in accounting order."""
    named = _named_parameters(module)
    names = _param_names(named)
    unwrapped = [_unwrap_optimizer(opt) for opt in optimizers]
    yield from _parameters(named, unwrapped, names)
    yield from _buffers(module)
    yield from _gradients(named, unwrapped, names)
    yield from _optimizer_states(unwrapped, names)


def model_footprint(module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> Footprint:
    """Bytes held by ``module`` (parameters, buffers, gradients) and ``optimizers`` (their states).

    Each storage is counted once, in the first category that holds it (parameters, buffers, gradients,
    optimizer states): tied weights and views cost nothing extra. Parameters of an optimizer that are not
    in ``module`` are counted as parameters too. Optimizer states appear after the first optimizer step
    for optimizers that create them lazily (Adam, ...).

    Args:
        module: The model.
        optimizers: Its optimizers (raw or wrapped by Lightning).

    Returns:
        A :class:`Footprint`, rows sorted by category order, then device, then dtype.

    Examples:
        >>> lin = torch.nn.Linear(4, 4, bias=False)
        >>> tied = torch.nn.Sequential(lin, torch.nn.ReLU(), torch.nn.Linear(4, 4, bias=False))
        >>> tied[2].weight = lin.weight  # tied: counted once
        >>> model_footprint(tied).rows
        (FootprintRow(category='parameters', dtype='torch.float32', device='cpu', num_tensors=1, bytes=64),)
    """
    seen_keys: set[StorageKey] = set()
    seen_ids: set[int] = set()
    groups: dict[tuple[str, str, str], list[int]] = {}
    for category, _name, tensor in _owned(module, optimizers):
        if id(tensor) in seen_ids:
            continue
        seen_ids.add(id(tensor))
        key = storage_key(tensor)
        nbytes = 0
        if key is None or key not in seen_keys:
            nbytes = storage_bytes(tensor)
            if key is not None:
                seen_keys.add(key)
        plain = plain_tensor(tensor)
        group = groups.setdefault((category, str(plain.dtype), str(plain.device)), [0, 0])
        group[0] += 1
        group[1] += nbytes
    order = {c: i for i, c in enumerate(CATEGORIES)}
    rows = tuple(
        FootprintRow(category=c, dtype=dt, device=dev, num_tensors=n, bytes=b)
        for (c, dt, dev), (n, b) in sorted(groups.items(), key=lambda kv: (order[kv[0][0]], kv[0][2], kv[0][1]))
    )
    return Footprint(rows=rows)


def tensor_names(module: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> dict[StorageKey, str]:
    """Names of the storages ``module`` and ``optimizers`` own, keyed by :data:`StorageKey`.

    Names: ``"layer.weight"`` (parameters), ``"bn.running_mean"`` (buffers), ``"layer.weight.grad"``
    (gradients), ``"optimizer0.state[layer.weight].exp_avg"`` (optimizer states). A shared storage keeps
    the first name (a tied weight is named after its first owner).

    Examples:
        >>> lin = torch.nn.Linear(2, 2)
        >>> sorted(tensor_names(lin).values())
        ['bias', 'weight']
    """
    names: dict[StorageKey, str] = {}
    for _category, name, tensor in _owned(module, optimizers):
        key = storage_key(tensor)
        if key is not None:
            names.setdefault(key, name)
    return names


def unexplained_bytes(allocated_bytes: int | None, footprint: Footprint, device: str) -> int | None:
    """Allocated bytes on ``device`` that the model and optimizers do not account for.

    ``allocated_bytes`` minus the footprint on ``device``: activations, stray copies, cached batches,
    library workspaces. ``None`` when the allocated figure is unknown (CPU). The caching allocator rounds
    allocations up, so a few KiB per tensor are always "unexplained"; a negative value means the footprint
    was taken at another moment than the reading.

    Examples:
        >>> fp = Footprint(rows=(FootprintRow("parameters", "torch.float32", "cuda:0", 2, 1000),))
        >>> unexplained_bytes(5000, fp, "cuda:0"), unexplained_bytes(None, fp, "cpu")
        (4000, None)
    """
    if allocated_bytes is None:
        return None
    return int(allocated_bytes) - footprint.total_bytes(device)
