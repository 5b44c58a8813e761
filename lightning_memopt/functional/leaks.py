"""Leak detection: sustained growth over a window of readings, and who holds tensors with autograd history.

Functions that only read what they are given: :func:`detect_growth` judges a window of ``(step, bytes)`` samples;
:func:`grad_fn_holders` walks the attributes of a module for tensors that keep an autograd graph alive;
:func:`metric_states_requiring_grad` finds metric states that hold tensors requiring grad.
"""

from __future__ import annotations

import contextlib
import itertools
import types
from collections.abc import Mapping, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from lightning_memopt.functional.footprint import MODULE_INTERNALS, iter_held_tensors, storage_bytes
from lightning_memopt.functional.footprint.storage import INSPECTION_ERRORS
from lightning_memopt.functional.trend import least_squares_slope

__all__ = [
    "GradFnHolder",
    "Growth",
    "detect_growth",
    "grad_fn_holders",
    "metric_states_requiring_grad",
    "tensors_with_grad_fn",
]


@dataclass(frozen=True)
class Growth:
    """The verdict on a window of ``(step, bytes)`` samples.

    Args:
        growing: Whether the window shows sustained growth above the threshold.
        bytes_per_step: Least-squares slope of bytes over steps (can be negative).
        first_step: The first sampled step at which the rise was seen (the first sample above the one before
            it), ``None`` when nothing rose.
        total_bytes: Last minus first sample.
        rising_fraction: Fraction of consecutive sample pairs in which the value went up.
        num_samples: Samples in the window.
    """

    growing: bool
    bytes_per_step: float
    first_step: int | None
    total_bytes: int
    rising_fraction: float
    num_samples: int


def detect_growth(
    steps: Sequence[int],
    values: Sequence[int | float],
    min_bytes_per_step: float,
    min_rising_fraction: float = 0.8,
    min_samples: int = 3,
) -> Growth:
    """Judge whether ``values`` (bytes at ``steps``) grow steadily by at least ``min_bytes_per_step`` per step.

    Growth is *sustained* when the value rose between at least ``min_rising_fraction`` of consecutive
    samples, the last sample is above the first, and the least-squares slope is at least
    ``min_bytes_per_step``. A one-off jump (a lazily created buffer, optimizer states appearing after the
    first step) rises once and then stays flat, so it is not growth.

    Args:
        steps: Steps of the samples, increasing.
        values: Bytes at those steps.
        min_bytes_per_step: Slope below which growth is ignored.
        min_rising_fraction: Fraction of sample pairs that must rise.
        min_samples: Fewer samples than this are never judged growing.

    Example:
        >>> g = detect_growth([10, 20, 30, 40], [1000, 2000, 3000, 4000], min_bytes_per_step=50)
        >>> g.growing, g.bytes_per_step, g.first_step
        (True, 100.0, 20)
        >>> detect_growth([10, 20, 30, 40], [1000, 5000, 5000, 5000], min_bytes_per_step=50).growing
        False
    """
    if len(steps) != len(values):
        raise ValueError(f"`steps` and `values` must have the same length, got {len(steps)} and {len(values)}.")
    n = len(values)
    if n < 2:
        return Growth(False, 0.0, None, 0, 0.0, n)
    ys = [float(v) for v in values]
    slope = least_squares_slope(steps, ys)
    rises = [ys[i] > ys[i - 1] for i in range(1, n)]
    rising_fraction = sum(rises) / len(rises)
    first = next((int(steps[i]) for i in range(1, n) if rises[i - 1]), None)
    total = int(ys[-1] - ys[0])
    growing = n >= min_samples and total > 0 and rising_fraction >= min_rising_fraction and slope >= min_bytes_per_step
    return Growth(growing, slope, first, total, rising_fraction, n)


@dataclass(frozen=True)
class GradFnHolder:
    """An attribute that holds tensors with autograd history.

    Args:
        path: Where they are, e.g. ``"self.losses"`` or ``"self.head.cache['x']"``.
        num_tensors: How many tensors with a ``grad_fn`` it holds (nested containers included).
        bytes: Their storage bytes (the graphs behind them usually hold much more).
    """

    path: str
    num_tensors: int
    bytes: int


def tensors_with_grad_fn(obj: Any, max_depth: int = 4, max_items: int = 100_000) -> tuple[int, int]:
    """``(count, bytes)`` of tensors with a ``grad_fn`` inside ``obj`` (containers walked to ``max_depth``).

    Example:
        >>> w = torch.ones(2, requires_grad=True)
        >>> tensors_with_grad_fn({"a": [w * 2, w.detach()], "b": (w + 1,)})
        (2, 16)
    """
    count = nbytes = 0
    for _, _, tensor in iter_held_tensors(obj, max_depth=max_depth, max_items=max_items):
        if tensor.grad_fn is not None:
            count += 1
            nbytes += storage_bytes(tensor)
    return count, nbytes


#: Attribute types that hold no tensor: skipped by an exact type test, before any slower check.
_NEVER_HOLD = frozenset(
    {
        bool,
        int,
        float,
        complex,
        str,
        bytes,
        type(None),
        types.FunctionType,
        types.MethodType,
        types.BuiltinFunctionType,
        type,
    }
)
#: Containers that :func:`grad_fn_holders` looks into (a ``deque`` is a ``MutableSequence``).
_WALKED = (list, tuple, set, frozenset, Mapping, MutableSequence)


def _path(prefix: str, module_name: str, attr: str) -> str:
    return f"{prefix}.{module_name}.{attr}" if module_name else f"{prefix}.{attr}"


#: Items of a large container looked at first (this many from each end, at every level); the container is walked in
#: full only when one of them leads to a tensor with autograd history. A growing history is appended at the end; a
#: dataset kept as an attribute (a million token lists) holds none: the first is found, the second costs little.
_SAMPLE_ENDS = 16


def _grad_fn_tensors_sampled(value: Any, max_depth: int) -> tuple[int, int]:
    """``(count, bytes)`` of tensors with a ``grad_fn`` in ``value``, looking at the ends of large containers first."""
    seen: set[int] = set()

    def count(obj: Any, depth: int, sampled: bool) -> tuple[int, int]:
        if isinstance(obj, torch.Tensor):
            return (1, storage_bytes(obj)) if obj.grad_fn is not None else (0, 0)
        if depth >= max_depth or not isinstance(obj, _WALKED) or (not sampled and id(obj) in seen):
            return 0, 0  # (the sampling look-ahead is bounded by the depth and marks nothing as seen)
        try:
            values = obj.values() if isinstance(obj, Mapping) else obj
            if sampled and len(obj) > 2 * _SAMPLE_ENDS:  # look at the ends without copying the container
                if isinstance(values, (list, tuple)):
                    ends = [*values[:_SAMPLE_ENDS], *values[-_SAMPLE_ENDS:]]
                else:
                    ends = [*itertools.islice(values, _SAMPLE_ENDS)]
                    with contextlib.suppress(TypeError):  # sets cannot be reversed: their first items stand for all
                        ends += itertools.islice(reversed(cast(Any, values)), _SAMPLE_ENDS)
                if not any(count(v, depth + 1, True)[0] for v in ends if type(v) not in _NEVER_HOLD):
                    return 0, 0
                sampled = False  # this container leads to one: count all of it
            items = list(values)
        except INSPECTION_ERRORS:  # a container that breaks while being listed
            return 0, 0
        if not sampled:
            seen.add(id(obj))
        total = nbytes = 0
        for v in items:
            if type(v) in _NEVER_HOLD:
                continue
            c, b = count(v, depth + 1, sampled)
            total += c
            nbytes += b
        return total, nbytes

    return count(value, 0, True)


def grad_fn_holders(module: torch.nn.Module, prefix: str = "self", max_depth: int = 4) -> list[GradFnHolder]:
    """Attributes of ``module`` and its submodules that hold tensors with autograd history.

    Looks at every instance attribute (``vars(m)``) of every submodule except the module's own parameters,
    buffers and submodule registries, walking lists, tuples, sets, dicts and deques. Use it when memory
    grows step by step: a loss kept with its graph (``self.losses.append(loss)``) shows up here.

    Args:
        module: The module whose attributes (and its submodules') are searched.
        prefix: How paths start (``"self"``).
        max_depth: How many levels of nested containers are walked (a tensor in a list in a dict is 2 deep).

    Returns:
        Holders, most tensors first.

    Example:
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(2, 1)
        ...         self.losses = []
        >>> net = Net()
        >>> for _ in range(3):
        ...     net.losses.append(net.lin(torch.ones(1, 2)).sum())
        >>> grad_fn_holders(net)
        [GradFnHolder(path='self.losses', num_tensors=3, bytes=12)]
    """
    holders: list[GradFnHolder] = []
    for mod_name, mod in module.named_modules():
        try:
            attributes = list(vars(mod).items())
        except TypeError:
            continue
        for attr, value in attributes:
            # Cheap tests first: this runs on every leak interval, over every attribute of every submodule.
            if attr in MODULE_INTERNALS or type(value) in _NEVER_HOLD:
                continue
            if isinstance(value, torch.Tensor):
                if value.grad_fn is not None:
                    holders.append(GradFnHolder(_path(prefix, mod_name, attr), 1, storage_bytes(value)))
                continue
            if not isinstance(value, _WALKED) or not value:  # scalars, functions, empty hook dicts, ...
                continue
            if attr == "_trainer" or attr.endswith("_hooks") or attr.startswith(("_forward", "_backward")):
                continue
            count, nbytes = _grad_fn_tensors_sampled(value, max_depth)
            if count:
                holders.append(GradFnHolder(_path(prefix, mod_name, attr), count, nbytes))
    return sorted(holders, key=lambda h: (-h.num_tensors, h.path))


def metric_states_requiring_grad(module: torch.nn.Module, prefix: str = "self") -> list[str]:
    """Names of metric states (torchmetrics ``add_state``) in ``module`` that hold tensors requiring grad.

    Such a state keeps the autograd graph of every ``update`` alive until ``reset``: pass detached
    predictions to ``update`` (``preds.detach()``).

    Example:
        >>> class Fake(torch.nn.Module):  # looks like a torchmetrics Metric
        ...     def __init__(self):
        ...         super().__init__()
        ...         self._defaults = {"preds": []}
        ...         self.preds = [torch.ones(1, requires_grad=True) * 2]
        >>> metric_states_requiring_grad(torch.nn.ModuleDict({"acc": Fake()}))
        ['self.acc.preds']
    """
    found: list[str] = []
    for mod_name, mod in module.named_modules():
        defaults = getattr(mod, "_defaults", None)
        if not isinstance(defaults, Mapping):
            continue
        for state in defaults:
            try:
                value = getattr(mod, state)
            except INSPECTION_ERRORS:  # a state that breaks while being read: not one that holds grad
                continue
            values = value if isinstance(value, (list, tuple)) else [value]
            if any(isinstance(v, torch.Tensor) and v.requires_grad for v in values):
                found.append(f"{prefix}.{mod_name}.{state}" if mod_name else f"{prefix}.{state}")
    return found
