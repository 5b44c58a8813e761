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

__all__ = [
    "batch_size_of",
    "check_first_batch",
    "count_samples",
    "loader_batch_size",
    "micro_batch_of",
    "sample_elements",
    "slice_batch",
]

_PLAIN = (str, bytes, int, float, complex, bool, type(None))
_OVERRIDE = (
    " Pass `AutoMicroBatch(split_batch_fn=fn)`, where `fn(batch, start, stop)` returns the samples [start, stop) of"
    " the batch (and `batch_size_fn=fn2`, where `fn2(batch)` counts them, if no tensor's first dim does)."
)


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _is_flat_sequence(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and not _is_namedtuple(x) and all(isinstance(v, _PLAIN) for v in x) and bool(x)


def _first_size(batch: Any, path: str) -> tuple[int, str] | None:
    """The first dim of the first tensor with one (depth first), and where that tensor sits in the batch."""
    if isinstance(batch, Tensor):
        return (int(batch.shape[0]), path) if batch.dim() > 0 else None
    if isinstance(batch, Mapping):
        children: Any = ((f"{path}[{key!r}]", value) for key, value in batch.items())
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        children = ((f"{path}.{f.name}", getattr(batch, f.name)) for f in dataclasses.fields(batch))
    elif _is_namedtuple(batch) or (isinstance(batch, (list, tuple)) and not _is_flat_sequence(batch)):
        children = ((f"{path}[{i}]", value) for i, value in enumerate(batch))
    else:
        return None
    for child_path, value in children:
        found = _first_size(value, child_path)
        if found is not None:
            return found
    return None


def batch_size_of(batch: Any) -> int:
    """The first dim of the first tensor in ``batch`` (depth first), the number of samples the batch holds.

    Raises:
        TypeError: when the batch holds no tensor with a first dim, naming the batch's type and the override.

    Examples:
        >>> import torch
        >>> batch_size_of({"x": torch.zeros(8, 3), "ids": list(range(8))})
        8
    """
    found = _first_size(batch, "batch")
    if found is None:
        raise TypeError(
            f"AutoMicroBatch cannot tell the batch size of a batch of type {type(batch).__name__}: it holds no tensor"
            " with a first dim." + _OVERRIDE
        )
    return found[0]


def _tensors(batch: Any) -> list[Tensor]:
    """The tensors in ``batch`` (depth first through mappings, dataclasses, lists and tuples)."""
    if isinstance(batch, Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        values: Any = batch.values()
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        values = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    elif isinstance(batch, (list, tuple)):
        values = batch
    else:
        return []
    return [t for value in values for t in _tensors(value)]


def sample_elements(batch: Any, samples: int) -> int:
    """Tensor elements per sample of ``batch``: over the tensors whose first dim is ``samples``, their elements
    divided by ``samples`` (a padded sequence length counts in full); 1 when there is none.

    What a micro-batch's memory grows with, to carry a micro-batch size that fits from one batch shape to another.

    Examples:
        >>> import torch
        >>> sample_elements({"input_ids": torch.zeros(8, 128), "mask": torch.zeros(8, 128), "y": torch.zeros(8)}, 8)
        257
    """
    total = sum(t.numel() for t in _tensors(batch) if t.dim() > 0 and t.shape[0] == samples)
    return max(1, total // samples) if total else 1


def _slice_tensor(batch: Tensor, start: int, stop: int, size: int, path: str) -> Tensor:
    if batch.dim() == 0:
        return batch
    if batch.shape[0] != size:
        raise TypeError(
            f"AutoMicroBatch cannot split `{path}`: a tensor of shape {tuple(batch.shape)} whose first dim is not"
            f" the batch size {size}." + _OVERRIDE
        )
    return batch[start:stop]


def _slice_values(batch: list | tuple, start: int, stop: int, size: int, path: str) -> list | tuple:
    """A flat list or tuple of plain values: one per sample, or refused."""
    if len(batch) != size:
        raise TypeError(
            f"AutoMicroBatch cannot split `{path}`: a {type(batch).__name__} of {len(batch)} plain values, not one"
            f" per sample (batch size {size})." + _OVERRIDE
        )
    return type(batch)(batch[start:stop])


def _same_mapping(batch: Mapping, items: dict) -> Any:
    """``items`` in ``batch``'s own mapping type where its constructor takes a dict (else a plain dict)."""
    cls: Any = type(batch)  # a Mapping subclass; its constructor is not Mapping's
    if cls is dict:
        return items
    try:
        return cls(items)
    except TypeError:
        return items


def _slice(batch: Any, start: int, stop: int, size: int, path: str) -> Any:
    if isinstance(batch, Tensor):
        return _slice_tensor(batch, start, stop, size, path)
    if isinstance(batch, _PLAIN):
        return batch

    def inner(value: Any, where: str) -> Any:
        return _slice(value, start, stop, size, where)

    if isinstance(batch, Mapping):
        return _same_mapping(batch, {key: inner(value, f"{path}[{key!r}]") for key, value in batch.items()})
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = [f.name for f in dataclasses.fields(batch) if f.init]
        return dataclasses.replace(batch, **{name: inner(getattr(batch, name), f"{path}.{name}") for name in fields})
    if _is_namedtuple(batch):
        return type(batch)(*(inner(v, f"{path}.{name}") for name, v in zip(batch._fields, batch)))
    if _is_flat_sequence(batch):
        return _slice_values(batch, start, stop, size, path)
    if isinstance(batch, (list, tuple)):
        return type(batch)(inner(v, f"{path}[{i}]") for i, v in enumerate(batch))
    raise TypeError(
        f"AutoMicroBatch cannot split `{path}` of type {type(batch).__module__}.{type(batch).__qualname__}: the default"
        " slicer handles tensors, dicts, tuples, lists, namedtuples, dataclasses and lists of plain values." + _OVERRIDE
    )


def slice_batch(batch: Any, start: int, stop: int, size: int | None = None) -> Any:
    """The samples ``[start, stop)`` of ``batch`` (see the module docstring for what is sliced and what is refused).

    Raises:
        TypeError: for a leaf the default slicer cannot split, naming its place in the batch and the override.

    Examples:
        >>> import torch
        >>> part = slice_batch({"x": torch.arange(6), "text": list("abcdef"), "scale": 2.0}, 2, 4)
        >>> part["x"].tolist(), part["text"], part["scale"]
        ([2, 3], ['c', 'd'], 2.0)
    """
    if size is None:
        size = batch_size_of(batch)
    return _slice(batch, start, stop, size, "batch")


def count_samples(batch: Any, batch_size_fn: Callable[[Any], int] | None = None) -> int:
    """The number of samples of ``batch``: ``batch_size_fn(batch)`` if given, else :func:`batch_size_of`.

    Raises:
        ValueError: when that is not a positive int.
    """
    if batch_size_fn is None:
        batch_size_fn = batch_size_of
    size = batch_size_fn(batch)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"AutoMicroBatch: the batch size of a batch must be a positive int, got {size!r}.")
    return size


def micro_batch_of(
    batch: Any, start: int, stop: int, size: int, split_batch_fn: Callable[[Any, int, int], Any] | None = None
) -> Any:
    """The samples ``[start, stop)`` of a batch of ``size``: the batch itself when that is all of it, else
    ``split_batch_fn(batch, start, stop)`` if given, else :func:`slice_batch`.

    Examples:
        >>> import torch
        >>> x = torch.arange(4)
        >>> micro_batch_of(x, 0, 4, 4) is x, micro_batch_of(x, 1, 3, 4).tolist()
        (True, [1, 2])
    """
    if start == 0 and stop == size:
        return batch
    if split_batch_fn is not None:
        return split_batch_fn(batch, start, stop)
    return slice_batch(batch, start, stop, size)


def loader_batch_size(loader: Any) -> int | None:
    """The ``batch_size`` of a DataLoader (or of its batch sampler); ``None`` for anything else.

    Examples:
        >>> from torch.utils.data import DataLoader
        >>> loader_batch_size(DataLoader(range(10), batch_size=4)), loader_batch_size([1, 2])
        (4, None)
    """
    for source in (loader, getattr(loader, "batch_sampler", None)):
        size = getattr(source, "batch_size", None)
        if isinstance(size, int) and not isinstance(size, bool):
            return size
    return None


def check_first_batch(
    batch: Any,
    size: int,
    split_batch_fn: Callable[[Any, int, int], Any] | None = None,
    batch_size_fn: Callable[[Any], int] | None = None,
    expected_size: int | None = None,
) -> str | None:
    """Check, on the first batch, that it can be split: cut one sample off it and count that sample.

    Args:
        batch: the first batch.
        size: its number of samples (:func:`count_samples`).
        split_batch_fn: the user's slicer (``None``: :func:`slice_batch`).
        batch_size_fn: the user's batch-size function (``None``: :func:`batch_size_of`).
        expected_size: the DataLoader's ``batch_size``, if known.

    Returns:
        A warning when the default slicer would split along a first dim that is not the DataLoader's batch size
        (e.g. the time dim of a ``(T, B, F)`` batch), naming the tensor; else ``None``.

    Raises:
        TypeError: the default slicer cannot split the batch (naming the element and the ``split_batch_fn`` fix).
        ValueError: the one-sample slice does not count as one sample.

    Examples:
        >>> import torch
        >>> check_first_batch({"x": torch.zeros(5, 32, 3)}, 5, expected_size=32)[:65]
        "AutoMicroBatch splits batches along the first dim of `batch['x']`"
    """
    if size > 1:
        one = micro_batch_of(batch, 0, 1, size, split_batch_fn)
        counted = count_samples(one, batch_size_fn)
        if counted != 1:
            raise ValueError(
                f"AutoMicroBatch: the first sample of the first batch, cut off by `split_batch_fn`, counts as {counted}"
                " samples by `batch_size_fn`, not 1. `split_batch_fn(batch, start, stop)` must return the samples"
                " [start, stop) and `batch_size_fn(batch)` count them."
            )
    if split_batch_fn is not None or batch_size_fn is not None or expected_size is None or size == expected_size:
        return None
    found = _first_size(batch, "batch")
    where = f"`{found[1]}`" if found is not None else "the batch"
    return (
        f"AutoMicroBatch splits batches along the first dim of {where} ({size} samples in the first batch), but the"
        f" DataLoader's batch_size is {expected_size}. If that dim is not the samples (a time-major (T, B, F)"
        " batch is split along time), pass `AutoMicroBatch(batch_size_fn=fn, split_batch_fn=fn2)`."
    )
