"""Run one batch as micro-batches and halve the micro-batch on out-of-memory: the core of ``AutoMicroBatch``.

No Trainer here: :func:`run_micro_batches` drives a ``step(start, stop)`` function over the samples of a batch,
catches ``torch.OutOfMemoryError``, decides with :func:`next_micro_batch_size` whether to halve or give up, puts the
gradients back (:func:`restore_grads`) and runs the batch again from its first sample. :class:`Agreement` makes
every rank of a process group take the same decision with the same sequence of collectives; inactive, it costs
nothing. :func:`micro_batch_weight` and :func:`combine_losses` are the effective-batch arithmetic: each
micro-batch's loss weighted by its share of the batch and of the accumulation window.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import math
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "BUCKET_BYTES",
    "STRATEGY_COLLECTIVES",
    "Agreement",
    "MicroBatchPart",
    "PeerOutOfMemoryError",
    "PendingPoint",
    "agree_before_collectives",
    "combine_losses",
    "extend_message",
    "give_up_note",
    "is_unrecoverable",
    "loss_weight",
    "mark_micro_batch",
    "mark_unrecoverable",
    "micro_batch_facts",
    "micro_batch_weight",
    "next_micro_batch_size",
    "restore_grads",
    "run_micro_batches",
    "snapshot_grads",
]

OK, RETRY, GIVE_UP = 0, 1, 2
#: The most gradient bytes one all-reduce of :meth:`Agreement.average_gradients` carries: DDP's default bucket_cap_mb.
BUCKET_BYTES = 25 * 2**20


class MicroBatchPart(NamedTuple):
    """What one micro-batch gave: its number of samples, its loss (or ``None``), the step's other outputs (the
    extra keys of ``training_step``'s dict, or an evaluation step's whole output) and its weight in the batch's loss
    (``None``: its number of samples)."""

    samples: int
    loss: Tensor | None
    extra: Any
    weight: float | None = None


def micro_batch_weight(samples: float, batch_size: float, accumulate: int = 1) -> float:
    """The factor on a micro-batch's loss so that the micro-batches add up to the batch's mean over the window.

    ``samples`` and ``batch_size`` are the micro-batch's and the batch's weights: numbers of samples, or of whatever
    the loss is a mean over (tokens, with ``AutoMicroBatch(weight_fn=...)``).

    Examples:
        >>> micro_batch_weight(4, 16, accumulate=2)  # 4 of 16 samples, in a window of 2 batches
        0.125
        >>> micro_batch_weight(30.0, 120.0)  # 30 of the batch's 120 tokens
        0.25
    """
    return samples / (batch_size * accumulate)


def loss_weight(value: Any, where: str) -> float:
    """A weight returned by ``weight_fn`` as a float: a non-negative, finite number or 0-dim tensor.

    Raises:
        ValueError: naming ``where`` (the batch or a micro-batch), the value and what is allowed.

    Examples:
        >>> loss_weight(torch.tensor(12), "the batch"), loss_weight(3, "a micro-batch")
        (12.0, 3.0)
    """
    number = value
    if isinstance(value, Tensor) and value.numel() == 1:
        number = value.item()
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number) or number < 0:
        raise ValueError(
            f"AutoMicroBatch: `weight_fn` must return a non-negative, finite number (or a 1-element tensor) for"
            f" {where}, got {value!r}: the count the loss is a mean over, such as the batch's non-padded tokens."
        )
    return float(number)


def next_micro_batch_size(size: int, min_size: int) -> int | None:
    """The micro-batch to try after ``size`` ran out of memory: half of it, never below ``min_size``; ``None``: give up.

    Examples:
        >>> next_micro_batch_size(16, 1), next_micro_batch_size(3, 2), next_micro_batch_size(2, 2)
        (8, 2, None)
    """
    return None if size <= min_size else max(min_size, size // 2)


def give_up_note(
    size: int, batch_size: int, min_size: int, first_size: int | None, retries: int, stage: str = "fit"
) -> str:
    """The text appended to the final out-of-memory error: what was tried (``stage``: where, when not training).

    Examples:
        >>> give_up_note(1, 8, 1, 8, 3, "validate")[:70]
        ' [AutoMicroBatch, validate: a micro-batch of 1 sample(s) of a batch of'
    """
    where = "AutoMicroBatch" if stage == "fit" else f"AutoMicroBatch, {stage}"
    return (
        f" [{where}: a micro-batch of {size} sample(s) of a batch of {batch_size} still ran out of memory and"
        f" the smallest allowed is min_micro_batch_size={min_size}; tried micro-batches down from"
        f" {first_size or size} after {retries} earlier halving(s).]"
    )


def extend_message(err: BaseException, note: str) -> None:
    """Append ``note`` to ``err``'s message in place (the caller re-raises the same object)."""
    if err.args and isinstance(err.args[0], str):
        err.args = (err.args[0] + note, *err.args[1:])
    else:
        err.args = (*err.args, note)


class MicroBatchFacts(NamedTuple):
    """The batch a final out-of-memory error came from: its samples and the micro-batch that ran out of memory."""

    batch_size: int
    micro_batch_size: int


_FACTS = "lightning_memopt_micro_batch"


def mark_micro_batch(err: BaseException, batch_size: int, micro_batch_size: int) -> None:
    """Record on ``err`` the whole batch and the micro-batch it came from (read by :func:`micro_batch_facts`)."""
    setattr(err, _FACTS, MicroBatchFacts(batch_size, micro_batch_size))


def micro_batch_facts(err: BaseException) -> MicroBatchFacts | None:
    """What :func:`mark_micro_batch` recorded on ``err``; ``None`` for an error that did not end a micro-batch run.

    Examples:
        >>> err = torch.OutOfMemoryError("simulated")
        >>> mark_micro_batch(err, 16, 1)
        >>> micro_batch_facts(err), micro_batch_facts(ValueError())
        (MicroBatchFacts(batch_size=16, micro_batch_size=1), None)
    """
    facts = getattr(err, _FACTS, None)
    return facts if isinstance(facts, MicroBatchFacts) else None


_UNRECOVERABLE = "lightning_memopt_unrecoverable"


def mark_unrecoverable(err: BaseException, where: str | None) -> None:
    """Mark ``err`` as raised inside a collective (``where``) that the other ranks already wait in: no retry, no
    agreement; it ends the run (:func:`is_unrecoverable`). ``where=None`` marks it without a note (its message says
    it already)."""
    setattr(err, _UNRECOVERABLE, True)
    if where is not None:
        extend_message(
            err,
            f" [AutoMicroBatch: raised inside {where} itself, where the other processes already wait for this one: it"
            " cannot be retried with a smaller micro-batch; every process stops.]",
        )


def is_unrecoverable(err: BaseException) -> bool:
    """Whether :func:`mark_unrecoverable` marked ``err``.

    Examples:
        >>> err = torch.OutOfMemoryError("simulated")
        >>> is_unrecoverable(err), mark_unrecoverable(err, "an all-gather"), is_unrecoverable(err)
        (False, None, True)
    """
    return bool(getattr(err, _UNRECOVERABLE, False))


def snapshot_grads(params: Sequence[torch.nn.Parameter]) -> list[Tensor | None]:
    """A copy of every parameter's gradient (``None`` where there is none), for :func:`restore_grads`."""
    return [_grad_copy(p) for p in params]


def _grad_copy(param: torch.nn.Parameter) -> Tensor | None:
    """A detached copy of ``param``'s gradient; ``None`` when it has none."""
    if param.grad is None:
        return None
    return param.grad.detach().clone()


def restore_grads(params: Sequence[torch.nn.Parameter], saved: Sequence[Tensor | None] | None, zeroed: bool) -> None:
    """Put the gradients back to the batch's start: ``saved``, or ``None`` when the batch zeroed them (``zeroed``)."""
    if saved is not None:
        for p, g in zip(params, saved):
            if g is None:
                p.grad = None
            else:
                p.grad = g.clone()
    elif zeroed:  # the window starts with this batch: back to "just zeroed"
        for p in params:
            p.grad = None


def combine_losses(parts: Sequence[MicroBatchPart], batch_size: float, accumulate: int = 1) -> Tensor | None:
    """The batch's loss as Lightning reports it (the mean over the window, each part weighted by its weight, or its
    samples, of ``batch_size``, the batch's), detached.

    Examples:
        >>> parts = [MicroBatchPart(3, torch.tensor(1.0), {}), MicroBatchPart(1, torch.tensor(5.0), {})]
        >>> combine_losses(parts, 4).item()
        2.0
    """
    losses = [(p.samples if p.weight is None else p.weight, p.loss) for p in parts if p.loss is not None]
    if not losses:
        return None
    total = sum((loss.detach().double() * (m / batch_size) for m, loss in losses), torch.zeros((), dtype=torch.double))
    return (total / accumulate).to(losses[0][1].dtype)


class PeerOutOfMemoryError(torch.OutOfMemoryError):
    """Raised by :meth:`Agreement.before_collective` on a rank that learns there that another rank ran out of memory.

    ``flag`` is what the ranks agreed on (retry with a smaller micro-batch, or give up); the agreement of the round is
    done, so the rank that catches it sends no flag of its own for this round.
    """

    def __init__(self, flag: int) -> None:
        super().__init__(
            "AutoMicroBatch: another process ran out of memory during this micro-batch; this process abandons it at the"
            " same collective."
        )
        self.flag = flag


class PendingPoint(NamedTuple):
    """An agreement started without waiting (:meth:`Agreement.start_point`); :meth:`wait` gives what it agreed."""

    work: Any
    flag: Tensor

    def wait(self) -> tuple[int, int]:
        if self.work is not None:
            self.work.wait()
        agreed, more = self.flag.tolist()
        return int(agreed), int(more)


class Agreement:
    """The few collectives every rank runs in the same order, whatever happened locally (no-ops when inactive).

    Under DDP the ranks agree once per micro-batch round, after its backward. Under FSDP2 (``fully_shard``) forward and
    backward run collectives of their own, so the ranks also agree right before each of them
    (:meth:`before_collective`, called by the collectives of :mod:`lightning_memopt.functional.micro_batch.fsdp_sync`
    while a
    micro-batch runs): a rank that ran out of memory sends its flag at its next agreement point, which every other rank
    reaches before its next collective, and every rank abandons the attempt there.

    Args:
        active: whether a process group is there to agree with (``False``: one process, nothing is sent).
        device: where the flags are reduced (the process group's device).
        no_sync: a context manager factory that keeps the DDP reducer from syncing (``strategy.block_backward_sync``).

    Examples:
        >>> Agreement().max(2)  # one process: nothing to agree with
        2
    """

    def __init__(
        self,
        active: bool = False,
        device: torch.device | str | None = None,
        no_sync: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> None:
        self.active = active
        self.device = device
        self._no_sync = no_sync
        #: whether a micro-batch is running (its collectives agree first; others, as in validation, do not)
        self.in_step = False
        #: agreement points passed inside micro-batches (for the cost measurement)
        self.points = 0
        #: the two-element buffer every agreement reduces (every agreement has this one shape, so that any two of them
        #: that meet on different ranks pair up)
        self._flag: Tensor | None = None
        #: while a window of :class:`~lightning_memopt.functional.micro_batch.ddp_overlap.OverlappedReduction` is
        #: open: what an
        #: agreement on this rank does first (the all-reduces the other ranks run in that window)
        self.before_agreeing: Callable[[], None] | None = None

    def agree(self, value: int, more: int = 0) -> tuple[int, int]:
        """The largest ``value`` and the largest ``more`` over the ranks, in one all-reduce.

        Examples:
            >>> Agreement().agree(1, 0)  # one process: nothing to agree with
            (1, 0)
        """
        if not self.active:
            return value, more
        if self.before_agreeing is not None:
            complete, self.before_agreeing = self.before_agreeing, None
            complete()
        if self._flag is None:
            self._flag = torch.empty(2, dtype=torch.int64, device=self.device)
        self._flag.copy_(torch.tensor([value, more], dtype=torch.int64))
        torch.distributed.all_reduce(self._flag, op=torch.distributed.ReduceOp.MAX)
        agreed, anyone_more = self._flag.tolist()
        return int(agreed), int(anyone_more)

    def start_point(self, value: int, more: int = 0) -> PendingPoint:
        """An agreement like :meth:`agree`, started without waiting for it (its buffer is its own).

        Examples:
            >>> Agreement().start_point(0, 1).wait()  # one process: nothing to agree with
            (0, 1)
        """
        if not self.active:
            return PendingPoint(None, torch.tensor([value, more]))
        flag = torch.tensor([value, more], dtype=torch.int64, device=self.device)
        return PendingPoint(torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, async_op=True), flag)

    def max(self, value: int) -> int:
        """The largest ``value`` over the ranks."""
        return self.agree(value)[0]

    def min(self, value: int) -> int:
        """The smallest ``value`` over the ranks."""
        return -self.max(-value)

    def no_sync(self) -> AbstractContextManager[Any]:
        """Backward without the DDP reducer's sync (only when active)."""
        if self.active and self._no_sync is not None:
            return self._no_sync()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """While a micro-batch runs: :meth:`before_collective` agrees (only when active)."""
        self.in_step = self.active
        try:
            yield
        finally:
            self.in_step = False

    def before_collective(self) -> None:
        """An agreement point before a collective of forward or backward: every rank is still in the micro-batch.

        Raises:
            PeerOutOfMemoryError: another rank ran out of memory; the agreed flag is on the error.
        """
        if not self.in_step or self.before_agreeing is not None:  # inside a window every rank runs the collective
            return
        self.points += 1
        flag = self.max(OK)
        if flag != OK:
            self.in_step = False  # no further agreement in this round: the others are done with it
            raise PeerOutOfMemoryError(flag)

    def average_gradients(
        self,
        params: Sequence[torch.nn.Parameter],
        reduce: Callable[[Sequence[torch.nn.Parameter]], None] | None = None,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        """Average the gradients over the ranks as DDP does; a gradient no rank has stays ``None``.

        One all-reduce per bucket of at most ``bucket_bytes`` (DDP's ``bucket_cap_mb``; a larger gradient is a bucket
        of its own) of one dtype, so the copy the all-reduce works on never holds more than one bucket.
        ``reduce(params)``, when given, reduces the gradients instead of the plain average (DDP's communication hook,
        :func:`~lightning_memopt.functional.micro_batch.ddp_sync.gradient_reduction`); it gets the parameters that
        some rank has
        a gradient for, each with a gradient (zeros on a rank that had none).
        """
        world = torch.distributed.get_world_size()
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(has, op=torch.distributed.ReduceOp.MAX)
        grads: dict[torch.dtype, list[tuple[torch.nn.Parameter, Tensor]]] = {}
        for p, h in zip(params, has.tolist()):
            if not h:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.setdefault(p.grad.dtype, []).append((p, p.grad))
        if reduce is not None:
            reduce([p for group in grads.values() for p, _ in group])
            return
        for group in grads.values():
            for bucket in _buckets([g for _, g in group], bucket_bytes):
                flat = torch.cat([g.reshape(-1) for g in bucket])
                torch.distributed.all_reduce(flat)
                flat.div_(world)
                offset = 0
                for g in bucket:
                    count = g.numel()
                    g.copy_(flat[offset : offset + count].view_as(g))
                    offset += count
                del flat


#: The methods of a Lightning strategy that run a collective when a step calls them (``self.log(..., sync_dist=True)``
#: calls ``reduce``, ``self.all_gather`` calls ``all_gather``).
STRATEGY_COLLECTIVES = ("reduce", "all_gather", "broadcast", "barrier")


def agree_before_collectives(
    owner: Any, agreement: Agreement, names: Sequence[str] = STRATEGY_COLLECTIVES
) -> Callable[[], None]:
    """Make the methods ``names`` of ``owner`` pass an agreement point (:meth:`Agreement.before_collective`) before
    their collective while a micro-batch runs; returns the function that gives the methods back.

    A step that syncs a logged value (``self.log(..., sync_dist=True)``) runs a collective that a rank which ran out of
    memory earlier in the same micro-batch never reaches: with the agreement point first, every rank learns of the
    failure there and abandons the micro-batch instead of waiting in the collective. Outside a micro-batch (epoch-end
    syncs, Lightning's own barriers) the methods run as they are.

    Examples:
        >>> class Strategy:
        ...     def reduce(self, value):
        ...         return value
        >>> strategy = Strategy()
        >>> give_back = agree_before_collectives(strategy, Agreement(), ["reduce"])
        >>> strategy.reduce(3), "reduce" in vars(strategy)
        (3, True)
        >>> give_back()
        >>> "reduce" in vars(strategy)
        False
    """
    missing = object()
    previous: dict[str, Any] = {}
    for name in names:
        method = getattr(owner, name, None)
        if method is None:
            continue
        previous[name] = vars(owner).get(name, missing)
        setattr(owner, name, _agreeing(method, agreement))

    def give_back() -> None:
        for name, value in previous.items():
            if value is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, value)

    return give_back


def _agreeing(method: Callable[..., Any], agreement: Agreement) -> Callable[..., Any]:
    @functools.wraps(method)
    def agreeing(*args: Any, **kwargs: Any) -> Any:
        agreement.before_collective()
        return method(*args, **kwargs)

    return agreeing


def _buckets(tensors: Sequence[Tensor], bucket_bytes: int) -> list[list[Tensor]]:
    """``tensors`` in order, grouped into runs of at most ``bucket_bytes`` (a larger tensor alone)."""
    buckets: list[list[Tensor]] = []
    size = bucket_bytes
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return buckets


def run_micro_batches(
    batch_size: int,
    micro_batch_size: int,
    min_micro_batch_size: int,
    step: Callable[[int, int], MicroBatchPart],
    *,
    agreement: Agreement | None = None,
    restore: Callable[[int], None] = lambda start: None,
    release: Callable[[], object] = lambda: None,
    on_halve: Callable[[int, int, bool], None] = lambda size, new, here: None,
    give_up: Callable[[BaseException, int], None] = lambda err, size: None,
    resume: bool = False,
) -> tuple[list[MicroBatchPart], int]:
    """Run ``step(start, stop)`` over the samples ``[0, batch_size)`` in micro-batches; halve on out-of-memory.

    After a ``torch.OutOfMemoryError`` in a step (and once out of the ``except`` block, so that the failed attempt's
    activations are unreachable): ``restore(start)`` puts back what the failed attempt changed, ``gc.collect()`` and
    ``release()`` free memory, ``on_halve(size, new_size, here)`` is told (``here``: this process ran out of memory, not
    only another rank) and the batch runs again from ``start``: its first sample (training: the gradients of the whole
    batch go back), or with ``resume=True`` the first sample of the micro-batch round that failed, keeping the parts
    before it (evaluation: nothing of the parts that went through is undone; this rank's part of the failed round, if
    it went through here, is dropped and ``restore(start)`` undoes it). At ``min_micro_batch_size``,
    ``give_up(err, size)`` may extend the error before the original error is raised (on another rank's give-up, a new
    one saying so). Other errors pass through; one raised after the batch's first out-of-memory error (while
    recovering, or in a retry) has that error as its ``__cause__`` (its frames cleared, so that it holds no tensor of
    the failed attempt).

    Returns:
        The parts of the run that went through, and the micro-batch size it ended with.

    Examples:
        >>> def step(start, stop):
        ...     if stop - start > 2:
        ...         raise torch.OutOfMemoryError("simulated")
        ...     return MicroBatchPart(stop - start, None, {})
        >>> parts, size = run_micro_batches(8, 8, 1, step)
        >>> size, [p.samples for p in parts]
        (2, [2, 2, 2, 2])
        >>> parts, size = run_micro_batches(8, 3, 1, step, resume=True)  # 3 fails at once, then 1 + 1 from sample 0
        >>> size, [p.samples for p in parts]
        (1, [1, 1, 1, 1, 1, 1, 1, 1])
    """
    comm = agreement or Agreement()
    size, begin = micro_batch_size, 0
    done: list[MicroBatchPart] = []  # with `resume`: the parts before the round that failed
    first_oom: BaseException | None = None  # what an error raised while recovering is chained to
    while True:
        try:
            parts, retry = _attempt(_Run(batch_size, begin, size, min_micro_batch_size), step, comm, give_up)
            if retry is None:
                return done + parts, size
            here, err, failed_at = retry
            if first_oom is None and err is not None:
                traceback.clear_frames(err.__traceback__)  # keeps its message and lines, not the attempt's tensors
                first_oom = err
            if resume:
                done, begin = done + parts, failed_at
            del retry, err, parts
            # out of the except block: the failed attempt's activations are unreachable now
            restore(begin)
            gc.collect()
            release()
            new = next_micro_batch_size(size, min_micro_batch_size) or min_micro_batch_size  # a retry: size > min
            on_halve(size, new, here)
            size = new
        except BaseException as error:  # re-raised, chained to the out-of-memory error being recovered from
            if first_oom is not None and not isinstance(error, torch.OutOfMemoryError) and error.__cause__ is None:
                error.__cause__, error.__suppress_context__ = first_oom, True  # as `raise error from first_oom`
            raise


class _Run(NamedTuple):
    """One attempt over a batch: its samples, the first sample to run, the micro-batch size and the smallest one."""

    batch_size: int
    begin: int
    size: int
    min_size: int


def _attempt(
    run: _Run,
    step: Callable[[int, int], MicroBatchPart],
    comm: Agreement,
    give_up: Callable[[BaseException, int], None],
) -> tuple[list[MicroBatchPart], tuple[bool, BaseException | None, int] | None]:
    """One run over the batch from ``run.begin`` at ``run.size``: the parts of the rounds that went through on every
    rank, and ``None`` or ``(here, error, first sample of the round that failed)`` when it must run again."""
    size, min_size = run.size, run.min_size

    def on_oom(err: torch.OutOfMemoryError) -> int:
        if next_micro_batch_size(size, min_size) is not None:
            return RETRY
        give_up(err, size)
        if not comm.active:
            raise err
        return GIVE_UP

    parts: list[MicroBatchPart] = []
    flag, error, start = _rounds(run, step, comm, on_oom, parts)
    if flag == GIVE_UP:
        if error is not None:
            raise error
        raise torch.OutOfMemoryError(
            f"AutoMicroBatch: another process ran out of memory at a micro-batch of {size} sample(s), the"
            f" smallest allowed (min_micro_batch_size={min_size}); every process stops."
        )
    return parts, None if flag == OK else (error is not None, error, start)


def _rounds(
    run: _Run,
    step: Callable[[int, int], MicroBatchPart],
    comm: Agreement,
    on_oom: Callable[[torch.OutOfMemoryError], int],
    parts: list[MicroBatchPart],
) -> tuple[int, BaseException | None, int]:
    """The micro-batch rounds of one attempt, each part appended to ``parts``: ``(flag, this rank's error, first
    sample of the last round)``.

    Every rank runs the same number of rounds (a rank with fewer samples idles through the rest): each round ends with
    one agreement on whether any rank ran out of memory and whether any has samples left.
    """
    flag, error, start = OK, None, run.begin
    for k in itertools.count():
        start, stop = run.begin + k * run.size, min(run.batch_size, run.begin + (k + 1) * run.size)
        agreed, kept, more = False, len(parts), 0
        if start < run.batch_size:
            flag, error, agreed = _round(functools.partial(step, start, stop), comm, parts, on_oom)
        if not agreed:
            flag, more = comm.agree(flag, int(stop < run.batch_size))
        if flag != OK:
            del parts[kept:]  # this rank's part of the failed round, if it went through here, runs again
            break
        if not more:
            break
    return flag, error, start


def _round(
    run: Callable[[], MicroBatchPart],
    comm: Agreement,
    parts: list[MicroBatchPart],
    on_oom: Callable[[torch.OutOfMemoryError], int],
) -> tuple[int, BaseException | None, bool]:
    """One micro-batch: ``(flag, this rank's out-of-memory error or None, whether the ranks already agreed on flag)``.

    ``on_oom(err)`` turns this rank's out-of-memory error into the flag to send (or raises it on one process).
    """
    try:
        with comm.no_sync(), comm.step():
            part = run()
        parts.append(part)
        del part
    except PeerOutOfMemoryError as err:  # learned at a collective of forward or backward: that was the agreement
        return err.flag, None, True
    except torch.OutOfMemoryError as err:
        if is_unrecoverable(err):  # the others wait inside a collective: no agreement can be reached
            raise
        return on_oom(err), err, False
    return OK, None, False
