"""AutoMicroBatch's gradient reduction under DDP, overlapped with the backward of a batch that runs as one micro-batch.

DDP's reducer stays off during every micro-batch (a rank out of memory inside a backward it syncs would leave the
others in bucket all-reduces). When every rank runs its batch as one micro-batch (no out-of-memory error yet, or a
batch small enough), :class:`OverlappedReduction` gives the overlap back: gradient hooks all-reduce bucket after bucket
while the backward goes on through earlier layers, as DDP's reducer does. What keeps a rank that runs out of memory
from leaving the others waiting is one protocol, carried out on every rank in the same order:

1. *The window opens* at the start of the batch's backward (or, for a round without one, at the end of its step): an
   agreement point (:meth:`~lightning_memopt.functional.micro_batch.retry.Agreement.start_point`, a two-element
   all-reduce started without waiting) says whether some rank ran out of memory before (it abandons the window) and
   whether some rank needs more than one micro-batch (nobody all-reduces in the window; the reduction after the
   batch takes over). Its result is first needed when the first bucket is ready, so its latency hides behind the
   backward.
2. *Buckets* (parameters in reverse order, DDP's ``bucket_cap_mb``, a small first bucket) start their all-reduce in
   bucket order as their gradients come in; the gradient moves into the bucket (``param.grad = None``), so the
   copies cost no memory beyond the gradients. After backward the rest follow.
3. *The last bucket* (the first parameters, whose gradients come last) starts after backward and also carries which
   parameters have a gradient on some rank and which buckets got a gradient after their all-reduce had started (a
   parameter used again by a reentrant checkpoint). Those buckets get a second all-reduce of what came late; the
   result is the average of the whole gradients (to rounding).
4. *The window closes*: each gradient is a view into its averaged bucket (as with DDP's ``gradient_as_bucket_view``).

A rank that runs out of memory inside its window completes the protocol with stand-in buckets before its agreement
(:meth:`OverlappedReduction.complete`, which the agreement calls), so the others' all-reduces meet theirs and the
ranks learn of the failure together, at the round's agreement. The gradients of the failed attempt are put back as
after any out-of-memory error.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_memopt.functional.micro_batch.retry import (
    BUCKET_BYTES,
    OK,
    Agreement,
    PeerOutOfMemoryError,
    PendingPoint,
)

__all__ = ["FIRST_BUCKET_BYTES", "OverlappedReduction", "gradient_buckets"]

#: The first bucket's cap (DDP's too): its all-reduce starts early in the backward.
FIRST_BUCKET_BYTES = 2**20


def gradient_buckets(
    params: Sequence[torch.nn.Parameter], bucket_bytes: int = BUCKET_BYTES, first_bucket_bytes: int = FIRST_BUCKET_BYTES
) -> list[list[int]]:
    """Indices into ``params``, last parameter first (the order backward produces gradients in), in buckets of one
    dtype and device of at most ``bucket_bytes`` (the first at most ``first_bucket_bytes``; a larger parameter alone).

    Examples:
        >>> params = [torch.nn.Parameter(torch.zeros(n)) for n in (4, 4, 2)]
        >>> gradient_buckets(params, bucket_bytes=32, first_bucket_bytes=8)
        [[2], [1, 0]]
    """
    buckets: list[list[int]] = []
    cap, size, kind = min(first_bucket_bytes, bucket_bytes), 0, None
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        if not buckets or (p.dtype, p.device) != kind or size + nbytes > cap:
            if buckets:
                cap = bucket_bytes
            buckets.append([])
            size, kind = 0, (p.dtype, p.device)
        buckets[-1].append(i)
        size += nbytes
    return buckets


@dataclasses.dataclass
class _Bucket:
    """One bucket in one window: its parameters, the gradients still to come, its all-reduce."""

    indices: list[int]
    numel: int
    pending: int = 0
    flat: Tensor | None = None
    work: Any = None
    late: bool = False  # a gradient came in after the all-reduce started


class OverlappedReduction:
    """Average the gradients of ``params`` over the ranks while backward runs (see the module's protocol).

    Args:
        params: the parameters whose gradients are averaged (those that require one, in the module's order).
        agreement: the ranks' agreement (active: a process group is there).
        bucket_bytes: the most bytes one all-reduce carries (DDP's ``bucket_cap_mb``).

    Attributes:
        reduced: whether the latest window averaged the gradients (``False``: the reduction after the batch must).
        launched_in_backward: buckets whose all-reduce started from a gradient hook, in all windows (for tests and
            the benchmark).
        late_windows: windows where a gradient came in after its bucket's all-reduce started.
    """

    def __init__(
        self, params: Sequence[torch.nn.Parameter], agreement: Agreement, bucket_bytes: int = BUCKET_BYTES
    ) -> None:
        self.params = list(params)
        self.agreement = agreement
        self._buckets = [
            _Bucket(indices, sum(self.params[i].numel() for i in indices))
            for indices in gradient_buckets(self.params, bucket_bytes)
        ]
        self._bucket_of = {i: b for b, bucket in enumerate(self._buckets) for i in bucket.indices}
        #: the last bucket also carries, after its gradients, which parameters have one and which buckets got one
        #: late (each a count over the ranks: > 0 means some rank did); it starts after backward, never from a hook
        self._facts = len(self.params) + len(self._buckets)
        self._handles = [
            p.register_post_accumulate_grad_hook(functools.partial(self._gradient_ready, i))
            for i, p in enumerate(self.params)
        ]
        self.armed = False  # the next backward (or the end of this step) opens a window
        self._more = False
        self._open = False
        self._point: PendingPoint | None = None
        self._decided: tuple[int, int] | None = None
        self._next = 0  # the first bucket whose all-reduce has not started
        self._averaged: set[int] = set()  # buckets whose late gradients were all-reduced in this window
        self.reduced = False
        self.launched_in_backward = 0
        self.late_windows = 0

    def matches(self, params: Sequence[torch.nn.Parameter]) -> bool:
        """Whether this reduction serves exactly ``params`` (it does not after layers were frozen or unfrozen)."""
        return len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params))

    def remove(self) -> None:
        """Take the gradient hooks off the parameters."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._reset()

    # ------------------------------------------------------------------------------------------- the window

    def arm(self, more: bool) -> None:
        """The first micro-batch of an attempt starts: its backward opens a window; ``more``: this rank has samples
        left for another micro-batch (then no rank all-reduces in the window)."""
        self.armed, self._more = True, more

    def wrap_backward(self, backward: Callable[..., Any]) -> Callable[..., Any]:
        """``backward`` (``LightningModule.backward``) run inside a window when :attr:`armed`."""

        @functools.wraps(backward)
        def windowed(*args: Any, **kwargs: Any) -> Any:
            if not self.armed:
                return backward(*args, **kwargs)
            return self._window(lambda: backward(*args, **kwargs))

        return windowed

    def finish_step(self) -> None:
        """At the end of a micro-batch step: a first round that ran no backward (its loss was ``None``, or its weight
        0) still opens and closes its window, with the gradients it has, as every other rank does."""
        if self.armed:
            self._window(lambda: None)

    def _window(self, body: Callable[[], Any]) -> Any:
        self.armed, self._open, self._next, self.reduced = False, True, 0, False
        self._averaged = set()
        for bucket in self._buckets:
            bucket.pending, bucket.flat, bucket.work, bucket.late = len(bucket.indices), None, None, False
        self._point, self._decided = self.agreement.start_point(OK, int(self._more)), None
        self.agreement.before_agreeing = self.complete
        try:
            result = body()
        except PeerOutOfMemoryError:
            raise
        except torch.OutOfMemoryError:
            flag, _ = self._decision()
            if flag != OK:  # the point was this round's agreement: another rank ran out of memory before it
                self._reset()
                raise PeerOutOfMemoryError(flag) from None
            raise  # the window stays open: the round's agreement completes it (complete)
        self._close()
        return result

    def _decision(self) -> tuple[int, int]:
        """What the window's point agreed: (flag, whether some rank needs more than one micro-batch)."""
        if self._decided is None:
            assert self._point is not None
            self._decided = self._point.wait()
        return self._decided

    def _overlapping(self) -> bool:
        flag, more = self._decision()
        return flag == OK and not more

    def _gradient_ready(self, index: int, param: torch.nn.Parameter) -> None:
        if not self._open:
            return
        bucket = self._buckets[self._bucket_of[index]]
        if bucket.flat is not None:  # its all-reduce started: this gradient came late
            bucket.late = True
            return
        bucket.pending -= 1
        last = len(self._buckets) - 1
        while self._next < last and self._buckets[self._next].pending == 0 and self._overlapping():
            self._launch(self._buckets[self._next])
            self.launched_in_backward += 1

    def _flat(self, bucket: _Bucket, facts: Sequence[bool] = ()) -> Tensor:
        """An uninitialised flat tensor for ``bucket``'s gradients, followed by ``facts`` (as 0 and 1)."""
        first = self.params[bucket.indices[0]]
        flat = torch.empty(bucket.numel + len(facts), dtype=first.dtype, device=first.device)
        if facts:
            flat[bucket.numel :].copy_(torch.tensor(facts, dtype=flat.dtype))
        return flat

    def _launch(self, bucket: _Bucket, facts: Sequence[bool] = ()) -> None:
        """Move the bucket's gradients (and ``facts``) into one flat tensor and start its all-reduce."""
        flat = self._flat(bucket, facts)
        offset = 0
        for i in bucket.indices:
            p = self.params[i]
            part = flat[offset : offset + p.numel()]
            if p.grad is None:
                part.zero_()
            else:
                part.copy_(p.grad.reshape(-1))
                p.grad = None  # the bucket holds it now
            offset += p.numel()
        bucket.flat, self._next = flat, self._next + 1
        bucket.work = torch.distributed.all_reduce(flat, async_op=True)

    def _close(self) -> None:
        """After a backward that went through: the rest of the buckets, the last with the facts, the gradients back."""
        flag, more = self._decision()
        if flag != OK:
            self._reset()
            raise PeerOutOfMemoryError(flag)
        if more:  # some rank runs more than one micro-batch: the reduction after the batch averages
            self._reset()
            return
        has = [p.grad is not None for p in self.params]  # before the rest of the buckets take the gradients
        for bucket in self._buckets[: self._next]:  # all-reduced from backward: each of its parameters had one
            for i in bucket.indices:
                has[i] = True
        *rest, last = self._buckets[self._next :]
        for bucket in rest:
            self._launch(bucket)
        self._launch(last, has + [b.late for b in self._buckets])
        for bucket in self._buckets:
            bucket.work.wait()
        has_any, late = self._facts_of(last)
        world = torch.distributed.get_world_size()
        for b, bucket in enumerate(self._buckets):
            assert bucket.flat is not None
            bucket.flat.div_(world)
            self._give_back(b, has_any, late[b], world)
        self.late_windows += any(late)
        self.reduced = True
        self._reset()

    def _facts_of(self, last: _Bucket) -> tuple[list[bool], list[bool]]:
        """From the last bucket's all-reduced flat: which parameters have a gradient on some rank, and which buckets
        got a late gradient on some rank (a sum of 0s and 1s is positive exactly when one was 1, in any dtype)."""
        assert last.flat is not None
        values = [v > 0 for v in last.flat[last.numel :].tolist()]
        return values[: len(self.params)], values[len(self.params) :]

    def _give_back(self, b: int, has_any: list[bool], late: bool, world: int) -> None:
        """Each gradient of bucket ``b`` becomes its averaged part (plus the average of the late parts if ``late``)."""
        bucket = self._buckets[b]
        assert bucket.flat is not None
        extra = None
        if late:
            extra = self._late_average(b, world)
        offset = 0
        for i in bucket.indices:
            p = self.params[i]
            part = bucket.flat[offset : offset + p.numel()].view(p.shape)
            if extra is not None:
                part = part + extra[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
            if has_any[i]:
                if p.is_contiguous():
                    p.grad = part
                else:
                    p.grad = torch.empty_like(p).copy_(part)

    def _late_average(self, b: int, world: int) -> Tensor:
        """The average over the ranks of what came in after bucket ``b``'s all-reduce started (zeros where nothing)."""
        bucket = self._buckets[b]
        first = self.params[bucket.indices[0]]
        flat = torch.zeros(bucket.numel, dtype=first.dtype, device=first.device)
        offset = 0
        for i in bucket.indices:
            p = self.params[i]
            if p.grad is not None:
                flat[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
            offset += p.numel()
        torch.distributed.all_reduce(flat)
        self._averaged.add(b)
        return flat.div_(world)

    def complete(self) -> None:
        """Complete an open window after an out-of-memory error here (called by the round's agreement): the buckets
        the other ranks all-reduce, with stand-ins (and what came late on them); nothing of this attempt is kept."""
        if not self._open:
            return
        if self._overlapping():
            last = self._buckets[-1]
            for bucket in self._buckets:
                if bucket.work is not None:
                    bucket.work.wait()
                    if bucket is not last:
                        bucket.flat = None  # released before the next stand-in is made
            for bucket in self._buckets[self._next : len(self._buckets) - 1]:
                self._stand_in(bucket)
            if last.work is None:
                last.flat = self._stand_in(last, [False] * self._facts)
            _, late = self._facts_of(last)
            for b, bucket in enumerate(self._buckets):
                if late[b] and b not in self._averaged:  # another rank all-reduces what came late there
                    self._stand_in(bucket)
        self._reset()

    def _stand_in(self, bucket: _Bucket, facts: Sequence[bool] = ()) -> Tensor:
        """An all-reduce of the size another rank runs for ``bucket``, of zeros (and ``facts``)."""
        flat = self._flat(bucket, facts)
        flat[: bucket.numel].zero_()
        torch.distributed.all_reduce(flat)
        return flat

    def _reset(self) -> None:
        self._open, self.armed, self._point = False, False, None
        for bucket in self._buckets:
            bucket.flat, bucket.work = None, None
        if self.agreement.before_agreeing == self.complete:
            self.agreement.before_agreeing = None
