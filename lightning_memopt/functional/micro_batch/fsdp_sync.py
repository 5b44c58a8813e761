"""AutoMicroBatch under FSDP2 (``fully_shard``): every rank abandons a failed micro-batch at the same collective.

FSDP2 all-gathers each unit's parameters before its forward and its backward and reduce-scatters its gradients after
its backward. A rank that runs out of memory inside unit k leaves the others in unit k+1's all-gather, waiting for a
rank that is unwinding an exception. Here every collective FSDP2 runs while a micro-batch runs is preceded by an
agreement point (:meth:`~lightning_memopt.functional.micro_batch.retry.Agreement.before_collective`: a two-element
MAX all-reduce of an "out of memory seen" flag). A rank that ran out of memory sends its flag at its next agreement
point (the end of the micro-batch round); every other rank reaches an agreement point before its next collective,
learns the flag there and raises :class:`~lightning_memopt.functional.micro_batch.retry.PeerOutOfMemoryError`, so
every rank leaves the attempt having run the same collectives. :func:`reset_fsdp_state` then puts FSDP2's state
back (``FSDPModule.reset_iter_state``: unsharded parameters freed, pending collectives waited for, per-iteration
trackers cleared) before the retry; the partial sharded gradients are put back by the caller.

The agreement point sits inside the collective object FSDP2 calls (``FSDPModule.set_custom_all_gather`` and
``set_custom_reduce_scatter``), after FSDP2 allocated the collective's buffers and right before the collective: an
out-of-memory error while allocating them is recovered like any other. One that the collective itself raises (its
own buffers inside the backend) is not: the other ranks are already inside that collective. The rank that raised it
marks it (:func:`~lightning_memopt.functional.micro_batch.retry.is_unrecoverable`), joins no further agreement,
writes the error into the process group's store and ends with it. The others stay in the collective until the process
that raised it ends (gloo: its connections close, measured below a second; ``ProcessGroup.abort``, ``shutdown`` and
``destroy_process_group`` do not close them while FSDP2 still holds the group: only the end of the process does) or,
if that process goes on, until the process group's time-out. Each then reads that error from the store and ends with
:class:`PeerCollectiveOutOfMemoryError`, which carries it (the backend's error is its cause). Where the store is gone
with the failing process (it is rank 0, which hosts it), they end with the backend's error and a note that another
process stopped inside the collective.

Reports before the end: a launcher may kill every process as soon as one ends with an error (Lightning's, for
``devices=N`` from one script, within 5 s), so a waiting rank cannot write its report after the failing process ended.
While a rank waits inside a collective of a micro-batch, a thread of its own looks into the store every
:data:`WATCH_PERIOD_S`; when the error of that collective is there, it hands a :class:`PeerCollectiveOutOfMemoryError`
to the reporters registered with :func:`report_peer_failures` (``OOMReporter``) right away, while this process still
waits, and then counts itself under ``{key}/reported``. The failing rank waits, before its error leaves the
collective, until every other rank of the group counted itself, at most :data:`PEER_REPORT_WAIT_S`. The waiting rank
ends with that same error object (reported once).

Cost: one extra two-element all-reduce per all-gather (forward; backward for units resharded after forward) and per
reduce-scatter (backward) of each FSDP unit while a micro-batch runs, each waited for before the collective (on a GPU,
a host synchronisation). Measured on 2 CPU processes (gloo, a shared 2-core machine; ``benchmarks/auto_microbatch.py
--fsdp2``): 8 blocks of width 256, 4 micro-batches per step, 104 agreement points per step, 104 us each alone but
56 ms per step in the pipeline (0.216 s vs 0.160 s without them, Lightning's accumulation 0.158 s).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import time
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from lightning_memopt.functional.footprint.sharding import fsdp2_units
from lightning_memopt.functional.micro_batch.retry import Agreement, extend_message, mark_unrecoverable
from lightning_memopt.utilities import _torch_private
from lightning_memopt.utilities.trainer import host_name

__all__ = [
    "AgreeingAllGather",
    "AgreeingReduceScatter",
    "PeerCollectiveOutOfMemoryError",
    "check_fsdp_for_micro_batches",
    "fsdp_modules",
    "install_agreement",
    "report_peer_failures",
    "reset_fsdp_state",
    "tensor_parallel_size",
]


def fsdp_modules(module: nn.Module) -> list[nn.Module]:
    """The modules of ``module`` that ``fully_shard`` was applied to, outermost first.

    Examples:
        >>> fsdp_modules(nn.Linear(2, 2))
        []
    """
    return list(fsdp2_units(module).values())


_PEER_LEFT = (
    " [AutoMicroBatch: another process stopped inside FSDP's {what} that this process was running; its own error (an"
    " out-of-memory error raised inside the collective, which no smaller micro-batch can recover) ends that process.]"
)


#: The prefix of the store keys of a rank that ran out of memory inside a collective. Each failure has keys of its
#: own, ``{prefix}/{generation}/{point}``: the generation counts this process's :func:`install_agreement` calls and the
#: point is the agreement point before the collective (every rank installs its agreements and passes its agreement
#: points in the same order, so every rank of the collective names the same key without communicating).
_STORE_PREFIX = "lightning_memopt/out_of_memory_inside_a_collective"
#: How long a rank whose collective failed waits for that error (written before the failing rank's connections close).
PEER_ERROR_WAIT_S = 5.0
#: How long a rank that ran out of memory inside a collective waits, before its error leaves the collective, for the
#: ranks it left there to have reported (a launcher may kill them as soon as this process ends).
PEER_REPORT_WAIT_S = 30.0
#: How often a rank waiting inside a collective of a micro-batch looks into the store for a failing rank's error.
WATCH_PERIOD_S = 0.25
#: How long the watching thread stays without a collective to watch before it ends (the next one starts it again).
_WATCH_IDLE_S = 5.0
_GENERATIONS = itertools.count()
#: What reports a peer's failure while this rank still waits (``report(error)``), by the registering object's id.
_PEER_REPORTERS: dict[int, Callable[[BaseException], None]] = {}


class PeerCollectiveOutOfMemoryError(torch.OutOfMemoryError):
    """Ends a rank that waited inside FSDP's collective for a rank that ran out of memory in that collective itself.

    Its message is the other rank's error (rank, host and message); the collective's own error (the backend's, e.g.
    gloo's "connection closed by peer") is its ``__cause__``. Never retried.
    """


def _peers(group: Any) -> int:
    """How many other ranks run the collective on ``group`` (0 for anything that is no process group)."""
    size = getattr(group, "size", None)
    if not callable(size):
        return 0
    return max(int(size()) - 1, 0)


def report_peer_failures(owner: object, report: Callable[[BaseException], None] | None) -> None:
    """Register ``report`` (under ``owner``; ``None`` removes it): it is called, from a thread of its own, with the
    :class:`PeerCollectiveOutOfMemoryError` this rank will end with, as soon as it is known, while this rank still
    waits inside the collective. It must not communicate with other ranks, and must not raise."""
    if report is None:
        _PEER_REPORTERS.pop(id(owner), None)
    else:
        _PEER_REPORTERS[id(owner)] = report


def _waited_error(told: str, what: str) -> PeerCollectiveOutOfMemoryError:
    """The error a rank ends with that waited in FSDP's ``what`` for the rank whose error is ``told``."""
    peer = PeerCollectiveOutOfMemoryError(
        f"AutoMicroBatch: another process ran out of memory inside FSDP's {what}, where this process waited"
        f" for it; every process stops. Its error: {told}"
    )
    mark_unrecoverable(peer, None)
    return peer


def _stack_of(thread_id: int) -> types.TracebackType | None:
    """The stack the thread ``thread_id`` is in now, as a traceback (outermost first), for the report."""
    frame = sys._current_frames().get(thread_id)
    stack = None
    while frame is not None:
        stack = types.TracebackType(stack, frame, frame.f_lasti, frame.f_lineno)
        frame = frame.f_back
    return stack


class _Watch:
    """While this rank waits inside a collective of a micro-batch: a thread that looks for the error of a rank that ran
    out of memory inside it and reports it at once (see the module's "Reports before the end")."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries = itertools.count()
        #: (entry number, store key, the collective's name, the waiting thread) while a collective runs
        self._inside: tuple[int, str, str, int] | None = None
        self._thread: threading.Thread | None = None
        #: the errors reported, by store key, for the waiting thread to end with
        self.errors: dict[str, PeerCollectiveOutOfMemoryError] = {}

    @contextlib.contextmanager
    def inside(self, key: str, what: str) -> Iterator[None]:
        with self._lock:
            self._inside = (next(self._entries), key, what, threading.get_ident())
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="lightning-memopt-watch", daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            self._inside = None

    def _loop(self) -> None:
        last, idle = None, 0.0
        while True:
            time.sleep(WATCH_PERIOD_S)
            with self._lock:
                now = self._inside
                idle = idle + WATCH_PERIOD_S if now is None else 0.0
                if idle >= _WATCH_IDLE_S:
                    self._thread = None
                    return
            if now is not None and now == last and now[1] not in self.errors and _torch_private.peer_wrote(now[1]):
                self._report(*now[1:])
            last = now

    def _report(self, key: str, what: str, thread_id: int) -> None:
        told = _torch_private.read_from_peer(key, PEER_ERROR_WAIT_S)
        if told is None:
            return
        error = _waited_error(told, what).with_traceback(_stack_of(thread_id))
        self.errors[key] = error
        try:
            for report in list(_PEER_REPORTERS.values()):  # each must never raise (OOMReporter catches everything)
                report(error)
        finally:  # counted even so: the failing rank waits for the count, never for a broken reporter
            _torch_private.count_at_peers(f"{key}/reported")


class _Agreeing:
    """What both collectives share: the agreement, the allocation FSDP2 asks for, the marking of a collective's OOM."""

    what = "collective"

    def __init__(self, agreement: Agreement, generation: int = 0, watch: _Watch | None = None) -> None:
        self.agreement = agreement
        self.generation = generation
        if watch is None:
            watch = _Watch()
        self.watch = watch

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """FSDP2's default allocation (before the agreement point: an out-of-memory error here can be retried)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def _watching(self, key: str, peers: int) -> contextlib.AbstractContextManager[None]:
        """The watch around a collective that has peers to hang with; nothing around one without."""
        if peers:
            return self.watch.inside(key, self.what)
        return contextlib.nullcontext()

    def _run(self, collective: Any, **kwargs: Any) -> Any:
        self.agreement.before_collective()
        if not self.agreement.in_step:
            return collective(**kwargs)
        key = f"{_STORE_PREFIX}/{self.generation}/{self.agreement.points}"
        peers = _peers(kwargs.get("group"))
        watching = self._watching(key, peers)
        try:
            with watching:
                return collective(**kwargs)
        except torch.OutOfMemoryError as err:
            mark_unrecoverable(err, f"FSDP's {self.what}")
            if self._tell_peers(err, key) and peers:  # keep them alive until they reported (see the module's doc)
                _torch_private.wait_for_count(f"{key}/reported", peers, PEER_REPORT_WAIT_S)
            raise
        except RuntimeError as err:  # the backend's error: a peer left this collective
            told = _torch_private.read_from_peer(key, PEER_ERROR_WAIT_S)
            if told is None:  # no store, or it went with the failing rank (rank 0 hosts it)
                extend_message(err, _PEER_LEFT.format(what=self.what))
                raise
            raise self._peer_error(told, key, peers) from err

    def _tell_peers(self, err: torch.OutOfMemoryError, key: str) -> bool:
        """Leave ``err`` in the process group's store for the ranks that wait in this collective; whether it is."""
        if not torch.distributed.is_initialized():
            return False
        rank = torch.distributed.get_rank()
        text = f"rank {rank} ({host_name()}): {type(err).__name__}: {err}"
        return _torch_private.publish_to_peers(key, text)

    def _peer_error(self, told: str, key: str, peers: int) -> PeerCollectiveOutOfMemoryError:
        """The error this rank ends with: the failing rank's (``told``, read from the store), never retried. The last
        of the ``peers`` to read the error deletes it from the store."""
        if (_torch_private.count_at_peers(f"{key}/read") or 0) >= peers:
            _torch_private.forget_at_peers(key, f"{key}/read", f"{key}/reported")
        reported = self.watch.errors.pop(key, None)  # reported while this rank waited: end with that one
        if reported is not None:
            return reported.with_traceback(None)
        return _waited_error(told, self.what)


class AgreeingAllGather(_Agreeing):
    """FSDP2's all-gather (``torch.distributed.all_gather_single``) with an agreement point before it."""

    what = "all-gather"

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: torch.distributed.ProcessGroup,
        async_op: bool = False,
    ) -> Any:
        return self._run(
            torch.distributed.all_gather_single,
            output_tensor=output_tensor,
            input_tensor=input_tensor,
            group=group,
            async_op=async_op,
        )


class AgreeingReduceScatter(_Agreeing):
    """FSDP2's reduce-scatter (``torch.distributed.reduce_scatter_single``) with an agreement point before it."""

    what = "reduce-scatter"

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: torch.distributed.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        return self._run(
            torch.distributed.reduce_scatter_single,
            output=output_tensor,
            input=input_tensor,
            group=group,
            op=op,
            async_op=async_op,
        )


def tensor_parallel_size(mesh: Any) -> int:
    """The size of the ``"tensor_parallel"`` dimension of a device mesh (Lightning's ``ModelParallelStrategy`` names
    it so); 1 for a mesh without one."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if "tensor_parallel" not in names:
        return 1
    return int(mesh.size(names.index("tensor_parallel")))


def _unfit_sharding(module: nn.Module) -> str | None:
    """Why the sharding of ``module`` has no agreement point (the first trainable parameter that says so); ``None``
    when every trainable parameter is sharded by ``fully_shard`` on a one-dimensional mesh."""
    from torch.distributed.tensor import DTensor, Shard

    if not fsdp_modules(module):
        return "no module of it is sharded by `fully_shard`"
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if not isinstance(p, DTensor):
            return f"parameter `{name}` is not sharded"
        tensor_parallel = tensor_parallel_size(p.device_mesh)
        if tensor_parallel > 1:
            return (
                f"tensor parallelism is the cause: parameter `{name}` is on a device mesh with"
                f" tensor_parallel_size={tensor_parallel} (> 1)"
            )
        if p.device_mesh.ndim != 1:
            return f"parameter `{name}` is on a {p.device_mesh.ndim}-dimensional mesh (HSDP)"
        if not all(isinstance(s, Shard) for s in p.placements):
            return f"parameter `{name}` is replicated ({p.placements})"
    return None


def check_fsdp_for_micro_batches(module: nn.Module) -> None:
    """Raise a ``ValueError`` for sharding AutoMicroBatch cannot agree on: every trainable parameter must be sharded by
    ``fully_shard`` on a one-dimensional mesh (FSDP; not HSDP, tensor parallel or ``replicate``, whose collectives
    have no agreement point). The error names the first parameter that is not, and why (tensor parallelism when a
    parameter's mesh has a ``tensor_parallel`` dimension larger than 1).

    Examples:
        >>> check_fsdp_for_micro_batches(nn.Linear(2, 2))
        Traceback (most recent call last):
        ...
        ValueError: AutoMicroBatch under a model-parallel strategy needs every trainable parameter sharded by ...
    """
    cause = _unfit_sharding(module)
    if cause is not None:
        raise ValueError(
            "AutoMicroBatch under a model-parallel strategy needs every trainable parameter sharded by `fully_shard`"
            " on a one-dimensional data-parallel mesh (`fully_shard(block, mesh=self.device_mesh['data_parallel'])`"
            f" per block and on the root in `configure_model`); here {cause}. The collectives of tensor parallelism,"
            " HSDP and `replicate` have no point where the ranks can agree to abandon a micro-batch. Shard the model"
            " that way (`ModelParallelStrategy(tensor_parallel_size=1)`), or remove AutoMicroBatch."
        )


def install_agreement(modules: Iterable[nn.Module], agreement: Agreement) -> None:
    """Give every FSDP2 module collectives that agree first (``set_custom_all_gather`` / ``set_custom_reduce_scatter``).

    Outside a micro-batch (validation, ``agreement.in_step`` false) they are FSDP2's default collectives.
    """
    generation = next(_GENERATIONS)  # the same on every rank: each installs its agreements in the same order
    watch = _Watch()
    all_gather = AgreeingAllGather(agreement, generation, watch)
    reduce_scatter = AgreeingReduceScatter(agreement, generation, watch)
    for module in modules:
        try:
            module.set_custom_all_gather(all_gather)  # type: ignore[operator]  # an FSDPModule
            module.set_custom_reduce_scatter(reduce_scatter)  # type: ignore[operator]
        except ValueError as err:  # several parameter groups (a per-parameter mesh)
            raise ValueError(
                f"AutoMicroBatch cannot put its agreement points into the collectives of {type(module).__name__}: {err}"
                " Shard it with one mesh, or remove AutoMicroBatch."
            ) from err


def reset_fsdp_state(modules: Sequence[nn.Module]) -> None:
    """Put FSDP2's per-iteration state back after an abandoned forward or backward, before a retry.

    The gradients autograd wrote into unsharded parameters (those of a unit still unsharded, such as the root kept
    unsharded after forward) are dropped: the next all-gather reuses these parameters, and backward would add to them.
    Then ``reset_iter_state`` on each outermost FSDP2 module (a root): unsharded parameters freed, pending collectives
    waited for, trackers and the queued end-of-backward callback cleared. Sharded gradients are left as they are.
    """
    from torch.distributed.tensor import DTensor

    inner: set[int] = set()
    for module in modules:
        for param in module.parameters():
            if not isinstance(param, DTensor):  # unsharded now
                param.grad = None
        if id(module) in inner:
            continue
        inner.update(id(m) for m in module.modules() if m is not module)
        module.reset_iter_state()  # type: ignore[operator]  # an FSDPModule
