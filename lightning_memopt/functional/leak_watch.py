"""The Trainer-free core of ``MemoryAudit``'s leak detection: samples over a window, their time budget, the verdict.

Two watches run on the same steps: :class:`HolderWatch` (attributes of the module holding more tensors with
autograd history at every sample: cheap, on every device) and :class:`LeakSampler` (the bytes of the device, or on
CPU of the live tensors, found by walking every Python object: the walk is held to a fraction of training time).
Both are given their clock and object walk, so tests drive them with fakes.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import torch

from lightning_memopt.functional.footprint import LiveTensor, StorageKey, live_tensors
from lightning_memopt.functional.leaks import GradFnHolder, Growth, detect_growth
from lightning_memopt.utilities.formatting import format_bytes

__all__ = ["LEAK_CAUSES", "HolderLeak", "HolderWatch", "LeakSampler", "growth_message", "leak_message"]

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

    Example:
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

    Example:
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

    Example:
        >>> leak_message(0, "X grows.", [])[:60]
        'MemoryAudit [rank 0]: X grows. No attribute of the Lightning'
    """
    where = (
        "Attributes holding tensors with autograd history: "
        + "; ".join(f"{h.path} ({h.num_tensors} tensors with grad_fn)" for h in holders[:5])
        + "."
        if holders
        else "No attribute of the LightningModule holds tensors with autograd history."
    )
    return f"MemoryAudit [rank {rank}]: {what} {where} Usual causes: {LEAK_CAUSES}."
