"""The live tensors of the process, found through the garbage collector, one entry per storage."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from lightning_memopt.functional.footprint.storage import (
    INSPECTION_ERRORS,
    StorageKey,
    device_matches,
    gc_tensors,
    plain_tensor,
    storage_bytes,
    storage_key,
)

__all__ = ["LiveTensor", "live_tensors"]


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

    def as_dict(self, with_name: bool = True) -> dict[str, Any]:
        """A JSON-serialisable dict (without the storage key; without ``name`` when ``with_name`` is false).

        Examples:
            >>> list(LiveTensor((2,), "torch.float32", "cpu", 8, False, False, None).as_dict(with_name=False))
            ['shape', 'dtype', 'device', 'bytes', 'requires_grad', 'has_grad_fn']
        """
        out = asdict(self)
        del out["key"]
        if not with_name:
            del out["name"]
        out["shape"] = list(self.shape)
        return out


def live_tensors(
    device: str | torch.device | None = None, names: Mapping[StorageKey, str] | None = None
) -> list[LiveTensor]:
    """Every tensor reachable through ``gc.get_objects()`` (``nn.Parameter`` included), one per storage.

    Tensors that share a storage (views, tied weights) give one entry with the storage's bytes; when
    several tensors share it, the largest one describes it. Meta tensors and empty storages are skipped.
    An object that misbehaves while being inspected (raises one of
    :data:`~lightning_memopt.functional.footprint.storage.INSPECTION_ERRORS`) is skipped.
    It costs one ``gc.get_objects()`` (tens of milliseconds in a large process): call it on an interval.

    Args:
        device: Keep only tensors on this device (``"cuda:0"`` exact, ``"cuda"`` any CUDA device).
            ``None`` keeps all.
        names: Names of owned storages (from :func:`tensor_names`) to attach to the entries.

    Returns:
        The live storages, largest first.

    Examples:
        >>> keep = torch.zeros(1000, dtype=torch.float64)
        >>> [found] = [t for t in live_tensors("cpu") if t.key == storage_key(keep)]
        >>> found.shape, found.bytes
        ((1000,), 8000)
    """
    names = names or {}
    wanted = None if device is None else str(device)
    by_key: dict[StorageKey, tuple[int, LiveTensor]] = {}
    tensors = gc_tensors()
    try:
        for obj in tensors:
            try:
                tensor = plain_tensor(obj)
                dev = str(tensor.device)
                if wanted is not None and not device_matches(dev, wanted):
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
            except INSPECTION_ERRORS:
                continue
    finally:
        del tensors
    return sorted((entry for _, entry in by_key.values()), key=lambda t: t.bytes, reverse=True)
