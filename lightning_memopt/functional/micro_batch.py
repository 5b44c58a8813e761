"""Split a batch into micro-batches: the default slicer of :class:`~lightning_memopt.callbacks.AutoMicroBatch`.

A batch is a tensor, or a dict / tuple / list / namedtuple / dataclass of batches. Leaves that are tensors with a first
dim, and flat sequences of plain values (strings, numbers, ``None``) whose length is the batch size, are sliced along
the first dim; ``None``, numbers, strings and 0-dim tensors are passed to every micro-batch as they are. Anything
else (a custom class, a tensor whose first dim is not the batch size) is refused with an error that names where it
sits in the batch and how to pass a slicer of your own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

__all__ = ["batch_size_of", "count_samples", "micro_batch_of", "slice_batch"]

_PLAIN = (str, bytes, int, float, complex, bool, type(None))
_OVERRIDE = (
    " Pass `AutoMicroBatch(split_batch=fn)`, where `fn(batch, start, stop)` returns the samples [start, stop) of the"
    " batch (and `batch_size=fn2(batch)` if the batch size cannot be read from a tensor's first dim)."
)


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _is_flat_sequence(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and not _is_namedtuple(x) and all(isinstance(v, _PLAIN) for v in x) and bool(x)


def _first_size(batch: Any, path: str) -> int | None:
    if isinstance(batch, Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else None
    if isinstance(batch, Mapping):
        for key, value in batch.items():
            size = _first_size(value, f"{path}[{key!r}]")
            if size is not None:
                return size
        return None
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for f in dataclasses.fields(batch):
            size = _first_size(getattr(batch, f.name), f"{path}.{f.name}")
            if size is not None:
                return size
        return None
    if _is_namedtuple(batch) or (isinstance(batch, (list, tuple)) and not _is_flat_sequence(batch)):
        for i, value in enumerate(batch):
            size = _first_size(value, f"{path}[{i}]")
            if size is not None:
                return size
        return None
    return None


def batch_size_of(batch: Any) -> int:
    """The first dim of the first tensor in ``batch`` (depth first), the number of samples the batch holds.

    Raises:
        TypeError: when the batch holds no tensor with a first dim, naming the batch's type and the override.

    Example:
        >>> import torch
        >>> batch_size_of({"x": torch.zeros(8, 3), "ids": list(range(8))})
        8
    """
    size = _first_size(batch, "batch")
    if size is None:
        raise TypeError(
            f"AutoMicroBatch cannot tell the batch size of a batch of type {type(batch).__name__}: it holds no tensor"
            " with a first dim." + _OVERRIDE
        )
    return size


def _slice(batch: Any, start: int, stop: int, size: int, path: str) -> Any:
    if isinstance(batch, Tensor):
        if batch.dim() == 0:
            return batch
        if batch.shape[0] != size:
            raise TypeError(
                f"AutoMicroBatch cannot split `{path}`: a tensor of shape {tuple(batch.shape)} whose first dim is not"
                f" the batch size {size}." + _OVERRIDE
            )
        return batch[start:stop]
    if isinstance(batch, _PLAIN):
        return batch
    if isinstance(batch, Mapping):
        items = {key: _slice(value, start, stop, size, f"{path}[{key!r}]") for key, value in batch.items()}
        cls: Any = type(batch)  # a Mapping subclass; its constructor is not Mapping's
        try:
            return cls(items) if cls is not dict else items
        except TypeError:
            return items
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {
            f.name: _slice(getattr(batch, f.name), start, stop, size, f"{path}.{f.name}")
            for f in dataclasses.fields(batch)
            if f.init
        }
        return dataclasses.replace(batch, **changes)
    if _is_namedtuple(batch):
        return type(batch)(*(_slice(v, start, stop, size, f"{path}.{name}") for name, v in zip(batch._fields, batch)))
    if _is_flat_sequence(batch):
        if len(batch) != size:
            raise TypeError(
                f"AutoMicroBatch cannot split `{path}`: a {type(batch).__name__} of {len(batch)} plain values, not one"
                f" per sample (batch size {size})." + _OVERRIDE
            )
        return type(batch)(batch[start:stop])
    if isinstance(batch, (list, tuple)):
        return type(batch)(_slice(v, start, stop, size, f"{path}[{i}]") for i, v in enumerate(batch))
    raise TypeError(
        f"AutoMicroBatch cannot split `{path}` of type {type(batch).__module__}.{type(batch).__qualname__}: the default"
        " slicer handles tensors, dicts, tuples, lists, namedtuples, dataclasses and lists of plain values." + _OVERRIDE
    )


def slice_batch(batch: Any, start: int, stop: int, size: int | None = None) -> Any:
    """The samples ``[start, stop)`` of ``batch`` (see the module docstring for what is sliced and what is refused).

    Raises:
        TypeError: for a leaf the default slicer cannot split, naming its place in the batch and the override.

    Example:
        >>> import torch
        >>> part = slice_batch({"x": torch.arange(6), "text": list("abcdef"), "scale": 2.0}, 2, 4)
        >>> part["x"].tolist(), part["text"], part["scale"]
        ([2, 3], ['c', 'd'], 2.0)
    """
    size = batch_size_of(batch) if size is None else size
    return _slice(batch, start, stop, size, "batch")


def count_samples(batch: Any, batch_size: Callable[[Any], int] | None = None) -> int:
    """The number of samples of ``batch``: ``batch_size(batch)`` if given, else :func:`batch_size_of`.

    Raises:
        ValueError: when that is not a positive int.
    """
    size = batch_size(batch) if batch_size is not None else batch_size_of(batch)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"AutoMicroBatch: the batch size of a batch must be a positive int, got {size!r}.")
    return size


def micro_batch_of(
    batch: Any, start: int, stop: int, size: int, split_batch: Callable[[Any, int, int], Any] | None = None
) -> Any:
    """The samples ``[start, stop)`` of a batch of ``size``: the batch itself when that is all of it, else
    ``split_batch(batch, start, stop)`` if given, else :func:`slice_batch`.

    Example:
        >>> import torch
        >>> x = torch.arange(4)
        >>> micro_batch_of(x, 0, 4, 4) is x, micro_batch_of(x, 1, 3, 4).tolist()
        (True, [1, 2])
    """
    if start == 0 and stop == size:
        return batch
    if split_batch is not None:
        return split_batch(batch, start, stop)
    return slice_batch(batch, start, stop, size)
