"""Readers of the parts of an out-of-memory report: each takes what it needs as arguments, none needs a Trainer."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, cast

import torch
from torch import nn

from lightning_memopt.functional import footprint as fp
from lightning_memopt.functional.oom.batch import describe_batch, mask_lengths
from lightning_memopt.functional.oom.schema import (
    BatchLengths,
    BatchSection,
    ChainedError,
    CheckpointingState,
    ErrorSection,
    FootprintRowDict,
    HoldersSection,
    LiveTensorDict,
    MemorySection,
    SnapshotSection,
)
from lightning_memopt.functional.readings.memory import MemoryReading, supports_device_memory
from lightning_memopt.utilities.oom import find_in_traceback
from lightning_memopt.utilities.redaction import redact_secrets

__all__ = [
    "HOW_TO_OPEN",
    "batch_section",
    "checkpointing_state",
    "describe_error",
    "error_chain",
    "fill_holders",
    "hparams_as_json",
    "json_default",
    "live_tensor_dict",
    "memory_section",
    "memory_summary",
    "take_snapshot",
]

#: How to open an allocator snapshot (``{name}``: the file's name, ``{stem}``: without its suffix).
HOW_TO_OPEN = (
    "Open https://pytorch.org/memory_viz in a browser and drop the file on the page (it stays on your machine),"
    " or run `python -m torch.cuda._memory_viz trace_plot {name} -o {stem}.html` and open the HTML file."
)
#: Module names listed in the report where checkpointing is on (the counts are always complete).
MAX_LISTED = 20
#: Chained exceptions listed in ``error.chain`` (a longer chain is cut; a cycle ends it).
MAX_CHAINED = 8


class LiveTensorLike(Protocol):
    """What :func:`live_tensor_dict` reads (a :class:`~lightning_memopt.functional.footprint.LiveTensor`)."""

    @property
    def name(self) -> str | None: ...
    @property
    def shape(self) -> Sequence[int]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def bytes(self) -> int: ...
    @property
    def requires_grad(self) -> bool: ...
    @property
    def has_grad_fn(self) -> bool: ...


def qualified_name(cls: type) -> str:
    """``module.QualName`` of a class; builtins without a module (``RuntimeError``)."""
    module = getattr(cls, "__module__", "") or ""
    return cls.__qualname__ if module in ("builtins", "") else f"{module}.{cls.__qualname__}"


def innermost_location(tb: TracebackType | None) -> str | None:
    """``"function (file:line)"`` of the innermost frame of ``tb``, ``None`` without a traceback."""
    last = None
    while tb is not None:
        last = tb
        tb = tb.tb_next
    if last is None:
        return None
    code = last.tb_frame.f_code
    return f"{code.co_name} ({code.co_filename}:{last.tb_lineno})"


def describe_error(exception: BaseException, message: str) -> ErrorSection:
    """The ``error`` part: the exception's qualified type, ``message`` (its text) and where it was raised.

    Examples:
        >>> describe_error(RuntimeError("boom"), "boom")
        {'type': 'RuntimeError', 'message': 'boom', 'location': None}
    """
    return {
        "type": qualified_name(type(exception)),
        "message": message,
        "location": innermost_location(exception.__traceback__),
    }


def error_chain(exception: BaseException) -> list[ChainedError]:
    """The exceptions behind ``exception``, nearest first: its ``__cause__`` (``raise ... from``), else its
    ``__context__`` (raised while handling it), then that one's, and so on; at most 8, a cycle ends the list.

    A context hidden by ``raise ... from None`` is listed too: it may be the out-of-memory error that made the
    error reportable (:func:`~lightning_memopt.utilities.oom.is_out_of_memory_error` looks through it as well).
    Messages are as ``str()`` gives them (one that fails raises: ``build_oom_report`` then lists the failure in
    ``report_errors`` instead of the chain) and are redacted with the rest of the report.

    Examples:
        >>> try:
        ...     try:
        ...         raise MemoryError("out of memory")
        ...     except MemoryError as oom:
        ...         raise RuntimeError("step 3 failed") from oom
        ... except RuntimeError as err:
        ...     [(entry["relation"], entry["type"], entry["message"]) for entry in error_chain(err)]
        [('cause', 'MemoryError', 'out of memory')]
    """
    chain: list[ChainedError] = []
    seen = {id(exception)}
    current = exception
    while len(chain) < MAX_CHAINED:
        relation = "cause" if current.__cause__ is not None else "context"
        behind = current.__cause__ if current.__cause__ is not None else current.__context__
        if behind is None or id(behind) in seen:
            break
        seen.add(id(behind))
        current = behind
        chain.append(
            {
                "relation": relation,
                "type": qualified_name(type(current)),
                "message": str(current),
                "location": innermost_location(current.__traceback__),
            }
        )
    return chain


def batch_section(tb: TracebackType | None) -> BatchSection:
    """The ``batch`` part: :func:`describe_batch` of the local ``batch`` of the innermost frame that has one."""
    found = find_in_traceback(tb, "batch")
    if found is None:
        return {"found_in": None, "tensors": [], "num_tensors": 0, "micro_batch_size": None}
    batch = describe_batch(found.value)
    batch["found_in"] = f"{found.function} ({found.location})"
    return batch


def lengths_from(tb: TracebackType | None, lengths_fn: Callable[[Any], Any]) -> list[BatchLengths]:
    """``batch.lengths`` from ``lengths_fn(batch)`` (a padding mask) of the local ``batch`` the ``batch`` part read;
    empty without one."""
    found = find_in_traceback(tb, "batch")
    if found is None:
        return []
    return mask_lengths("lengths_fn(batch)", lengths_fn(found.value))


def memory_section(reading: MemoryReading) -> MemorySection:
    """The ``memory`` part as read (``summary`` and ``message_*`` are added by ``build_oom_report``)."""
    return cast(MemorySection, reading.as_dict())


def memory_summary(device: torch.device) -> str | None:
    """``torch.<device type>.memory_summary(device, abbreviated=True)``, ``None`` where the backend has none."""
    if not supports_device_memory(device):
        return None
    module = getattr(torch, device.type, None)
    summary = getattr(module, "memory_summary", None)
    if summary is None:
        return None
    return str(summary(device, abbreviated=True))


def live_tensor_dict(tensor: LiveTensorLike) -> LiveTensorDict:
    """One entry of ``holders.top_tensors``."""
    return {
        "name": tensor.name,
        "shape": list(tensor.shape),
        "dtype": tensor.dtype,
        "device": tensor.device,
        "bytes": tensor.bytes,
        "requires_grad": tensor.requires_grad,
        "has_grad_fn": tensor.has_grad_fn,
    }


def fill_holders(
    holders: HoldersSection,
    device: torch.device,
    module: nn.Module,
    optimizers: Sequence[Any],
    allocated_bytes: int | None,
    max_listed: int,
    live_tensors: Callable[..., Sequence[LiveTensorLike]] = fp.live_tensors,
) -> None:
    """Fill the ``holders`` part in place, key by key (a failure keeps what was filled before it).

    Args:
        holders: ``{"device": str(device)}`` to fill.
        device: The failing device.
        module: The model.
        optimizers: Its optimizers.
        allocated_bytes: Allocated bytes of the reading (``None`` on the CPU).
        max_listed: How many of the largest live tensors to list (0: none, and no ``top_tensors`` key).
        live_tensors: ``footprint.live_tensors`` or a fake: ``(device, names=...) -> tensors``, largest first.
    """
    footprint = fp.model_footprint(module, optimizers)
    holders["bytes_by_category"] = footprint.bytes_by_category(str(device))
    holders["rows"] = cast(list[FootprintRowDict], footprint.as_dict().get("rows", []))
    holders["unexplained_bytes"] = fp.unexplained_bytes(allocated_bytes, footprint, str(device))
    if max_listed:
        names = fp.tensor_names(module, optimizers)
        live = live_tensors(device, names=names)[:max_listed]
        holders["top_tensors"] = [live_tensor_dict(t) for t in live]


def checkpointing_state(module: nn.Module, is_checkpointed: Callable[[nn.Module], bool]) -> CheckpointingState:
    """Whether activation checkpointing is on, and where: modules ``is_checkpointed`` says are wrapped (by
    ``GradientCheckpointing``) and modules whose Hugging Face switch is on (``gradient_checkpointing = True``).

    Examples:
        >>> block = nn.Linear(2, 2)
        >>> block.gradient_checkpointing = True
        >>> checkpointing_state(nn.Sequential(block), lambda m: False)["model_switch"]
        ['0']
    """
    wrapped, switched = [], []
    for name, child in module.named_modules():
        if is_checkpointed(child):
            wrapped.append(name)
        elif child.__dict__.get("gradient_checkpointing") is True:
            switched.append(name)
    return {
        "on": bool(wrapped or switched),
        "wrapped": wrapped[:MAX_LISTED],
        "model_switch": switched[:MAX_LISTED],
        "num_wrapped": len(wrapped),
        "num_model_switch": len(switched),
    }


def json_default(obj: Any) -> Any:
    """``json.dumps``'s ``default``: a tensor or numpy scalar as its value, a set or tuple as a list, else ``str``.

    Examples:
        >>> json.dumps({"t": torch.tensor(0.5), "s": {1}, "p": Path("a")}, default=json_default)
        '{"t": 0.5, "s": [1], "p": "a"}'
    """
    if hasattr(obj, "item"):
        try:
            return obj.item()
        except (RuntimeError, TypeError, ValueError, AttributeError):  # a tensor of several values, or not a method
            pass
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)


def hparams_as_json(module: nn.Module) -> dict[str, Any]:
    """The module's saved hyperparameters as JSON values, secrets redacted, ``{}`` if none.

    Redacted field by field first (:func:`~lightning_memopt.utilities.redaction.redact_secrets`: a dataclass or
    ``argparse.Namespace`` becomes a dict of its fields), then made JSON: leaves that are not JSON become their
    ``str``, which the report's last pass scans as text.
    """
    hparams = getattr(module, "hparams", None)
    if not hparams:
        return {}
    redacted = redact_secrets(hparams)  # a Mapping, or a dataclass/Namespace given to save_hyperparameters
    result: dict[str, Any] = json.loads(json.dumps(redacted, default=json_default))
    return result if isinstance(result, dict) else {"hparams": result}


def take_snapshot(
    path: Path, device_type: str, *, requested: bool, recording: bool, dump: Callable[[Path], bool]
) -> SnapshotSection:
    """The ``snapshot`` part, writing the allocator snapshot to ``path`` with ``dump`` when history was recorded.

    Args:
        path: Where the snapshot goes (``oom_snapshot_rank{r}.pickle``).
        device_type: The device's type, for the reason when nothing was recorded.
        requested: Whether ``record_history=True`` was asked for.
        recording: Whether allocator history is being recorded.
        dump: Writes the snapshot; returns whether this torch build could.

    Examples:
        >>> take_snapshot(Path("s.pickle"), "cpu", requested=True, recording=False, dump=lambda p: True)
        {'path': None, 'reason': "allocator history is not available on 'cpu'."}
    """
    if not requested:
        return {"path": None, "reason": "allocator history was not recorded (pass `record_history=True`)."}
    if not recording:
        return {"path": None, "reason": f"allocator history is not available on {device_type!r}."}
    if dump(path):
        return {"path": str(path), "how_to_open": HOW_TO_OPEN.format(name=path.name, stem=path.stem)}
    return {"path": None, "reason": "this torch build cannot write allocator snapshots."}
