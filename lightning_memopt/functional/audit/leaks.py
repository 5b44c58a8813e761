"""Leak detection: sustained growth over a window of samples, who holds tensors with autograd history, and the
samples taken during a fit.

:func:`detect_growth` judges a window of ``(step, bytes)`` samples; :func:`grad_fn_holders` walks the attributes of a
module for tensors that keep an autograd graph alive; :func:`metric_states_requiring_grad` finds metric states that
hold tensors requiring grad. Two watches keep the windows across a fit, on the same steps: :class:`HolderWatch`
(attributes of the module holding more tensors with autograd history at every sample: cheap, on every device) and
:class:`LeakSampler` (the bytes of the device, or on CPU of the live tensors, found by walking every Python object:
the walk is held to a fraction of training time). Both are given their clock and object walk, so tests drive them
with fakes.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
import types
from collections import deque
from collections.abc import Callable, Mapping, MutableSequence, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from lightning_memopt.functional.footprint import (
    MODULE_INTERNALS,
    LiveTensor,
    StorageKey,
    iter_held_tensors,
    live_tensors,
    storage_bytes,
)
from lightning_memopt.functional.footprint.storage import INSPECTION_ERRORS
from lightning_memopt.utilities.formatting import format_bytes

__all__ = [
    "LEAK_CAUSES",
    "GradFnHolder",
    "Growth",
    "HolderLeak",
    "HolderWatch",
    "LeakSampler",
    "detect_growth",
    "grad_fn_holders",
    "growth_message",
    "leak_message",
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

    Examples:
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
    try:
        slope = statistics.linear_regression([float(x) for x in steps], ys).slope
    except statistics.StatisticsError:  # every sample at one step: no trend
        slope = 0.0
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

    Examples:
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


def _container_ends(values: Any) -> list[Any]:
    """The first and last :data:`_SAMPLE_ENDS` items of a large container, without copying it (sets have no end:
    their first items stand for all)."""
    if isinstance(values, (list, tuple)):
        return [*values[:_SAMPLE_ENDS], *values[-_SAMPLE_ENDS:]]
    ends = [*itertools.islice(values, _SAMPLE_ENDS)]
    with contextlib.suppress(TypeError):  # sets cannot be reversed
        ends += itertools.islice(reversed(cast(Any, values)), _SAMPLE_ENDS)
    return ends


def _grad_fn_tensor(tensor: torch.Tensor) -> tuple[int, int]:
    """``(1, bytes)`` for a tensor with a ``grad_fn``, ``(0, 0)`` for one without."""
    if tensor.grad_fn is not None:
        return 1, storage_bytes(tensor)
    return 0, 0


def _walked_values(obj: Any) -> Any:
    """The values of a mapping, any other container itself."""
    if isinstance(obj, Mapping):
        return obj.values()
    return obj


def _grad_fn_tensors_sampled(value: Any, max_depth: int) -> tuple[int, int]:
    """``(count, bytes)`` of tensors with a ``grad_fn`` in ``value``, looking at the ends of large containers first."""
    seen: set[int] = set()

    def count(obj: Any, depth: int, sampled: bool) -> tuple[int, int]:
        if isinstance(obj, torch.Tensor):
            return _grad_fn_tensor(obj)
        if depth >= max_depth or not isinstance(obj, _WALKED) or (not sampled and id(obj) in seen):
            return 0, 0  # (the sampling look-ahead is bounded by the depth and marks nothing as seen)
        try:
            values = _walked_values(obj)
            if sampled and len(obj) > 2 * _SAMPLE_ENDS:  # look at the ends first
                ends = _container_ends(values)
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
            if type(v) not in _NEVER_HOLD:
                c, b = count(v, depth + 1, sampled)
                total, nbytes = total + c, nbytes + b
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

    Examples:
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

    Examples:
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


#: The usual causes of a leak, named in every leak warning.
LEAK_CAUSES = (
    "tensors with autograd history kept in a list or attribute (e.g. `self.losses.append(loss)`; append"
    " `loss.detach()`), an undetached loss or output logged or stored outside `self.log`, or outputs accumulated"
    " across steps (keep `.detach().cpu()` copies and clear them at epoch end)"
)

Walk = Callable[..., list[LiveTensor]]


class LeakSampler:
    """Memory samples over the last ``window`` leak checks, the time budget of the object walks, and the verdict.

    On a device with allocator readings a sample is the allocated bytes (microseconds). On CPU it is the bytes of
    the live CPU tensors, one walk over every Python object (``walk``, :func:`live_tensors` by default): a sample that
    is due waits (:meth:`due`) until the training time since the last walk is at least the last walk's time divided
    by ``max_overhead``, so the walks cost at most that fraction of training.

    Args:
        window: Samples judged together (at least 3).
        min_bytes_per_step: Growth per step below which nothing is reported.
        max_overhead: Fraction of training time the walks may take; ``None``: no budget.
        clock: Seconds, increasing (``time.perf_counter``).
        walk: ``walk(device, names=...)`` -> live tensors (``live_tensors``).

    Raises:
        ValueError: if ``window`` is below 3 or ``min_bytes_per_step`` is not a positive int.

    Examples:
        >>> now = [0.0]
        >>> sampler = LeakSampler(3, 1, 0.5, clock=lambda: now[0], walk=lambda device, names=None: [])
        >>> sampler.restart(); _ = sampler.timed_walk("cpu")
        >>> sampler.due(has_device_memory=False), sampler.due(has_device_memory=True)
        (True, True)
        >>> [sampler.add(step, 100 * step) for step in (1, 2, 3)][-1].bytes_per_step
        100.0
    """

    def __init__(
        self,
        window: int,
        min_bytes_per_step: int,
        max_overhead: float | None,
        clock: Callable[[], float] = time.perf_counter,
        walk: Walk = live_tensors,
    ) -> None:
        if window < 3:
            raise ValueError(f"`leak_window` must be at least 3 samples, got {window}: growth needs a trend.")
        if not isinstance(min_bytes_per_step, int) or isinstance(min_bytes_per_step, bool) or min_bytes_per_step < 1:
            raise ValueError(
                f"`leak_min_bytes_per_step` must be a positive int (bytes per optimizer step), got"
                f" {min_bytes_per_step!r}. Use 1 to report any sustained growth, 16384 to ignore less than"
                " 16 KiB per step."
            )
        self.window = window
        self.min_bytes_per_step = min_bytes_per_step
        self.max_overhead = max_overhead
        self.clock = clock
        self.walk = walk
        self.samples: deque[tuple[int, int]] = deque(maxlen=window)
        self._last_walk_end = 0.0
        self._walk_s: float | None = None

    def restart(self) -> None:
        """Start the time budget afresh (at fit start): the next walk is free to measure."""
        self._last_walk_end = self.clock()
        self._walk_s = None

    def timed_walk(self, device: torch.device | str, names: Mapping[StorageKey, str] | None = None) -> list[LiveTensor]:
        """The live tensors on ``device`` (one walk); its time counts for the budget."""
        start = self.clock()
        try:
            return self.walk(device, names=names)
        finally:
            self._last_walk_end = self.clock()
            self._walk_s = self._last_walk_end - start

    def due(self, has_device_memory: bool) -> bool:
        """Whether a sample may walk the objects now (always with allocator readings or without a budget)."""
        if has_device_memory or self.max_overhead is None or self._walk_s is None:
            return True
        return self._walk_s <= self.max_overhead * (self.clock() - self._last_walk_end)

    def live_bytes(self, device: torch.device | str) -> int:
        """One CPU sample: the bytes of the live tensors on ``device`` (a timed walk)."""
        return sum(t.bytes for t in self.timed_walk(device))

    def add(self, step: int, value: int) -> Growth | None:
        """Add a sample; the growth verdict once the window is full and the samples grow, else ``None``."""
        self.samples.append((step, int(value)))
        if len(self.samples) < self.window:
            return None
        steps, values = zip(*self.samples)
        growth = detect_growth(steps, values, self.min_bytes_per_step)
        return growth if growth.growing else None


class HolderLeak:
    """An attribute that held more tensors with autograd history at every sample of a window."""

    def __init__(self, holder: GradFnHolder, growth: Growth, steps: list[int], counts: list[int], sizes: list[int]):
        self.holder, self.growth, self.steps, self.counts, self.sizes = holder, growth, steps, counts, sizes

    def describe(self) -> str:
        """What grows, in one sentence (the start of the warning)."""
        per_step = (self.counts[-1] - self.counts[0]) / max(self.steps[-1] - self.steps[0], 1)
        return (
            f"{self.holder.path} holds more tensors with autograd history at every sample ({self.counts[0]} at step"
            f" {self.steps[0]}, {self.counts[-1]} at step {self.steps[-1]}: {per_step:.2g} per optimizer step,"
            f" {format_bytes(self.sizes[-1])} of tensors plus the graphs they keep alive)."
        )


class HolderWatch:
    """The attributes holding tensors with autograd history (:func:`grad_fn_holders`) over the last ``window`` samples.

    Examples:
        >>> watch = HolderWatch(3)
        >>> [watch.add(s, [GradFnHolder("self.losses", s, 4 * s)]) for s in (1, 2)]
        [None, None]
        >>> watch.add(3, [GradFnHolder("self.losses", 3, 12)]).describe()[:40]
        'self.losses holds more tensors with auto'
    """

    def __init__(self, window: int) -> None:
        self.window = window
        self.samples: deque[tuple[int, dict[str, tuple[int, int]]]] = deque(maxlen=window)

    def add(self, step: int, holders: Sequence[GradFnHolder]) -> HolderLeak | None:
        """Add a sample; the first attribute whose count of tensors with a ``grad_fn`` grows steadily, if any."""
        self.samples.append((step, {h.path: (h.num_tensors, h.bytes) for h in holders}))
        if len(self.samples) < self.window:
            return None
        steps = [s for s, _ in self.samples]
        for holder in holders:
            counts = [sample.get(holder.path, (0, 0))[0] for _, sample in self.samples]
            if not detect_growth(steps, counts, min_bytes_per_step=1e-9).growing:
                continue
            sizes = [sample.get(holder.path, (0, 0))[1] for _, sample in self.samples]
            return HolderLeak(holder, detect_growth(steps, sizes, min_bytes_per_step=0.0), steps, counts, sizes)
        return None


def growth_message(growth: Growth, steps: Sequence[int], device: torch.device | str, allocated: bool) -> str:
    """What grows when the memory samples do, in one sentence (the start of the warning)."""
    kind = "allocated" if allocated else "live tensor"
    return (
        f"{kind.capitalize()} memory on {device} grows by {format_bytes(growth.bytes_per_step)} per"
        f" optimizer step ({int(growth.bytes_per_step)} bytes/step, {format_bytes(growth.total_bytes)} over"
        f" steps {steps[0]}-{steps[-1]}), first seen at step {growth.first_step}."
    )


def leak_message(rank: int, what: str, holders: Sequence[GradFnHolder]) -> str:
    """The leak warning: ``what`` grows, the attributes holding tensors with autograd history, the usual causes.

    Examples:
        >>> leak_message(0, "X grows.", [])[:60]
        'MemoryAudit [rank 0]: X grows. No attribute of the Lightning'
    """
    where = "No attribute of the LightningModule holds tensors with autograd history."
    if holders:
        where = (
            "Attributes holding tensors with autograd history: "
            + "; ".join(f"{h.path} ({h.num_tensors} tensors with grad_fn)" for h in holders[:5])
            + "."
        )
    return f"MemoryAudit [rank {rank}]: {what} {where} Usual causes: {LEAK_CAUSES}."
