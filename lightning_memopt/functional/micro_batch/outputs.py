"""Put the outputs of a batch's micro-batches back together: what the hooks of the whole batch see.

A step run once per micro-batch returns one output per micro-batch; ``on_train_batch_end``,
``on_validation_batch_end``, ``on_test_batch_end``, ``predict_step``'s collected predictions and
``BasePredictionWriter`` expect one per loader batch. :func:`combine_outputs` makes it, leaf by leaf:

* a tensor whose first dim is the micro-batch's number of samples (per-sample outputs, predictions): concatenated;
* a list or tuple of plain values, one per sample (ids, texts): concatenated;
* an integer tensor of any other shape, or an int: the sum (counts add up);
* any other value equal in every micro-batch (a string, ``None``, a float or tensor that does not depend on the
  samples): passed on once;
* a floating tensor of any other shape (a 0-dim mean loss, a per-class vector) or a float: the mean weighted by the
  micro-batches' numbers of samples, the batch's mean;
* dicts, lists, tuples, namedtuples and dataclasses: combined field by field (the first micro-batch's structure);
* anything else: the list of the micro-batches' values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["combine_outputs"]

_PLAIN = (str, bytes, int, float, complex, bool, type(None))
_COUNTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def combine_outputs(parts: Sequence[tuple[int, Any]]) -> Any:
    """One output for the whole batch from ``(samples, output)`` of each micro-batch, in order.

    One micro-batch: its output, unchanged (the same object).

    Examples:
        >>> a = {"preds": torch.tensor([1, 2]), "loss": torch.tensor(1.0), "correct": 2, "name": "val"}
        >>> b = {"preds": torch.tensor([3]), "loss": torch.tensor(4.0), "correct": 0, "name": "val"}
        >>> out = combine_outputs([(2, a), (1, b)])
        >>> out["preds"].tolist(), out["loss"].item(), out["correct"], out["name"]
        ([1, 2, 3], 2.0, 2, 'val')
    """
    if len(parts) == 1:
        return parts[0][1]
    samples = [n for n, _ in parts]
    return _combine([out for _, out in parts], samples)


def _combine(values: list[Any], samples: list[int]) -> Any:
    first = values[0]
    if isinstance(first, Tensor):
        return _combine_tensors(values, samples)
    if _all_equal(values):
        return first
    if isinstance(first, Mapping) and all(isinstance(v, Mapping) and v.keys() == first.keys() for v in values):
        items = {key: _combine([v[key] for v in values], samples) for key in first}
        if type(first) is dict:
            return items
        return _rebuild(type(first), items)
    if dataclasses.is_dataclass(first) and not isinstance(first, type) and _same_type(values):
        names = [f.name for f in dataclasses.fields(first) if f.init]
        combined = {name: _combine([getattr(v, name) for v in values], samples) for name in names}
        return dataclasses.replace(first, **combined)
    if isinstance(first, (list, tuple)) and _same_type(values):
        return _combine_sequences(values, samples)
    return _combine_plain(values, samples)


def _combine_sequences(values: list[Any], samples: list[int]) -> Any:
    first = values[0]
    if _per_sample(values, samples):  # one plain value per sample: ids, texts
        return type(first)(item for value in values for item in value)
    if all(len(v) == len(first) for v in values):
        combined = [_combine([v[i] for v in values], samples) for i in range(len(first))]
        if hasattr(first, "_fields"):  # a namedtuple
            return type(first)(*combined)
        return type(first)(combined)
    return list(values)


def _combine_tensors(values: list[Any], samples: list[int]) -> Any:
    if not all(isinstance(v, Tensor) for v in values):
        return list(values)
    if all(v.dim() > 0 and v.shape[0] == n for v, n in zip(values, samples)):
        return torch.cat(values)
    if not all(v.shape == values[0].shape and v.dtype == values[0].dtype for v in values):
        return list(values)
    if values[0].dtype in _COUNTS:
        return sum(values[1:], values[0])
    if all(torch.equal(v, values[0]) for v in values[1:]):
        return values[0]
    if values[0].is_floating_point() or values[0].is_complex():
        total = sum(samples)
        return sum(v * (n / total) for v, n in zip(values, samples))
    return list(values)


def _combine_plain(values: list[Any], samples: list[int]) -> Any:
    if all(_is_int(v) for v in values):
        return sum(values)
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        total = sum(samples)
        return sum(v * n for v, n in zip(values, samples)) / total
    return list(values)


def _all_equal(values: list[Any]) -> bool:
    first = values[0]
    if not isinstance(first, _PLAIN) or _is_int(first):  # counts add up even when equal
        return False
    return all(type(v) is type(first) and v == first for v in values[1:])


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _same_type(values: list[Any]) -> bool:
    return all(type(v) is type(values[0]) for v in values)


def _per_sample(values: list[Any], samples: list[int]) -> bool:
    return all(len(v) == n and all(isinstance(item, _PLAIN) for item in v) for v, n in zip(values, samples)) and any(
        len(v) > 0 for v in values
    )


def _rebuild(cls: Any, items: dict) -> Any:
    """``items`` in the mapping type ``cls`` where its constructor takes a dict (else a plain dict)."""
    try:
        return cls(items)
    except TypeError:
        return items
