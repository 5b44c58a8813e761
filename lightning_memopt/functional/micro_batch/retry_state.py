"""What a failed attempt of a batch changes besides gradients, kept before the first attempt and put back for a retry.

No Trainer here. :func:`collect_rng_states` / :func:`set_rng_states` keep the random number generators (torch CPU,
every initialised accelerator generator, Python's ``random`` and NumPy's global generator when NumPy is imported),
:class:`MetricStates` the states of ``torchmetrics`` metrics (Lightning's logged results are metrics too),
:class:`BufferKeeper` the module's buffers, and :class:`RetrySnapshot` all of them for one batch.

Buffers are kept without copying the ones that batches do not change: every buffer is copied (to host memory) before
the first batch that may be retried; once a batch went through, the buffers whose contents it changed (BatchNorm's
running statistics and counter) are learned, and later batches copy only those. A buffer an attempt replaced by
another tensor is put back without a copy. A buffer not copied that an attempt changed in place is named by
:meth:`RetrySnapshot.restore` when its version counter shows it (and copied from then on); one changed by a kernel
that does not move the counter (as BatchNorm's does not) is not seen: such buffers are caught only by the first
batch's comparison.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterable, MutableMapping
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import is_lazy
from torchmetrics import Metric

from lightning_memopt.utilities._torch_private import tensor_version

__all__ = [
    "BufferKeeper",
    "LazyInits",
    "MetricStates",
    "ModuleParts",
    "RetrySnapshot",
    "RngStates",
    "collect_rng_states",
    "find_parts",
    "set_rng_states",
]

#: Accelerator modules of torch whose generators are kept once they are initialised.
_ACCELERATORS = ("cuda", "xpu")


class RngStates(NamedTuple):
    """The global random states of one process (what :func:`collect_rng_states` returns)."""

    torch: Tensor
    accelerators: dict[str, list[Tensor]]
    python: Any
    numpy: Any


def _initialised_accelerators() -> list[tuple[str, Any]]:
    """The torch accelerator modules with an initialised runtime (none is initialised by asking)."""
    found = []
    for name in _ACCELERATORS:
        module = getattr(torch, name, None)
        is_initialized = getattr(module, "is_initialized", None)
        if is_initialized is not None and is_initialized() and hasattr(module, "get_rng_state_all"):
            found.append((name, module))
    return found


def collect_rng_states() -> RngStates:
    """The global random states: torch's CPU generator, every generator of each initialised accelerator (CUDA, XPU),
    Python's ``random`` and, when NumPy is imported, ``numpy.random``'s global generator.

    Examples:
        >>> states = collect_rng_states()
        >>> a = torch.rand(2)
        >>> set_rng_states(states)
        >>> torch.equal(torch.rand(2), a)
        True
    """
    numpy = sys.modules.get("numpy")
    return RngStates(
        torch=torch.get_rng_state(),
        accelerators={name: module.get_rng_state_all() for name, module in _initialised_accelerators()},
        python=random.getstate(),
        numpy=_numpy_rng_state(numpy),
    )


def _numpy_rng_state(numpy: Any) -> Any:
    """NumPy's global random state; ``None`` when NumPy is not imported (``numpy`` is ``None``)."""
    if numpy is None:
        return None
    return numpy.random.get_state()


def set_rng_states(states: RngStates) -> None:
    """Put back the random states of :func:`collect_rng_states`."""
    torch.set_rng_state(states.torch)
    for name, saved in states.accelerators.items():
        getattr(torch, name).set_rng_state_all(saved)
    random.setstate(states.python)
    numpy = sys.modules.get("numpy")
    if numpy is not None and states.numpy is not None:
        numpy.random.set_state(states.numpy)


def _copy_state(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach().clone()
    if isinstance(value, list):  # list states grow by appending: the tensors in them are not changed in place
        return list(value)
    return value


class MetricStates:
    """The states of ``torchmetrics`` metrics (``metric.metric_state``) and their update bookkeeping, kept to put
    back.

    Examples:
        >>> from torchmetrics import SumMetric
        >>> total = SumMetric()
        >>> total.update(torch.tensor(2.0))
        >>> kept = MetricStates([total])
        >>> total.update(torch.tensor(5.0))
        >>> kept.restore()
        >>> total.compute().item(), total.update_count
        (2.0, 1)
    """

    _EXTRA = ("_update_count", "_computed", "_forward_cache")

    def __init__(self, metrics: Iterable[Metric]) -> None:
        self._kept = [
            (
                metric,
                {name: _copy_state(value) for name, value in metric.metric_state.items()},
                {name: getattr(metric, name) for name in self._EXTRA if hasattr(metric, name)},
            )
            for metric in metrics
        ]

    def restore(self) -> None:
        """Put every state back (fresh copies, so that it can be done again after a second failed attempt)."""
        for metric, states, extra in self._kept:
            for name, value in states.items():
                setattr(metric, name, _copy_state(value))
            for name, value in extra.items():
                setattr(metric, name, value)


class ModuleParts(NamedTuple):
    """What a snapshot keeps of a module, found by one walk of its submodules (:func:`find_parts`)."""

    metrics: list[Metric]
    buffers: list[tuple[nn.Module, str, str]]  # (owner, attribute name, dotted name)
    lazy: list[nn.Module]  # lazy modules not materialised yet


def find_parts(module: nn.Module) -> ModuleParts:
    """The ``torchmetrics`` metrics among ``module``'s submodules and the places of its buffers.

    One walk costs about 1 ms on a 12-layer BERT (231 submodules); ``AutoMicroBatch`` walks until a batch went through,
    then reuses the parts found after it (lazy modules are materialised by then).

    Examples:
        >>> parts = find_parts(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
        >>> parts.metrics, [key for _, _, key in parts.buffers], parts.lazy
        ([], ['1.running_mean', '1.running_var', '1.num_batches_tracked'], [])
    """
    metrics, places, lazy = [], [], []
    for prefix, owner in module.named_modules():
        if isinstance(owner, Metric):
            metrics.append(owner)
        if _is_lazy_module(owner):
            lazy.append(owner)
        for name, _ in owner.named_buffers(recurse=False):
            places.append((owner, name, f"{prefix}.{name}" if prefix else name))
    return ModuleParts(metrics, places, lazy)


def _is_lazy_module(module: nn.Module) -> bool:
    """A lazy module (``nn.LazyLinear``, ...) not materialised yet (once materialised it is of another class)."""
    return isinstance(module, LazyModuleMixin) and any(
        is_lazy(t) for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))
    )


def _tracks_running_stats(module: nn.Module) -> bool:
    """A normalisation layer that keeps running statistics (BatchNorm, SyncBatchNorm, InstanceNorm with tracking): its
    kernels change them without moving their version counters, so its buffers are always copied."""
    return bool(getattr(module, "track_running_stats", False)) and hasattr(module, "running_mean")


class LazyInits:
    """Lazy modules (``nn.LazyLinear``, ...) not materialised before a batch, initialised again where a retry reaches
    them.

    A failed attempt that materialises a lazy module draws its initial values from the random state at that point of
    the attempt; the retry starts from the batch's random state with the module already materialised, so it would draw
    nothing there and every later random number (dropout) would shift. :meth:`arm` gives each module materialised
    since a one-shot forward pre-hook that runs its ``reset_parameters()`` (what its materialisation ran): the retry
    draws its initial values at the point a run at the retry's micro-batch does.
    """

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self._modules = [m for m in modules if _is_lazy_module(m)]
        self._handles: dict[int, Any] = {}

    def arm(self) -> None:
        """After a failed attempt: each module it materialised initialises again at its next forward."""
        for module in self._modules:
            if not _is_lazy_module(module) and id(module) not in self._handles:
                self._handles[id(module)] = module.register_forward_pre_hook(self._initialise)

    def _initialise(self, module: nn.Module, args: Any) -> None:
        self._handles.pop(id(module)).remove()
        with torch.no_grad():
            module.reset_parameters()  # type: ignore[operator]  # what materialising it ran

    def disarm(self) -> None:
        """The batch went through: no module initialises again."""
        for handle in self._handles.values():
            handle.remove()
        self._handles.clear()


class _Buffer(NamedTuple):
    owner: nn.Module
    name: str
    key: str
    tensor: Tensor
    version: int | None
    copy: Tensor | None


#: Buffers of at least this many bytes that change in place are kept in host memory, not on their device.
HOST_COPY_BYTES = 2**20


class BufferKeeper:
    """Keeps a module's buffers before a batch, learning which buffers batches change (see the module docstring).

    The copies are made into tensors kept for the whole fit (one per buffer, reused by every batch): after the first
    batch, keeping costs a copy of the changing buffers and no allocation. A buffer of :data:`HOST_COPY_BYTES` or more
    (a MoCo-style queue) is kept in host memory (pinned under CUDA, copied without waiting), so that keeping it never
    adds its size to the device's peak; smaller ones (BatchNorm statistics) on their device.
    """

    def __init__(self) -> None:
        #: Buffers seen changing in place; ``None`` until a batch went through (every buffer is copied).
        self.changing: set[str] | None = None
        self._copies: dict[str, Tensor] = {}  # the reused copy of each buffer, by dotted name

    def _copy(self, key: str, tensor: Tensor) -> Tensor:
        """``tensor``'s values in the reused copy for ``key`` (made again when the buffer's shape, dtype or device
        changed)."""
        copy = self._copies.get(key)
        host = tensor.numel() * tensor.element_size() >= HOST_COPY_BYTES or tensor.device.type == "cpu"
        device = tensor.device
        if host:
            device = torch.device("cpu")
        if copy is None or copy.shape != tensor.shape or copy.dtype != tensor.dtype or copy.device != device:
            pin = host and tensor.device.type == "cuda"
            copy = torch.empty(tensor.shape, dtype=tensor.dtype, device=device, pin_memory=pin)
            self._copies[key] = copy
        with torch.no_grad():
            copy.copy_(tensor.detach(), non_blocking=copy.is_pinned())
        return copy

    def copied_bytes(self) -> int:
        """Bytes of the copies kept for the fit (what keeping the buffers holds, in host memory and on devices)."""
        return sum(copy.numel() * copy.element_size() for copy in self._copies.values())

    def keep(self, places: Iterable[tuple[nn.Module, str, str]]) -> list[_Buffer]:
        """The buffers at ``places`` (:attr:`ModuleParts.buffers`) now, with a copy of those that may change."""
        kept = []
        for owner, name, key in places:
            tensor = getattr(owner, name, None)
            if not isinstance(tensor, Tensor) or is_lazy(tensor):  # removed, or a lazy module not materialised yet
                continue
            version = tensor_version(tensor)
            if self.changing is None:  # every buffer, once: in host memory, off the device that may be full
                copy: Tensor | None = tensor.detach().to("cpu", copy=True)
            elif version is None or key in self.changing or _tracks_running_stats(owner):
                copy = self._copy(key, tensor)
            else:
                copy = None
            kept.append(_Buffer(owner, name, key, tensor, version, copy))
        return kept

    def learn(self, kept: list[_Buffer]) -> None:
        """After a batch went through: add the buffers it changed to :attr:`changing`.

        The first time, the copies are compared with the buffers (BatchNorm's kernels change the running statistics
        without moving the version counter); later, only the version counters of the buffers not copied are read.
        """
        first = self.changing is None
        changing = self.changing or set()
        for b in kept:
            if b.copy is not None and first:
                if b.version is None or not torch.equal(b.tensor.detach().to(b.copy.device), b.copy):
                    changing.add(b.key)
            elif b.copy is None and tensor_version(b.tensor) != b.version:
                changing.add(b.key)
        self.changing = changing

    def restore(self, kept: list[_Buffer]) -> list[str]:
        """Put the buffers back; returns the names of those changed in place that had no copy (left as they are)."""
        lost = []
        for i, b in enumerate(kept):
            if getattr(b.owner, b.name, None) is not b.tensor:
                setattr(b.owner, b.name, b.tensor)
            if b.copy is not None:
                with torch.no_grad():
                    b.tensor.copy_(b.copy)
            elif tensor_version(b.tensor) != b.version:
                lost.append(b.key)
                kept[i] = b._replace(version=tensor_version(b.tensor))  # reported once
        if self.changing is not None:
            self.changing |= set(lost)
        return lost


class RetrySnapshot:
    """Everything one batch's attempts may change besides gradients, kept before the first attempt.

    Args:
        module: the model; its buffers and the ``torchmetrics`` metrics among its submodules are kept.
        results: Lightning's logged results of the running loop (a mapping of key to a ``torchmetrics`` metric), or
            ``None``; keys that an attempt adds are removed on restore.
        rng: keep the random states (:func:`collect_rng_states`).
        metrics: keep the metric states and the logged results.
        buffers: a :class:`BufferKeeper` to keep the buffers with, or ``None`` to leave buffers alone.
        parts: the module's metrics and buffer places (:func:`find_parts`), if already found; ``None``: found now.

    Examples:
        >>> bn = nn.BatchNorm1d(2)
        >>> snapshot = RetrySnapshot(bn, None, buffers=BufferKeeper())
        >>> _ = bn(torch.randn(4, 2))
        >>> snapshot.restore()
        []
        >>> int(bn.num_batches_tracked), bn.running_mean.tolist()
        (0, [0.0, 0.0])
    """

    def __init__(
        self,
        module: nn.Module,
        results: MutableMapping[str, Any] | None,
        *,
        rng: bool = True,
        metrics: bool = True,
        buffers: BufferKeeper | None = None,
        parts: ModuleParts | None = None,
    ) -> None:
        self._rng: RngStates | None = None
        if rng:
            self._rng = collect_rng_states()
        self._results = results
        self._keys: dict[str, Any] | None = None
        self._metrics: MetricStates | None = None
        if (metrics or rng or buffers is not None) and parts is None:
            parts = find_parts(module)
        self._lazy = LazyInits(parts.lazy if rng and parts is not None else [])
        if metrics and parts is not None:
            found = list(parts.metrics)
            if results is not None:
                self._keys = dict(results)
                found += [m for m in self._keys.values() if isinstance(m, Metric)]
            self._metrics = MetricStates(found)
        self._keeper = buffers
        self._buffers: list[_Buffer] = []
        if buffers is not None and parts is not None:
            self._buffers = buffers.keep(parts.buffers)

    def restore(self) -> list[str]:
        """Put everything back; returns the buffers that could not be (see :meth:`BufferKeeper.restore`)."""
        if self._rng is not None:
            set_rng_states(self._rng)
            self._lazy.arm()
        if self._keys is not None and self._results is not None:
            for key in [k for k in self._results if k not in self._keys]:
                del self._results[key]
            for key, value in self._keys.items():
                if self._results.get(key) is not value:
                    self._results[key] = value
        if self._metrics is not None:
            self._metrics.restore()
        if self._keeper is None:
            return []
        return self._keeper.restore(self._buffers)

    def tensor_bytes(self) -> int:
        """Bytes of the tensors this snapshot copied: the torch random states, the metric tensor states (list states are
        not copied, only the lists) and the buffers."""
        tensors: list[Tensor] = []
        if self._rng is not None:
            tensors = [self._rng.torch, *(t for states in self._rng.accelerators.values() for t in states)]
        for _, states, _ in self._metrics._kept if self._metrics is not None else []:
            for value in states.values():
                tensors += [value] if isinstance(value, Tensor) else []
        tensors += [b.copy for b in self._buffers if b.copy is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def succeeded(self) -> None:
        """The batch went through: learn which buffers it changed, for the next batches."""
        self._lazy.disarm()
        if self._keeper is not None:
            self._keeper.learn(self._buffers)
