"""The live-storage counter: the bytes of the tensor storages alive at every moment, and their peak."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_flatten

from lightning_memopt.utilities._torch_private import decomposed_in_mode
from lightning_memopt.utilities.shared_state import Lease, Restore, borrow

__all__ = ["LiveBytes", "kernel_scratch", "tensor_storages", "unique_storages"]

#: Operators that read a tensor's metadata and create nothing: run past the counter (autograd's engine asks a fake
#: tensor's device for every gradient it passes on, half the operators of a fake training step).
_METADATA = frozenset({torch.ops.prim.device.default, torch.ops.prim.layout.default})
#: Composite operators that reach the counter whole (under ``inference_mode``) although what they hold is in the
#: operators they are made of: counted as those (CTC loss's ``log_alpha``; an RNN over a packed sequence and its
#: padding back, whose decompositions read ``batch_sizes``' values).
_DECOMPOSED = frozenset(
    {
        torch.ops.aten.ctc_loss.Tensor,
        torch.ops.aten.ctc_loss.IntList,
        torch.ops.aten.lstm.data,
        torch.ops.aten.gru.data,
        torch.ops.aten.rnn_tanh.data,
        torch.ops.aten.rnn_relu.data,
        torch.ops.aten._pad_packed_sequence.default,
    }
)


def kernel_scratch(func: Any, args: tuple, kwargs: dict) -> int:
    """Bytes a kernel holds inside itself: a softmax's contiguous copy of each non-contiguous input, CTC loss's
    backward its ``log_beta``.

    ``softmax``/``log_softmax`` and their backward make their inputs contiguous inside the kernel, on the CPU and on
    CUDA alike (``F.cross_entropy(logits.T, ...)`` in a CLIP loss copies the whole logits matrix; its backward
    copies the gradient and the output). No operator shows these copies, so they are counted while the kernel runs.
    Measured as process RSS on torch 2.13 (``benchmarks/planner.py``). ``_ctc_loss_backward`` allocates a
    ``log_beta`` the size of the forward's ``log_alpha`` on both devices (torch's ``LossCTC.cpp``, ``LossCTC.cu``).

    Examples:
        >>> x = torch.randn(4, 8)
        >>> kernel_scratch(torch.ops.aten._softmax.default, (x, 1, False), {})  # contiguous: no copy
        0
        >>> kernel_scratch(torch.ops.aten._softmax.default, (x.T, 1, False), {})  # the whole input copied
        128
    """
    packet = getattr(func, "overloadpacket", None)
    aten = torch.ops.aten
    if packet is aten._ctc_loss_backward:  # its log_beta, the size of the forward's log_alpha (argument 6)
        return args[6].numel() * args[6].element_size()
    if packet in (aten._softmax, aten._log_softmax):
        tensors = args[:1]
    elif packet in (aten._softmax_backward_data, aten._log_softmax_backward_data):
        tensors = args[:2]
    else:
        return 0
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor) and not t.is_contiguous())


def tensor_storages(tensor: Tensor) -> list[torch.UntypedStorage]:
    """The storages that hold ``tensor``'s data: its own, or for a wrapper subclass (a ``DTensor``: its local shard)
    those of the tensors it wraps.

    A wrapper's own storage is not memory: a ``DTensor``'s reports the bytes of the global tensor.

    Examples:
        >>> [s.nbytes() for s in tensor_storages(torch.ones(3))]
        [12]
    """
    if tensor.layout != torch.strided:  # a sparse tensor (``nn.Embedding(sparse=True)``'s gradient): its parts
        return [s for t in _sparse_parts(tensor) for s in tensor_storages(t)]
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor.untyped_storage()]
    names, _ = tensor.__tensor_flatten__()
    inner = [getattr(tensor, name) for name in names]
    return [s for t in inner if isinstance(t, Tensor) for s in tensor_storages(t)]


def _sparse_parts(tensor: Tensor) -> list[Tensor]:
    """The strided tensors a sparse one is made of: COO's indices and values, compressed rows' or columns' indices
    and values."""
    if tensor.layout == torch.sparse_coo:
        return [tensor._indices(), tensor._values()]
    if tensor.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [tensor.crow_indices(), tensor.col_indices(), tensor.values()]
    if tensor.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [tensor.ccol_indices(), tensor.row_indices(), tensor.values()]
    return []


def unique_storages(tensors: Iterable[Tensor]) -> list[Tensor]:
    """One tensor per storage: tied weights and views are counted once."""
    return list({tuple(id(s) for s in tensor_storages(t)): t for t in tensors}.values())


#: The counters entered now that follow storage resizes (``UntypedStorage.resize_`` is not an operator).
_RESIZE_WATCHERS: list[LiveBytes] = []
_RESIZE_KEY = "torch.UntypedStorage.resize_"


def _follow_resizes(_: object) -> Restore:
    """Put a ``resize_`` that tells the entered counters in place of the one in effect; the function that puts it
    back (applied by the first counter in, through :func:`~lightning_memopt.utilities.shared_state.borrow`)."""
    resize = torch.UntypedStorage.resize_

    def counted_resize(storage: torch.UntypedStorage, size: int) -> Any:
        out = resize(storage, size)
        for counter in list(_RESIZE_WATCHERS):
            counter.resized(storage)
        return out

    def restore() -> None:
        torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign]

    torch.UntypedStorage.resize_ = counted_resize  # type: ignore[method-assign,assignment]
    return restore


def _watch_resizes(counter: LiveBytes) -> Lease | None:
    _RESIZE_WATCHERS.append(counter)
    return borrow(_RESIZE_KEY, True, _follow_resizes)


def _unwatch_resizes(counter: LiveBytes, lease: Lease | None) -> None:
    if counter in _RESIZE_WATCHERS:
        _RESIZE_WATCHERS.remove(counter)
    if lease is not None:
        lease.release()


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensor storages alive, and their peak, as operators create and free them.

    Each storage is counted once, when an operator's output shows it first (views and in-place results share it),
    and leaves the count when torch frees it. Storages are labelled with the phase that created them; a label can
    change later (a gradient, an optimizer state), so the totals at the peak say what the peak was made of.

    Two things no operator shows are followed too: a storage resized in place (``UntypedStorage.resize_``, how FSDP2
    frees and re-creates its all-gathered parameters) changes the count while a counter is entered, and a wrapper
    tensor subclass (a ``DTensor``) counts as the tensors it wraps, whose operators the counter sees once the subclass
    has run.

    Args:
        block_bytes: round each storage up to a multiple of this (512 models the CUDA caching allocator; 1: none).
        scratch: ``scratch(op, args, kwargs) -> bytes`` a kernel holds inside itself beside its outputs while it runs
            (no operator shows them); counted at that moment only (e.g. :func:`kernel_scratch`).
        outputs: ``outputs(op, args, kwargs, out) -> out``: the operator's outputs as they are counted and returned,
            where a fake kernel returns fewer bytes than the real one (e.g.
            :func:`~lightning_memopt.functional.planning.corrections.fake_kernel_outputs`).
        labels: ``labels(op, args, kwargs) -> [(tensor, label), ...]``: what an operator's arguments are, said once it
            has run (e.g. a collective's buffers).
        apart: labels counted apart from ``now`` and ``peak``, in ``apart_now`` and ``apart_peak`` (memory held
            elsewhere, e.g. on the host under CPU offload).
        run: ``run(op, args, kwargs) -> out``: how each operator runs (default: as it is), e.g.
            :meth:`~lightning_memopt.functional.planning.known_values.KnownValues.run`, which follows values beside
            fake tensors; given here rather than as a mode of its own, whose dispatch would cost as much again.

    Outputs (attributes): ``now`` and ``peak`` (bytes), ``peak_phase``/``peak_step``/``peak_seq`` (when the peak
    happened), ``peak_totals`` (bytes by label at the peak), ``phase_peaks`` (the highest count in each phase),
    ``totals`` (bytes by label now), ``apart_now`` and ``apart_peak``. The caller sets ``phase`` and ``step`` as the
    training step goes on.

    Examples:
        >>> with LiveBytes() as counter:
        ...     x = torch.ones(256)  # 1024 bytes
        ...     y = (x * 2).sum()  # x * 2 (1024 bytes) is freed once summed
        >>> counter.peak, counter.now
        (2052, 1028)
    """

    def __init__(
        self,
        block_bytes: int = 1,
        scratch: Callable[[Any, tuple, dict], int] | None = None,
        outputs: Callable[[Any, tuple, dict, Any], Any] | None = None,
        labels: Callable[[Any, tuple, dict], Iterable[tuple[Tensor, str]]] | None = None,
        apart: Iterable[str] = (),
        run: Callable[[Any, tuple, dict], Any] | None = None,
    ) -> None:
        super().__init__()
        self.run = run
        self.block_bytes = block_bytes
        self.scratch = scratch
        self.outputs = outputs
        self.labels = labels
        self.apart = frozenset(apart)
        self.phase = "setup"
        self.step = 0
        self.now = 0
        self.peak = 0
        self.apart_now = 0
        self.apart_peak = 0
        self.peak_phase = "setup"
        self.peak_step = 0
        self.peak_seq = 0
        self.peak_totals: dict[str, int] = {}
        self.phase_peaks: dict[str, int] = {}
        self.totals: dict[str, int] = {}
        self._seq = 0
        self._info: dict[int, list[Any]] = {}  # id(storage) -> [bytes, label, seq, step]
        self._paused = 0
        #: ids of storages that are not the step's memory (fake twins of real constants the step reads)
        self.uncounted: set[int] | frozenset[int] = frozenset()

    def pause(self) -> None:
        """Stop counting new storages until :meth:`resume` (nested pauses count): for tensors that are not memory of
        the step (DTensor's metadata runs)."""
        self._paused += 1

    def resume(self) -> None:
        """Count again after :meth:`pause`."""
        self._paused -= 1

    def rounded(self, nbytes: int) -> int:
        """``nbytes`` rounded up to whole blocks of ``block_bytes``."""
        block = self.block_bytes
        return nbytes if block <= 1 else -(-nbytes // block) * block

    def storage_bytes(self, tensor: Tensor) -> int:
        """The counted (rounded) bytes of ``tensor``'s whole storage (a wrapper subclass: of the tensors it wraps)."""
        return sum(self.rounded(s.nbytes()) for s in tensor_storages(tensor))

    def track(self, tensor: Tensor, label: str | None = None) -> None:
        """Count ``tensor``'s storage if it is new; ``label`` (default: the current phase) says what it is."""
        for storage in tensor_storages(tensor):
            self._track_storage(storage, label or self.phase)

    def _track_storage(self, storage: torch.UntypedStorage, label: str) -> None:
        key = id(storage)
        if key in self._info or key in self.uncounted:
            return
        nbytes = self.rounded(storage.nbytes())
        self._seq += 1
        self._info[key] = [nbytes, label, self._seq, self.step]
        self._add(label, nbytes)
        weakref.finalize(storage, self._free, key)
        self._record(self.now, self.totals)

    def relabel(self, tensor: Tensor, label: str) -> None:
        """Say what an already counted storage is (e.g. ``"gradients"``); unknown storages are counted first."""
        for storage in tensor_storages(tensor):
            info = self._info.get(id(storage))
            if info is None:
                self._track_storage(storage, label)
            elif info[1] != label:
                self._relabelled(id(storage), info, label)
                self._add(info[1], -info[0])
                self._add(label, info[0])
                info[1] = label

    def _relabelled(self, key: int, info: list[Any], label: str) -> None:
        """Called before a counted storage (``key``, its ``[bytes, label, seq, step]``) is relabelled ``label``."""

    def resized(self, storage: torch.UntypedStorage) -> None:
        """A counted storage changed its size in place: count its new bytes (unknown storages are ignored)."""
        info = self._info.get(id(storage))
        if info is None:
            return
        nbytes = self.rounded(storage.nbytes())
        if nbytes != info[0]:
            self._add(info[1], nbytes - info[0])
            info[0] = nbytes
            self._record(self.now, self.totals)

    def info(self, tensor: Tensor) -> tuple[int, str, int, int] | None:
        """(bytes, label, creation number, step) of ``tensor``'s storage, if it is counted and alive."""
        storages = tensor_storages(tensor)
        if not storages:
            return None
        found = self._info.get(id(storages[0]))
        if found is None:
            return None
        nbytes, label, seq, step = found
        return nbytes, label, seq, step

    def _add(self, label: str, nbytes: int) -> None:
        self.totals[label] = self.totals.get(label, 0) + nbytes
        if label in self.apart:
            self.apart_now += nbytes
            self.apart_peak = max(self.apart_peak, self.apart_now)
        else:
            self.now += nbytes

    def _free(self, key: int) -> None:
        info = self._info.pop(key, None)
        if info is not None:
            self._add(info[1], -info[0])

    def _record(self, level: int, totals: dict[str, int]) -> None:
        """A new high of the current phase and of the whole run, with what it is made of."""
        if level > self.phase_peaks.get(self.phase, 0):
            self.phase_peaks[self.phase] = level
        if level > self.peak:
            self.peak, self.peak_phase, self.peak_step, self.peak_seq = level, self.phase, self.step, self._seq
            self.peak_totals = dict(totals)

    def __enter__(self) -> LiveBytes:
        self._resizes = _watch_resizes(self)
        try:
            return super().__enter__()
        except BaseException:
            _unwatch_resizes(self, self._resizes)
            raise

    def __exit__(self, *args: Any) -> None:
        try:
            super().__exit__(*args)
        finally:
            _unwatch_resizes(self, self._resizes)

    def _run_operator(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func(*args, **kwargs)``, through ``run`` when one is given."""
        if self.run is None:
            return func(*args, **kwargs)
        return self.run(func, args, kwargs)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # a DTensor runs its local operators, which are counted
        kwargs = kwargs or {}
        if self._paused or func in _METADATA:
            return func(*args, **kwargs)
        if func in _DECOMPOSED:
            return decomposed_in_mode(self, func, args, kwargs)
        return self._count(func, args, kwargs, self._run_operator(func, args, kwargs))

    def _count(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        """Count what an operator made (its outputs, as corrected; its labels; its scratch); its outputs."""
        if self.outputs is not None:
            out = self.outputs(func, args, kwargs, out)
        for value in tree_flatten(out)[0]:
            if isinstance(value, Tensor):
                self.track(value)
        if self.labels is not None:
            for tensor, label in self.labels(func, args, kwargs):
                self.relabel(tensor, label)
        if self.scratch is not None:
            extra = self.scratch(func, args, kwargs)
            if extra:  # held inside the kernel beside what is alive now, gone when it returns
                self._record(self.now + self.rounded(extra), {**self.totals, "scratch": self.rounded(extra)})
        return out
