"""Byte accounting of a model, its optimizers and the live tensors of a process.

Pure functions over modules, optimizers and the tensors reachable through Python's garbage collector.
No Trainer, no hooks: the callbacks (``MemoryAudit``, ``OOMReporter``) call these and decide what to report.

Every byte figure is *storage* bytes (``tensor.untyped_storage().nbytes()``), and a storage shared by
several tensors (views, tied weights, a gradient that aliases another tensor) is counted once. A storage
is identified by its :data:`StorageKey`: ``(device string, data pointer of the storage)``.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = [
    "CATEGORIES",
    "Duplicates",
    "Footprint",
    "FootprintRow",
    "LiveTensor",
    "StorageKey",
    "find_duplicates",
    "find_storage_holders",
    "iter_held_tensors",
    "live_tensors",
    "model_footprint",
    "storage_bytes",
    "storage_key",
    "tensor_names",
    "unexplained_bytes",
]

#: The categories of a :class:`Footprint`, in the order they are accounted (a storage goes to the first).
CATEGORIES: tuple[str, ...] = ("parameters", "buffers", "gradients", "optimizer_states")

#: ``(device string, untyped_storage().data_ptr())``; identifies one storage (CPU tensors included).
StorageKey = tuple[str, int]


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor behind a wrapper subclass (e.g. a ``DTensor`` shard), else the tensor itself."""
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor


def storage_key(tensor: torch.Tensor) -> StorageKey | None:
    """The :data:`StorageKey` of ``tensor``, or ``None`` when it has no addressable storage.

    Tensors without data (meta tensors, empty storages) have no key: they cannot alias anything.

    Example:
        >>> t = torch.zeros(4)
        >>> storage_key(t) == storage_key(t[2:]), storage_key(torch.empty(0, device="meta"))
        (True, None)
    """
    try:
        tensor = _plain(tensor)
        if tensor.device.type == "meta":
            return None
        ptr = int(tensor.untyped_storage().data_ptr())
    except Exception:
        return None
    if ptr == 0:
        return None
    return (str(tensor.device), ptr)


def storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the whole storage behind ``tensor`` (a view reports its base's storage).

    Example:
        >>> storage_bytes(torch.zeros(10, 10)[0])
        400
    """
    tensor = _plain(tensor)
    try:
        return int(tensor.untyped_storage().nbytes())
    except Exception:
        return int(tensor.numel() * tensor.element_size())


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


def _device_matches(row_device: str, device: str | torch.device | None) -> bool:
    if device is None:
        return True
    wanted = str(device)
    if ":" in wanted:
        return row_device == wanted
    return row_device.split(":", 1)[0] == wanted


@dataclass(frozen=True)
class Footprint:
    """What a model and its optimizers hold, as rows of :class:`FootprintRow`.

    Example:
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
            if _device_matches(row.device, device):
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
        from lightning_memopt.utilities.formatting import format_bytes

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
            "  ".join(cell.ljust(w) if i < 3 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
            for line in lines
        )


def _unwrap_optimizer(optimizer: Any) -> Any:
    return getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer wraps the real one


def _param_names(module: torch.nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names


def _owned(module: torch.nn.Module, optimizers: Sequence[Any]) -> Iterable[tuple[str, str, torch.Tensor]]:
    """``(category, name, tensor)`` for every tensor the module and optimizers own, in accounting order."""
    names = _param_names(module)
    for name, param in module.named_parameters(remove_duplicate=False):
        yield "parameters", name, param
    optimizers = [_unwrap_optimizer(opt) for opt in optimizers]
    for i, opt in enumerate(optimizers):
        for g, group in enumerate(getattr(opt, "param_groups", ())):
            for j, param in enumerate(group.get("params", ())):
                if isinstance(param, torch.Tensor):
                    yield "parameters", names.get(id(param), f"optimizer{i}.param_groups[{g}].params[{j}]"), param
    for name, buf in module.named_buffers(remove_duplicate=False):
        if isinstance(buf, torch.Tensor):
            yield "buffers", name, buf
    for name, param in module.named_parameters(remove_duplicate=False):
        if param.grad is not None:
            yield "gradients", f"{name}.grad", param.grad
    for i, opt in enumerate(optimizers):
        for g, group in enumerate(getattr(opt, "param_groups", ())):
            for param in group.get("params", ()):
                if isinstance(param, torch.Tensor) and id(param) not in names and param.grad is not None:
                    yield "gradients", f"optimizer{i}.param_groups[{g}].params.grad", param.grad
    for i, opt in enumerate(optimizers):
        state = getattr(opt, "state", {})
        for param, param_state in list(state.items()):
            if not isinstance(param_state, Mapping):
                continue
            pname = names.get(id(param), "?")
            for key, value in param_state.items():
                if isinstance(value, torch.Tensor):
                    yield "optimizer_states", f"optimizer{i}.state[{pname}].{key}", value


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

    Example:
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
        plain = _plain(tensor)
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

    Example:
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


@dataclass(frozen=True)
class LiveTensor:
    """One live storage found through the garbage collector.

    Args:
        shape: Shape of the (first seen) tensor on the storage.
        dtype: Its dtype, e.g. ``"torch.bfloat16"``.
        device: Its device, e.g. ``"cuda:0"``.
        bytes: Storage bytes.
        requires_grad: Whether the tensor requires grad (parameters and their copies by ``deepcopy`` do).
        has_grad_fn: Whether it carries autograd history (a ``grad_fn``): it keeps a graph alive.
        name: The owner's name from ``names`` (see :func:`tensor_names`), ``None`` if not owned.
        key: The :data:`StorageKey` of the storage (not part of comparisons or ``repr``).
    """

    shape: tuple[int, ...]
    dtype: str
    device: str
    bytes: int
    requires_grad: bool
    has_grad_fn: bool
    name: str | None
    key: StorageKey | None = field(default=None, compare=False, repr=False)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (without the storage key)."""
        out = asdict(self)
        del out["key"]
        out["shape"] = list(self.shape)
        return out


def _is_tensor_type(tp: type) -> bool:
    try:
        return issubclass(tp, torch.Tensor)
    except Exception:
        return False


def _gc_tensors() -> list[Any]:
    """The tensors among ``gc.get_objects()``; one dict lookup per object, one ``issubclass`` per type.

    ``type(obj)`` never runs user code (``isinstance`` may call a proxy's ``__class__`` property).
    """
    known: dict[type, bool] = {}
    found: list[Any] = []
    objects = gc.get_objects()
    try:
        for obj in objects:
            tp = type(obj)
            flag = known.get(tp)
            if flag is None:
                flag = known[tp] = _is_tensor_type(tp)
            if flag:
                found.append(obj)
    finally:
        del objects
    return found


def live_tensors(
    device: str | torch.device | None = None, names: Mapping[StorageKey, str] | None = None
) -> list[LiveTensor]:
    """Every tensor reachable through ``gc.get_objects()`` (``nn.Parameter`` included), one per storage.

    Tensors that share a storage (views, tied weights) give one entry with the storage's bytes; when
    several tensors share it, the largest one describes it. Meta tensors and empty storages are skipped.
    An object that misbehaves while being inspected is skipped; this function never raises because of one.
    It costs one ``gc.get_objects()`` (tens of milliseconds in a large process): call it on an interval.

    Args:
        device: Keep only tensors on this device (``"cuda:0"`` exact, ``"cuda"`` any CUDA device).
            ``None`` keeps all.
        names: Names of owned storages (from :func:`tensor_names`) to attach to the entries.

    Returns:
        The live storages, largest first.

    Example:
        >>> keep = torch.zeros(1000, dtype=torch.float64)
        >>> found = [t for t in live_tensors("cpu") if t.shape == (1000,) and t.dtype == "torch.float64"]
        >>> found[0].bytes
        8000
    """
    names = names or {}
    wanted = None if device is None else str(device)
    by_key: dict[StorageKey, tuple[int, LiveTensor]] = {}
    tensors = _gc_tensors()
    try:
        for obj in tensors:
            try:
                tensor = _plain(obj)
                dev = str(tensor.device)
                if wanted is not None and not _device_matches(dev, wanted):
                    continue
                key = storage_key(tensor)
                if key is None:
                    continue
                numel = int(tensor.numel())
                previous = by_key.get(key)
                if previous is not None and previous[0] >= numel:
                    continue
                by_key[key] = (
                    numel,
                    LiveTensor(
                        shape=tuple(int(s) for s in tensor.shape),
                        dtype=str(tensor.dtype),
                        device=dev,
                        bytes=storage_bytes(tensor),
                        requires_grad=bool(obj.requires_grad),
                        has_grad_fn=obj.grad_fn is not None,
                        name=names.get(key),
                        key=key,
                    ),
                )
            except Exception:
                continue
    finally:
        del tensors
    return sorted((entry for _, entry in by_key.values()), key=lambda t: t.bytes, reverse=True)


def unexplained_bytes(allocated_bytes: int | None, footprint: Footprint, device: str) -> int | None:
    """Allocated bytes on ``device`` that the model and optimizers do not account for.

    ``allocated_bytes`` minus the footprint on ``device``: activations, stray copies, cached batches,
    library workspaces. ``None`` when the allocated figure is unknown (CPU). The caching allocator rounds
    allocations up, so a few KiB per tensor are always "unexplained"; a negative value means the footprint
    was taken at another moment than the reading.

    Example:
        >>> fp = Footprint(rows=(FootprintRow("parameters", "torch.float32", "cuda:0", 2, 1000),))
        >>> unexplained_bytes(5000, fp, "cuda:0"), unexplained_bytes(None, fp, "cpu")
        (4000, None)
    """
    if allocated_bytes is None:
        return None
    return int(allocated_bytes) - footprint.total_bytes(device)


@dataclass(frozen=True)
class Duplicates:
    """Live tensors that are not owned by the model or optimizer but mirror its parameters.

    Args:
        num_tensors: How many such storages are alive.
        bytes: Their storage bytes (shared storages counted once).
        fraction: Their elements over the parameters' elements: ``1.0`` is one full copy of the weights,
            ``2.0`` two copies.
        dtypes: Their dtypes, most bytes first.
        cause: The likely cause, in words.
        largest: The largest few of them.
        num_same_shape_other_values: Unowned tensors that have a parameter's shape but other values (a
            batch or a dataset tensor that happens to have that shape, another model's weights): not counted
            above.
        signatures: ``(storage key, shape, dtype)`` of every copy (not part of comparisons, ``repr`` or
            :meth:`as_dict`); pass them as ``known`` to a later :func:`find_duplicates`.
    """

    num_tensors: int
    bytes: int
    fraction: float
    dtypes: tuple[str, ...]
    cause: str
    largest: tuple[LiveTensor, ...]
    num_same_shape_other_values: int = 0
    signatures: frozenset[tuple[StorageKey, tuple[int, ...], str]] = field(
        default=frozenset(), compare=False, repr=False
    )

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        out = asdict(self)
        out.pop("signatures", None)
        out["largest"] = [t.as_dict() for t in self.largest]
        out["dtypes"] = list(self.dtypes)
        return out


def _unique_parameters(module: torch.nn.Module) -> Iterable[torch.Tensor]:
    """Each parameter once (tied weights too), as the local tensor behind any wrapper subclass."""
    seen: set[int] = set()
    for param in module.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            yield _plain(param)


#: How many evenly spaced elements of a tensor are compared with a parameter's to call it a mirror.
_NUM_SAMPLED = 64


def _sampled_values(tensor: torch.Tensor) -> torch.Tensor:
    """Up to :data:`_NUM_SAMPLED` evenly spaced elements as float32 on the CPU (one small transfer)."""
    flat = tensor.detach().reshape(-1)
    step = max(1, flat.numel() // _NUM_SAMPLED)
    return flat[::step][:_NUM_SAMPLED].to("cpu", torch.float32)


def _mirroring_keys(module: torch.nn.Module, candidates: Sequence[LiveTensor]) -> set[StorageKey]:
    """The storage keys among ``candidates`` whose values match a same-shape parameter of ``module``.

    Values are compared on evenly spaced samples, to bf16 rounding (``rtol=1e-2``), so an fp32 copy of
    bf16 weights, a ``deepcopy`` or a state dict mirrors its parameter, while a batch or a dataset tensor that
    merely has a parameter's shape does not. One extra ``gc.get_objects()`` walk, run only when there are
    candidates.
    """
    wanted = {t.key: t.shape for t in candidates if t.key is not None}
    if not wanted:
        return set()
    samples: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for plain in _unique_parameters(module):
        shape = tuple(int(s) for s in plain.shape)
        if shape in wanted.values():
            samples.setdefault(shape, []).append(_sampled_values(plain))
    found: set[StorageKey] = set()
    tensors = _gc_tensors()
    try:
        for obj in tensors:
            try:
                tensor = _plain(obj)
                key = storage_key(tensor)
                shape = tuple(int(s) for s in tensor.shape)
                if key not in wanted or key in found or wanted[key] != shape:
                    continue
                values = _sampled_values(tensor)
                if any(torch.allclose(values, ref, rtol=1e-2, atol=1e-3) for ref in samples.get(shape, ())):
                    found.add(key)  # type: ignore[arg-type]
            except Exception:
                continue
    finally:
        del tensors
    return found


def find_duplicates(
    module: torch.nn.Module,
    live: Sequence[LiveTensor],
    max_listed: int = 5,
    match_values: bool = True,
    known: Iterable[tuple[StorageKey, tuple[int, ...], str]] = (),
) -> Duplicates:
    """Find unowned live tensors that mirror ``module``'s parameters.

    A live tensor counts when it has no owner name (see :func:`tensor_names` and :func:`live_tensors`), its
    shape is the shape of one of the parameters and (with ``match_values``) its values are that parameter's
    up to bf16 rounding, compared on 64 evenly spaced elements: a stray fp32 copy of the weights, a state dict
    loaded onto the device, a ``deepcopy`` of the model. Views and tied weights share a storage with an
    owned tensor, so they carry its name and never count. Same-shape tensors with other values (a batch
    that happens to have a weight's shape, another model) are only counted in
    ``num_same_shape_other_values``.

    Args:
        module: The model whose parameters are mirrored.
        live: Live storages with names attached (``live_tensors(device, names=tensor_names(...))``).
        max_listed: How many of the largest copies to keep in ``largest``.
        match_values: Whether a copy must also hold the parameter's values; ``False`` matches on shape alone.
        known: Copies found before (``Duplicates.signatures`` of an earlier call): a live storage with the same
            key, shape and dtype still counts when training has moved the weights away from its values since.

    Example:
        >>> model = torch.nn.Linear(64, 64)
        >>> stray = {k: v.to(torch.float64) for k, v in model.state_dict().items()}
        >>> dup = find_duplicates(model, live_tensors("cpu", names=tensor_names(model)))
        >>> dup.num_tensors >= 2, dup.fraction >= 1.0, dup.dtypes[0]
        (True, True, 'torch.float64')
    """
    shapes: dict[tuple[int, ...], set[str]] = {}
    total_numel = 0
    for plain in _unique_parameters(module):
        shapes.setdefault(tuple(int(s) for s in plain.shape), set()).add(str(plain.dtype))
        total_numel += int(plain.numel())
    candidates = [t for t in live if t.name is None and t.shape in shapes and t.bytes > 0]
    known = set(known)
    if match_values and candidates:
        seen_before = {t.key for t in candidates if (t.key, t.shape, t.dtype) in known}
        unknown = [t for t in candidates if t.key not in seen_before]
        mirrored = _mirroring_keys(module, unknown) | seen_before
        copies = [t for t in candidates if t.key in mirrored]
    else:
        copies = candidates
    numel = sum(_numel(t.shape) for t in copies)
    nbytes = sum(t.bytes for t in copies)
    by_dtype: dict[str, int] = {}
    for t in copies:
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.bytes
    other_dtype = sum(t.bytes for t in copies if t.dtype not in shapes[t.shape])
    with_grad = sum(t.bytes for t in copies if t.requires_grad)
    if not copies:
        cause = "no copies found"
    elif other_dtype * 2 >= nbytes:
        cause = (
            "a copy in another dtype than the model's: the weights from before a dtype conversion (an fp32 model"
            " or state dict kept after `.to(torch.bfloat16)`/`.half()`), or an fp32 master copy; convert once in"
            " place (`to_device_and_dtype`) and drop the other reference"
        )
    elif with_grad * 2 >= nbytes:
        cause = (
            "a second model object: a `copy.deepcopy` of the model, an EMA/teacher model that is not a submodule,"
            " or the model loaded twice"
        )
    else:
        cause = (
            "a state dict or detached copy of the weights on this device: `torch.load(..., map_location=<device>)`"
            " or `model.state_dict()` kept in a variable, or weights cached in a list or dict"
        )
    return Duplicates(
        num_tensors=len(copies),
        bytes=nbytes,
        fraction=numel / total_numel if total_numel else 0.0,
        dtypes=tuple(sorted(by_dtype, key=lambda d: -by_dtype[d])),
        cause=cause,
        largest=tuple(copies[:max_listed]),
        num_same_shape_other_values=len(candidates) - len(copies),
        signatures=frozenset((t.key, t.shape, t.dtype) for t in copies if t.key is not None),
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


#: What every ``nn.Module`` has in its ``__dict__`` (hook registries, parameter, buffer and submodule dicts, ...).
MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))


def iter_held_tensors(
    obj: Any,
    path: str = "",
    max_depth: int = 4,
    max_items: int = 100_000,
    into_modules: bool = False,
    seen: set[int] | None = None,
) -> Iterator[tuple[str, str | None, torch.Tensor]]:
    """The tensors inside ``obj``: ``(path, owner, tensor)``, walking dicts, lists, tuples, sets and deques.

    With ``into_modules``, modules met on the way (stored without being registered) are walked too: their
    parameters, buffers and attributes; ``owner`` is then the path of the outermost such module, else ``None``.
    Each object is visited once (``seen`` may be shared between calls), at most ``max_items`` of them, to
    ``max_depth`` levels. A container that breaks while being walked is skipped; this never raises.

    Example:
        >>> w = torch.ones(2)
        >>> [(p, o) for p, o, _ in iter_held_tensors({"a": [w, 3], "m": torch.nn.Linear(1, 1)}, "x",
        ...                                           into_modules=True)]
        [("x['a'][0]", None), ("x['m'].weight", "x['m']"), ("x['m'].bias", "x['m']")]
    """
    seen = set() if seen is None else seen
    budget = [max_items]

    def walk(value: Any, where: str, depth: int, owner: str | None) -> Iterator[tuple[str, str | None, Any]]:
        if budget[0] <= 0 or id(value) in seen:
            return
        budget[0] -= 1
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            yield where, owner, value
            return
        if depth >= max_depth or isinstance(value, (str, bytes, int, float, bool, type(None))):
            return
        try:
            if isinstance(value, torch.nn.Module):
                if not into_modules:
                    return
                owner = owner or where
                named = [*value.named_parameters(), *value.named_buffers()]
                named += [(k, v) for k, v in vars(value).items() if k not in MODULE_INTERNALS]
                items = [(f"{where}.{k}", v) for k, v in named]
            elif isinstance(value, Mapping):
                items = [(f"{where}[{k!r}]", v) for k, v in list(value.items())]
            elif isinstance(value, (list, tuple, set, frozenset)) or type(value).__name__ == "deque":
                items = [(f"{where}[{i}]", v) for i, v in enumerate(list(value))]
            else:
                return
        except Exception:  # a container that breaks while being listed
            return
        for item_path, item in items:
            yield from walk(item, item_path, depth + 1, owner)

    try:
        yield from walk(obj, path, 0, None)
    except Exception:  # e.g. a property that raises while being walked: stop with what was found
        return


def find_storage_holders(
    module: torch.nn.Module,
    keys: Iterable[StorageKey],
    prefix: str = "self",
    max_depth: int = 4,
    max_items: int = 100_000,
) -> dict[StorageKey, str]:
    """Where in ``module``'s attributes the storages ``keys`` are held: ``{key: "self._hparams_initial['x']"}``.

    Walks the instance attributes of ``module`` and its submodules (not their registered parameters, buffers and
    submodules) with :func:`iter_held_tensors`, into modules that are stored without being registered (a model
    kept in ``hparams`` by ``save_hyperparameters()``, a teacher in a dict); a storage inside such a module is
    reported at that module's path. Used to say where a stray copy of the weights lives. Keys that are not found
    are left out; this never raises.

    Example:
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(2, 2)
        ...         self.kept = {"backbone": torch.nn.Linear(2, 2)}  # not a registered submodule
        >>> net = Net()
        >>> key = storage_key(net.kept["backbone"].weight)
        >>> find_storage_holders(net, [key])[key]
        "self.kept['backbone']"
    """
    wanted = {k for k in keys if k is not None}
    found: dict[StorageKey, str] = {}
    if not wanted:
        return found
    with contextlib.suppress(Exception):
        modules = list(module.named_modules())
        seen = {id(mod) for _, mod in modules}  # registered submodules are the model, not a copy of it
        for mod_name, mod in modules:
            base = f"{prefix}.{mod_name}" if mod_name else prefix
            for attr, value in list(vars(mod).items()):
                if attr in MODULE_INTERNALS or attr == "_trainer":
                    continue
                for path, owner, tensor in iter_held_tensors(
                    value, f"{base}.{attr}", max_depth, max_items, into_modules=True, seen=seen
                ):
                    key = storage_key(tensor)
                    if key in wanted and key not in found:
                        found[key] = owner or path
                if len(found) == len(wanted):
                    return found
    return found
