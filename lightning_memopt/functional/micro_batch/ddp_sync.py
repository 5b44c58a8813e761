"""AutoMicroBatch's gradient reduction under DDP: the communication hook the user registered, run on DDP's own buckets.

AutoMicroBatch runs every micro-batch without DDP's reducer and reduces the accumulated gradients itself, once per
optimizer step: a rank that runs out of memory inside a backward that the reducer syncs leaves the other ranks inside
bucket all-reduces it never joins (gloo aborts the process with a collective mismatch, NCCL waits for its time-out),
and no rank can know before a backward that it will fit. Without a hook the gradients of a batch that every rank runs
as one micro-batch are averaged during its backward
(:class:`~lightning_memopt.functional.micro_batch.ddp_overlap.OverlappedReduction`), others after the last micro-batch
(a plain
average: :meth:`~lightning_memopt.functional.micro_batch.retry.Agreement.average_gradients`). With a hook
(fp16 compression, PowerSGD, post-local SGD, one of the user's), :func:`reduce_with_comm_hook` fills DDP's buckets with
the accumulated gradients and hands each one to the hook through the reducer, in the reducer's order, as DDP does at
the end of a synced backward and as its join mode does for a rank that ran out of data: the hook and its state see
one call per bucket per optimizer step, as with Lightning's own ``accumulate_grad_batches`` under DDP.

:func:`check_ddp_for_micro_batches` refuses the DDP settings this cannot serve, naming the setting and the choice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_memopt.utilities._torch_private import (
    ddp_comm_hook_name,
    ddp_delays_all_reduce,
    ddp_gradient_buckets,
    ddp_replays_comm_hook,
    run_ddp_comm_hook,
)

__all__ = [
    "check_ddp_for_micro_batches",
    "check_strategy_for_micro_batches",
    "comm_hook_name",
    "gradient_reduction",
    "reduce_with_comm_hook",
]


def _is_ddp(module: Any) -> bool:
    return isinstance(module, torch.nn.parallel.DistributedDataParallel)


def check_strategy_for_micro_batches(
    name: str, world_size: int, is_ddp: bool, is_fsdp2: bool = False, tensor_parallel_size: int = 1
) -> None:
    """Refuse a strategy (class ``name``) whose collectives inside forward and backward have no agreement point.

    Accepted: one device, DDP, and FSDP2 without tensor parallelism (``is_fsdp2``: Lightning's
    ``ModelParallelStrategy`` with ``tensor_parallel_size=1``; its collectives agree first, see
    :mod:`~lightning_memopt.functional.micro_batch.fsdp_sync`). Refused: FSDP1 (``FSDPStrategy``), DeepSpeed, tensor
    parallelism
    (``tensor_parallel_size`` > 1, named as the cause).

    Examples:
        >>> check_strategy_for_micro_batches("DDPStrategy", 2, is_ddp=True)  # accepted: nothing happens
        >>> check_strategy_for_micro_batches("ModelParallelStrategy", 2, is_ddp=False, is_fsdp2=True)  # accepted
        >>> check_strategy_for_micro_batches("ModelParallelStrategy", 2, is_ddp=False, tensor_parallel_size=2)
        Traceback (most recent call last):
        ...
        ValueError: AutoMicroBatch cannot split batches under tensor parallelism (tensor_parallel_size=2 > 1): ...
    """
    if is_fsdp2:
        return
    fix = (
        ' It works on one device, with DDP (`strategy="ddp"`) and with FSDP2 through'
        " `ModelParallelStrategy(tensor_parallel_size=1)` (`fully_shard` per block and on the root in"
        " `configure_model`); use one of these, or remove the callback for this strategy."
    )
    if tensor_parallel_size > 1:
        raise ValueError(
            f"AutoMicroBatch cannot split batches under tensor parallelism (tensor_parallel_size={tensor_parallel_size}"
            f" > 1): {name} then runs tensor parallelism's collectives inside every layer's forward and backward, which"
            " a rank that ran out of memory never reaches (the others would hang), and AutoMicroBatch has no agreement"
            " point in them." + fix
        )
    if any(word in name for word in ("FSDP", "DeepSpeed", "ModelParallel", "Tensor")) or (
        world_size > 1 and not is_ddp
    ):
        raise ValueError(
            f"AutoMicroBatch cannot split the batches of strategy {name}: it runs collectives inside forward and"
            " backward, which a rank that ran out of memory never reaches (the others would hang), and AutoMicroBatch"
            " has no agreement point in them." + fix
        )


def comm_hook_name(module: Any) -> str | None:
    """The DDP communication hook registered on ``module`` (``module.qualname``); ``None`` for none or not DDP.

    Examples:
        >>> comm_hook_name(torch.nn.Linear(2, 2)) is None
        True
    """
    if _is_ddp(module):
        return ddp_comm_hook_name(module)
    return None


def check_ddp_for_micro_batches(module: Any) -> None:
    """Raise a ``ValueError`` for a DDP module whose gradient reduction AutoMicroBatch cannot carry out as DDP would.

    Refused: a communication hook that cannot be run on buckets outside backward (DDP's Python reducer, used under
    compiled autograd, hands hooks single gradients), and ``delay_all_reduce_named_params`` (DDP all-reduces those
    from a gradient hook inside every backward, so one rank out of memory would leave the others waiting). Anything
    that is not DDP passes.

    Examples:
        >>> check_ddp_for_micro_batches(torch.nn.Linear(2, 2))  # not DDP: nothing to check
    """
    if not _is_ddp(module):
        return
    name = comm_hook_name(module)
    if name is not None and not ddp_replays_comm_hook(module):
        raise ValueError(
            f"AutoMicroBatch cannot run the DDP communication hook `{name}`: it reduces the gradients itself once per"
            " optimizer step and runs the hook on DDP's gradient buckets, which this DDP module (its Python reducer,"
            " used under compiled autograd) does not hand out. Remove the hook (`register_comm_hook`, or"
            " `DDPStrategy(ddp_comm_hook=...)`), or remove AutoMicroBatch."
        )
    if ddp_delays_all_reduce(module):
        raise ValueError(
            "AutoMicroBatch cannot run with DDP's `delay_all_reduce_named_params`: DDP all-reduces those parameters"
            " from a gradient hook inside every backward, so a rank that runs out of memory in a backward would leave"
            " the other ranks waiting in that all-reduce. Remove `delay_all_reduce_named_params`, or remove"
            " AutoMicroBatch."
        )


def reduce_with_comm_hook(module: Any, params: Sequence[torch.nn.Parameter]) -> None:
    """Reduce the gradients of ``params`` with the hook registered on the DDP ``module``, bucket by bucket.

    Each of DDP's buckets gets the gradients of its parameters (zeros for a parameter of the bucket not in
    ``params``), the hook runs on every bucket (all started before the first is waited for, in the reducer's order,
    the last one flagged ``is_last()``), and the hook's result goes back into the gradients of ``params``. A parameter
    of ``params`` without a gradient gets one. Parameters DDP does not manage (``_ddp_params_and_buffers_to_ignore``)
    are in no bucket and keep their local gradient, as under DDP.
    """
    wanted = {id(p) for p in params}
    buckets = ddp_gradient_buckets(module)
    futures = []
    for bucket in buckets:
        for param, view in zip(bucket.parameters(), bucket.gradients()):
            if id(param) in wanted and param.grad is not None:
                view.copy_(param.grad)
        futures.append(run_ddp_comm_hook(module, bucket))
    for bucket, future in zip(buckets, futures):
        value = future.wait()
        result: Tensor = value[0] if isinstance(value, (list, tuple)) else value  # C++ hooks answer a list
        buffer = bucket.buffer()
        if result.data_ptr() != buffer.data_ptr():
            buffer.copy_(result.view_as(buffer))
        for param, view in zip(bucket.parameters(), bucket.gradients()):
            if id(param) not in wanted:
                continue
            if param.grad is None:
                param.grad = view.clone()
            else:
                param.grad.copy_(view)


def gradient_reduction(module: Any) -> Callable[[Sequence[torch.nn.Parameter]], None] | None:
    """How the gradients of a stepping batch are reduced: the hook on ``module``'s buckets, or ``None`` (no hook).

    ``None`` means the plain average of
    :meth:`~lightning_memopt.functional.micro_batch.retry.Agreement.average_gradients`.

    Examples:
        >>> gradient_reduction(torch.nn.Linear(2, 2)) is None  # not DDP
        True
    """
    if comm_hook_name(module) is None:
        return None
    check_ddp_for_micro_batches(module)  # a hook registered after fit started
    return lambda params: reduce_with_comm_hook(module, params)
