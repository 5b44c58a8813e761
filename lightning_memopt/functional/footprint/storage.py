"""Storages: the key and size of the storage behind a tensor, and the tensors among the garbage collector's objects.

Every byte figure of :mod:`lightning_memopt.functional.footprint` is *storage* bytes
(``tensor.untyped_storage().nbytes()``), and a storage shared by several tensors (views, tied weights, a gradient
that aliases another tensor) is counted once. A storage is identified by its :data:`StorageKey`:
``(device string, data pointer of the storage)``.
"""

from __future__ import annotations

import gc
from itertools import compress
from typing import Any

import torch

__all__ = [
    "INSPECTION_ERRORS",
    "StorageKey",
    "device_matches",
    "gc_tensors",
    "plain_tensor",
    "storage_bytes",
    "storage_key",
    "tensor_types",
]

#: What inspecting an arbitrary tensor or object found through the garbage collector may raise (a tensor without
#: storage, a subclass whose properties raise): such an object is skipped, never a reason to fail.
INSPECTION_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, AttributeError, TypeError, ValueError)

#: ``(device string, untyped_storage().data_ptr())``; identifies one storage (CPU tensors included).
StorageKey = tuple[str, int]


def plain_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor behind a wrapper subclass (e.g. a ``DTensor`` shard), else the tensor itself."""
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor


def storage_key(tensor: torch.Tensor) -> StorageKey | None:
    """The :data:`StorageKey` of ``tensor``, or ``None`` when it has no addressable storage.

    Tensors without data (meta tensors, empty storages) have no key: they cannot alias anything.

    Examples:
        >>> t = torch.zeros(4)
        >>> storage_key(t) == storage_key(t[2:]), storage_key(torch.empty(0, device="meta"))
        (True, None)
    """
    try:
        tensor = plain_tensor(tensor)
        if tensor.device.type == "meta":
            return None
        ptr = int(tensor.untyped_storage().data_ptr())
    except INSPECTION_ERRORS:
        return None
    if ptr == 0:
        return None
    return (str(tensor.device), ptr)


def storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the whole storage behind ``tensor`` (a view reports its base's storage).

    Examples:
        >>> storage_bytes(torch.zeros(10, 10)[0])
        400
    """
    tensor = plain_tensor(tensor)
    try:
        return int(tensor.untyped_storage().nbytes())
    except INSPECTION_ERRORS:
        return int(tensor.numel() * tensor.element_size())


def device_matches(row_device: str, device: str | torch.device | None) -> bool:
    """Whether ``row_device`` (``"cuda:0"``) is ``device``: exact with an index, any index with a bare type.

    Examples:
        >>> device_matches("cuda:1", "cuda"), device_matches("cuda:1", "cuda:0"), device_matches("cpu", None)
        (True, False, True)
    """
    if device is None:
        return True
    wanted = str(device)
    if ":" in wanted:
        return row_device == wanted
    return row_device.split(":", 1)[0] == wanted


def _subclasses(tp: type) -> list[type]:
    try:
        return list(type.__subclasses__(tp))
    except INSPECTION_ERRORS:
        return []


def tensor_types() -> frozenset[type]:
    """``torch.Tensor`` and every subclass defined now (``nn.Parameter``, ``DTensor``, user subclasses).

    The classes of every live tensor are among them: an instance keeps its class alive, so ``__subclasses__`` knows
    it. The same answer as ``issubclass(tp, torch.Tensor)`` for each class, in one pass over the class tree.

    Examples:
        >>> torch.nn.Parameter in tensor_types(), dict in tensor_types()
        (True, False)
    """
    found: set[type] = set()
    stack: list[type] = [torch.Tensor]
    while stack:
        tp = stack.pop()
        if tp not in found:
            found.add(tp)
            stack.extend(_subclasses(tp))
    return frozenset(found)


def gc_tensors() -> list[Any]:
    """The tensors among ``gc.get_objects()``: one set lookup per object, in C (``map``/``compress``).

    ``type(obj)`` never runs user code (``isinstance`` may call a proxy's ``__class__`` property). Objects frozen
    with ``gc.freeze()`` are not among ``gc.get_objects()``: tensors that existed at the freeze are not seen.
    """
    wanted = tensor_types()
    objects = gc.get_objects()
    try:
        return list(compress(objects, map(wanted.__contains__, map(type, objects))))
    finally:
        del objects
