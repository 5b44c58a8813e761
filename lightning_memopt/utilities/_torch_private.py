"""The quarantine for private torch APIs.

Every call into a private torch API (allocator history, OOM observers, snapshot dumps, DDP's reducer) lives in this
module, behind feature checks, so that a torch upgrade that moves one of them breaks one file and
degrades to a warning, never a crash.
"""

from __future__ import annotations

import contextlib
import os
import time
from datetime import timedelta
from typing import Any

import torch

from lightning_memopt.utilities.shared_state import Lease, Restore, borrow
from lightning_memopt.utilities.warnings import WarnOnce

__all__: list[str] = [
    "active_fake_mode",
    "backward_outside_torch_function",
    "ddp_comm_hook_name",
    "decomposed_in_mode",
    "outside_fake_mode",
    "ddp_delays_all_reduce",
    "ddp_gradient_buckets",
    "ddp_replays_comm_hook",
    "run_ddp_comm_hook",
    "dump_memory_snapshot",
    "fsdp2_sharded_parameters",
    "fsdp2_unit_policy",
    "count_at_peers",
    "forget_at_peers",
    "peer_wrote",
    "publish_to_peers",
    "read_from_peer",
    "wait_for_count",
    "storage_weak_ref",
    "start_memory_history",
    "stop_memory_history",
    "supports_memory_history",
    "tensor_version",
    "uncounted_dtensor_metadata",
    "without_subclass_functions",
]


def _cuda_memory_module() -> Any:
    return getattr(getattr(torch, "cuda", None), "memory", None)


def supports_memory_history() -> bool:
    """Whether this torch build can record CUDA allocator history and dump snapshots, with a GPU present.

    Examples:
        >>> isinstance(supports_memory_history(), bool)
        True
    """
    memory = _cuda_memory_module()
    return bool(
        memory is not None
        and hasattr(memory, "_record_memory_history")
        and hasattr(memory, "_dump_snapshot")
        and torch.cuda.is_available()
    )


def start_memory_history(max_entries: int) -> bool:
    """Start recording allocator history (allocations, frees, stack traces), keeping the last ``max_entries``.

    Returns:
        Whether recording was started. ``False`` when the build or device cannot record.
    """
    if not supports_memory_history():
        return False
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="all", max_entries=max_entries)
    return True


def stop_memory_history() -> bool:
    """Stop recording allocator history. Returns whether it was asked to stop."""
    if not supports_memory_history():
        return False
    torch.cuda.memory._record_memory_history(enabled=None)
    return True


def _history_enabled() -> bool:
    """Whether allocator history is being recorded now (``False`` where this torch cannot tell)."""
    is_enabled = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    if is_enabled is None:
        return False
    try:
        return bool(is_enabled())
    except RuntimeError:
        return False


def _stop_memory_history() -> None:
    stop_memory_history()


def borrow_memory_history(max_entries: int, warn: WarnOnce | None = None) -> Lease | None:
    """:func:`start_memory_history` for one run, shared by the runs of this process that overlap it.

    The first run in starts recording and the last one out stops it; recording the application started itself is
    left running. ``None`` (nothing held) when this build or device cannot record. An overlapping run that asks for
    another ``max_entries`` records with the first one's and is warned once.
    """

    def apply(entries: int) -> Restore | None:
        if _history_enabled():
            return lambda: None  # the application records: its recording is not ours to stop
        return _stop_memory_history if start_memory_history(entries) else None

    return borrow("cuda.memory_history", max_entries, apply, warn, "OOMReporter")


def dump_memory_snapshot(path: str | os.PathLike[str]) -> bool:
    """Write the allocator snapshot (segments plus recorded history) to ``path`` as a pickle.

    The file opens in PyTorch's memory viewer (https://pytorch.org/memory_viz) or with
    ``python -m torch.cuda._memory_viz trace_plot FILE -o FILE.html``.

    Returns:
        Whether a file was written.
    """
    if not supports_memory_history():
        return False
    torch.cuda.memory._dump_snapshot(os.fspath(path))
    return True


def tensor_version(tensor: torch.Tensor) -> int | None:
    """``tensor._version``, the counter every in-place change of the tensor raises; ``None`` where it has none
    (inference-mode tensors) or this torch lacks it.

    Examples:
        >>> t = torch.zeros(2)
        >>> before = tensor_version(t)
        >>> _ = t.add_(1)
        >>> tensor_version(t) > before
        True
    """
    try:
        return int(tensor._version)
    except (AttributeError, RuntimeError):  # inference tensors raise; a torch without the counter
        return None


def storage_weak_ref(tensor: torch.Tensor) -> Any:
    """A weak reference to ``tensor``'s storage with ``expired()``; ``None`` where this torch has none or the tensor
    has no storage (sparse layouts).

    Tells whether a storage is still alive after its tensor was replaced (someone else holds it).

    Examples:
        >>> t = torch.ones(4)
        >>> ref = storage_weak_ref(t)
        >>> ref is None or (ref.expired(), (t := None), ref.expired())[::2] == (False, True)
        True
        >>> storage_weak_ref(torch.ones(2, 2).to_sparse()) is None
        True
    """
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(tensor.untyped_storage())
    except (ImportError, AttributeError, RuntimeError):  # moved in this torch; no storage (NotImplementedError)
        return None


def backward_outside_torch_function(loss: torch.Tensor) -> None:
    """``loss.backward()`` straight into the autograd engine, not through ``__torch_function__`` handling.

    ``Tensor.backward`` hands itself to an active ``TorchFunctionMode``, which runs it with the mode switched off; the
    engine call keeps the mode on for code that runs inside backward (activation checkpointing's recomputed forward).
    Falls back to ``loss.backward()`` where the engine is not reachable.
    """
    engine = getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)
    if engine is None or not hasattr(engine, "run_backward"):
        loss.backward()
        return
    engine.run_backward(
        (loss,), (torch.ones_like(loss),), False, False, (), allow_unreachable=True, accumulate_grad=True
    )


def outside_fake_mode() -> contextlib.AbstractContextManager[Any]:
    """A context where torch operators run on real tensors although a fake tensor mode is active (its operators are
    handed to the real kernels again when the context ends); nothing, where torch has no such switch."""
    from torch._subclasses import fake_tensor  # the planner's import: callbacks never load fake tensors

    unset = getattr(fake_tensor, "unset_fake_temporarily", None)
    if unset is None:
        return contextlib.nullcontext()
    return unset()


def active_fake_mode() -> Any:
    """The fake tensor mode operators run in now (``None``: none, or inside :func:`outside_fake_mode`)."""
    get, keys = getattr(torch._C, "_get_dispatch_mode", None), getattr(torch._C, "_TorchDispatchModeKey", None)
    if get is None or keys is None:
        return None
    return get(keys.FAKE)


def without_subclass_functions() -> contextlib.AbstractContextManager[Any]:
    """A context where a tensor subclass's ``__torch_function__`` is not called (its operators run as a plain
    tensor's, their results not wrapped in the subclass); nothing, where torch has no such switch."""
    disable = getattr(torch._C, "DisableTorchFunctionSubclass", None)
    if disable is None:
        return contextlib.nullcontext()
    return disable()


def decomposed_in_mode(mode: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``func``'s own decomposition (a composite operator) from inside ``mode``'s ``__torch_dispatch__`` with
    ``mode`` active again, so that ``mode`` sees the operators it is made of; ``func`` as it is where torch has no
    way to re-activate a mode."""
    from torch.utils import _python_dispatch

    push, pop = getattr(_python_dispatch, "_push_mode", None), getattr(_python_dispatch, "_pop_mode", None)
    if push is None or pop is None:
        return func(*args, **kwargs)
    push(mode)
    try:
        return func.decompose(*args, **kwargs)
    finally:
        pop()


@contextlib.contextmanager
def uncounted_dtensor_metadata(pause: Any, resume: Any) -> Any:
    """While entered, ``pause()`` and ``resume()`` are called around each of DTensor's sharding-propagation runs: the
    operator run once per new signature on global-shape fake tensors to learn its output's shape (no memory in a real
    run; under an estimate's fake mode a counter would take them for tensors). Nothing where torch has no such
    method."""
    try:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:  # pragma: no cover - a build without torch.distributed
        yield
        return
    original = getattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", None)
    if original is None:  # pragma: no cover - a torch that moved it: the tensors are counted, as before
        yield
        return

    def propagate(self: Any, *args: Any, **kwargs: Any) -> Any:
        pause()
        try:
            return original(self, *args, **kwargs)
        finally:
            resume()

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original  # type: ignore[method-assign]


def ddp_comm_hook_name(module: Any) -> str | None:
    """The communication hook registered on a ``DistributedDataParallel`` module; ``None`` when there is none.

    A Python hook (``register_comm_hook``) is named ``module.qualname``; a built-in C++ hook
    (``_register_builtin_comm_hook``) by the name DDP logs for it (``BuiltinCommHookType.FP16_COMPRESS``).

    Examples:
        >>> ddp_comm_hook_name(torch.nn.Linear(2, 2)) is None  # not DDP: no hook
        True
    """
    hooks = getattr(module, "_comm_hooks", None)
    if hooks:
        hook = hooks[-1][0]
        qualname = getattr(hook, "__qualname__", None) or type(hook).__qualname__
        return f"{getattr(hook, '__module__', None) or type(hook).__module__}.{qualname}"
    logging_data = getattr(module, "_get_ddp_logging_data", None)  # a built-in hook is only named there
    if not callable(logging_data) or getattr(module, "logger", None) is None:
        return None
    name = logging_data().get("comm_hook")
    return str(name) if name else None


def ddp_replays_comm_hook(module: Any) -> bool:
    """Whether the hook of this DDP module can be run outside backward on its buckets (as DDP's join mode does).

    ``False`` where the reducer lacks the calls (another torch) or DDP uses its Python reducer (compiled autograd),
    which hands hooks one gradient at a time instead of buckets.
    """
    reducer = getattr(module, "reducer", None)
    return (
        reducer is not None
        and hasattr(reducer, "_get_zeros_like_grad_buckets")
        and hasattr(reducer, "_run_comm_hook")
        and not getattr(module, "_use_python_reducer", False)
    )


def ddp_delays_all_reduce(module: Any) -> bool:
    """Whether DDP all-reduces some parameters from a gradient hook of its own (``delay_all_reduce_named_params``).

    That hook runs in every backward, ``no_sync`` or not.
    """
    return bool(getattr(module, "_delay_all_reduce_params", None))


def ddp_gradient_buckets(module: Any) -> list[Any]:
    """The reducer's gradient buckets (``GradBucket``), in its order, each with a zero-filled flat buffer.

    ``bucket.parameters()`` and ``bucket.gradients()`` pair each parameter with its view into ``bucket.buffer()``.
    """
    return list(module.reducer._get_zeros_like_grad_buckets())


def run_ddp_comm_hook(module: Any, bucket: Any) -> Any:
    """Start the registered hook (or DDP's summing all-reduce without one) on ``bucket``; a future of its result."""
    return module.reducer._run_comm_hook(bucket)


def _fsdp2_param_group(module: Any) -> Any:
    """The parameter group of an FSDP2 unit (FSDP2's private state), ``None`` for any other module."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if not callable(get_state):
        return None
    try:
        return getattr(get_state(), "_fsdp_param_group", None)
    except (AssertionError, AttributeError, RuntimeError, TypeError):
        return None


def fsdp2_sharded_parameters(module: Any) -> list[tuple[Any, str, Any]]:
    """``(owning module, parameter name, sharded DTensor)`` of every parameter the FSDP2 units in ``module`` manage.

    While a unit has gathered its parameters (between its forward and backward), the module's attribute is the whole
    tensor; its shard stays here. Empty where this torch build keeps them elsewhere (read from FSDP2's private state).
    """
    if not torch.distributed.is_available():
        return []
    from torch.distributed.fsdp import FSDPModule

    found = []
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        group = _fsdp2_param_group(sub)
        for param in getattr(group, "fsdp_params", None) or ():
            info = getattr(param, "_module_info", None)
            sharded = getattr(param, "sharded_param", None)
            if info is not None and isinstance(sharded, torch.Tensor):
                found.append((info.module, str(info.param_name), sharded))
    return found


def fsdp2_unit_policy(module: Any) -> dict[str, Any] | None:
    """What ``fully_shard`` was told for ``module`` (an ``FSDPModule``): ``reshard_after_forward``,
    ``cpu_offload`` (a ``CPUOffloadPolicy``), ``param_dtype`` and ``reduce_dtype`` of its ``MixedPrecisionPolicy``
    (dtype names, ``None`` when unset). ``None`` when the unit holds no parameters or this torch build keeps these
    elsewhere (read from FSDP2's private state).
    """
    group = _fsdp2_param_group(module)
    if group is None or not hasattr(group, "post_forward_mesh_info"):
        return None
    policy = getattr(group, "mp_policy", None)

    def dtype_name(name: str) -> str | None:
        dtype = getattr(policy, name, None)
        return None if dtype is None else str(dtype)

    offload = getattr(group, "offload_policy", None)
    return {
        "reshard_after_forward": group.post_forward_mesh_info is not None,
        "cpu_offload": type(offload).__name__ == "CPUOffloadPolicy",
        "param_dtype": dtype_name("param_dtype"),
        "reduce_dtype": dtype_name("reduce_dtype"),
    }


def _default_store() -> Any:
    """The key-value store the default process group was set up with; ``None`` without one (or where this torch build
    keeps it elsewhere)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    get_store = getattr(torch.distributed.distributed_c10d, "_get_default_store", None)
    if not callable(get_store):
        return None
    try:
        return get_store()
    except (RuntimeError, ValueError):
        return None


def publish_to_peers(key: str, value: str) -> bool:
    """Write ``value`` under ``key`` in the default process group's store, for the other processes to read while the
    process group's collectives can no longer carry it. Returns whether it was written."""
    store = _default_store()
    if store is None:
        return False
    try:
        store.set(key, value)
    except (RuntimeError, OSError):  # the store's host process is gone
        return False
    return True


def read_from_peer(key: str, timeout_s: float) -> str | None:
    """What another process wrote under ``key`` (:func:`publish_to_peers`), waiting at most ``timeout_s``; ``None``
    when nothing came in time or the store is gone with the process that hosted it (rank 0)."""
    store = _default_store()
    if store is None:
        return None
    try:
        store.wait([key], timedelta(seconds=timeout_s))
        return bytes(store.get(key)).decode("utf-8", errors="replace")
    except (RuntimeError, OSError):
        return None


def peer_wrote(key: str) -> bool:
    """Whether another process wrote ``key`` into the default process group's store, without waiting for it."""
    store = _default_store()
    if store is None:
        return False
    try:
        return bool(store.check([key]))
    except (RuntimeError, OSError):
        return False


def wait_for_count(key: str, target: int, timeout_s: float, period_s: float = 0.05) -> bool:
    """Wait, at most ``timeout_s``, until the counter ``key`` (:func:`count_at_peers`) reaches ``target``; whether it
    did (``False`` at once without a store or when its host process is gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        count = count_at_peers(key, 0)
        if count is None:
            return False
        if count >= target:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(period_s)


def count_at_peers(key: str, amount: int = 1) -> int | None:
    """Add ``amount`` to the counter ``key`` of the default process group's store (``0``: read it); its new value,
    ``None`` without a store or when its host process is gone."""
    store = _default_store()
    if store is None:
        return None
    try:
        return int(store.add(key, amount))
    except (RuntimeError, OSError):
        return None


def forget_at_peers(*keys: str) -> None:
    """Delete ``keys`` from the default process group's store, where the store can delete (``delete_key``); a key
    that is not there, a store without deletion or one whose host is gone is left as it is."""
    store = _default_store()
    delete = getattr(store, "delete_key", None)
    if delete is None:
        return
    for key in keys:
        with contextlib.suppress(RuntimeError, OSError):  # not supported by this store, or its host is gone
            delete(key)
