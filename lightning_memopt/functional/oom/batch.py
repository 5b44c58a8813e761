"""Shapes, dtypes, devices and sizes of the tensors in a batch of any nesting."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from lightning_memopt.functional.oom.schema import BatchLengths, BatchSection, BatchTensor

__all__ = ["batch_lengths", "batch_padding", "describe_batch", "mask_lengths"]

_MAX_BATCH_TENSORS = 32
#: Per-sample lengths listed in a report, and the largest mask read (elements) for them.
_MAX_LENGTHS, _MAX_MASK_ELEMENTS = 64, 1 << 24
_MAX_DEPTH = 6
#: What a tensor subclass that cannot describe itself raises; such a tensor is left out (or counted as 0 bytes).
_DESCRIBE_ERRORS = (RuntimeError, TypeError, ValueError, AttributeError)


def _tensor_bytes(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.numel() * tensor.element_size())
    except _DESCRIBE_ERRORS:
        return 0


def _walk(obj: Any, path: str, depth: int, out: list[tuple[str, torch.Tensor]], seen: set[int]) -> int:
    """Collect (path, tensor) pairs; returns how many tensors exist (counted past the limit too)."""
    if isinstance(obj, torch.Tensor):
        if len(out) < _MAX_BATCH_TENSORS:
            out.append((path, obj))
        return 1
    if depth >= _MAX_DEPTH or id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return 0
    seen.add(id(obj))
    count = 0
    if isinstance(obj, Mapping):
        for key, value in list(obj.items())[:1000]:
            count += _walk(value, f"{path}[{key!r}]", depth + 1, out, seen)
    elif isinstance(obj, (list, tuple)):
        fields = getattr(obj, "_fields", None)  # namedtuple
        for i, value in enumerate(list(obj)[:1000]):
            name = f"{path}.{fields[i]}" if fields and i < len(fields) else f"{path}[{i}]"
            count += _walk(value, name, depth + 1, out, seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            count += _walk(getattr(obj, field.name, None), f"{path}.{field.name}", depth + 1, out, seen)
    return count


def describe_batch(batch: Any, name: str = "batch") -> BatchSection:
    """Shapes, dtypes, devices and sizes of the tensors in ``batch`` (tensors, mappings, sequences, dataclasses).

    At most 32 tensors are listed; ``num_tensors`` counts all of them. ``micro_batch_size`` is the first
    dimension of the first tensor with one (``None`` when no tensor has a dimension). ``lengths`` (only where the
    batch has padding masks) is :func:`batch_lengths`. The keys are those of
    :class:`~lightning_memopt.functional.oom.schema.BatchSection` (without ``found_in``).

    Examples:
        >>> d = describe_batch({"x": torch.zeros(8, 3), "y": torch.zeros(8, dtype=torch.long)})
        >>> d["tensors"][0]
        {'path': "batch['x']", 'shape': [8, 3], 'dtype': 'torch.float32', 'device': 'cpu', 'bytes': 96}
        >>> d["num_tensors"], d["bytes"], d["micro_batch_size"]
        (2, 160, 8)
    """
    found: list[tuple[str, torch.Tensor]] = []
    total = _walk(batch, name, 0, found, set())
    tensors: list[BatchTensor] = []
    for path, tensor in found:
        try:
            tensors.append(
                {
                    "path": path,
                    "shape": list(tensor.shape),
                    "dtype": str(tensor.dtype),
                    "device": str(tensor.device),
                    "bytes": _tensor_bytes(tensor),
                }
            )
        except _DESCRIBE_ERRORS:  # a tensor subclass that cannot describe itself
            continue
    micro = next((t["shape"][0] for t in tensors if t["shape"]), None)
    section: BatchSection = {
        "type": type(batch).__name__,
        "tensors": tensors,
        "num_tensors": total,
        "truncated": total > len(tensors),
        "bytes": sum(t["bytes"] for t in tensors),
        "micro_batch_size": micro,
    }
    lengths = batch_lengths(found)
    if lengths:  # only where the batch has padding masks
        section["lengths"] = lengths
    return section


def mask_lengths(path: str, mask: Any) -> list[BatchLengths]:
    """:func:`batch_lengths` of one padding mask (``[samples, padded length]``, nonzero where a position is real),
    as ``OOMReporter(lengths_fn=...)`` returns it for a batch without masks of its own.

    Examples:
        >>> mask_lengths("lengths_fn(batch)", torch.tensor([[1, 1, 0], [1, 0, 0]]))[0]["lengths"]
        [2, 1]
    """
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise TypeError(f"a padding mask must be a 2-D tensor [samples, padded length], got {type(mask).__name__}")
    return batch_lengths([(path, (mask.detach() != 0).to(torch.int8))], masks_only=False)


def _sample_lengths(path: str, tensor: torch.Tensor, masks_only: bool = True) -> torch.Tensor | None:
    """Per-sample lengths from a 2-D padding mask (a name ending in ``mask``: ones where a token is) or labels padded
    with -100 (a name holding ``labels``); ``None`` for any other tensor. Read on the host: nothing is allocated on
    the device that ran out of memory."""
    name = path.rstrip("]'\"").lower()
    if tensor.dim() != 2 or tensor.numel() > _MAX_MASK_ELEMENTS or tensor.is_floating_point():
        return None
    if name.endswith("mask") or not masks_only:
        return (tensor.detach().to("cpu") != 0).sum(1)
    if "labels" in name:
        return (tensor.detach().to("cpu") != -100).sum(1)
    return None


def batch_lengths(tensors: list[tuple[str, torch.Tensor]], masks_only: bool = True) -> list[BatchLengths]:
    """What the padding masks among ``tensors`` say of the samples' lengths: how long the batch is padded, its longest
    and median sample, the share of padding. Counts only, no data values. ``masks_only=False`` reads every 2-D
    integer or boolean tensor as a mask.

    Examples:
        >>> mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
        >>> found = batch_lengths([("batch['attention_mask']", mask)])[0]
        >>> found["padded_to"], found["longest"], found["padding_share"], found["lengths"]
        (4, 3, 0.375, [2, 3])
    """
    out: list[BatchLengths] = []
    for path, tensor in tensors:
        try:
            lengths = _sample_lengths(path, tensor, masks_only)
        except _DESCRIBE_ERRORS:
            continue
        if lengths is None or lengths.numel() == 0:
            continue
        padded_to = int(tensor.shape[1])
        values = sorted(int(v) for v in lengths.tolist())
        out.append(
            {
                "path": path,
                "samples": len(values),
                "padded_to": padded_to,
                "longest": values[-1],
                "shortest": values[0],
                "median": values[len(values) // 2],
                "padding_share": 1 - sum(values) / (len(values) * padded_to) if padded_to else 0.0,
                "lengths": [int(v) for v in lengths.tolist()[:_MAX_LENGTHS]],
            }
        )
    return out


def batch_padding(batch: Any) -> list[BatchLengths]:
    """:func:`batch_lengths` of the tensors in ``batch`` (any nesting, as :func:`describe_batch` walks it).

    Examples:
        >>> batch_padding({"attention_mask": torch.tensor([[1, 0], [1, 1]])})[0]["padding_share"]
        0.25
    """
    found: list[tuple[str, torch.Tensor]] = []
    _walk(batch, "batch", 0, found, set())
    return batch_lengths(found)
