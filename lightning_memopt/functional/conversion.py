"""Convert a model once, in place: the "convert once" rule for device moves and dtype casts."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from lightning_memopt.functional.footprint import StorageKey, model_footprint, storage_bytes, storage_key
from lightning_memopt.functional.readings.memory import read_memory, resolve_device, supports_device_memory
from lightning_memopt.utilities import _torch_private
from lightning_memopt.utilities.checks import check_device
from lightning_memopt.utilities.formatting import format_bytes

__all__ = ["ConversionResult", "to_device_and_dtype"]


@dataclass(frozen=True)
class ConversionResult:
    """What :func:`to_device_and_dtype` did.

    Args:
        converted: Whether anything was converted (``False``: every tensor already matched, nothing ran).
        num_converted: Parameters and buffers that changed device or dtype.
        num_skipped: Parameters and buffers already on the target device and dtype (or not floating point,
            which a dtype cast leaves alone).
        bytes_before: Bytes of the parameters and buffers before, by device (``{"cpu": ..., "cuda:0": ...}``).
        bytes_after: The same after the conversion.
        allocated_before: Allocated bytes of the target device (without ``device``: the device of the first
            converted tensor) before; ``None`` without allocator readings (CPU).
        allocated_after: The same after: if it did not go down after a cast to a smaller dtype, another
            reference still holds the old weights.
        num_kept_alive: Old storages that were not freed because something else still references them (a
            ``state_dict()``, the weights kept in a variable, a copy); ``bytes_kept_alive`` is their size.
            ``bytes_after`` counts only the model's tensors: the process holds ``bytes_kept_alive`` more.
    """

    converted: bool
    num_converted: int
    num_skipped: int
    bytes_before: dict[str, int]
    bytes_after: dict[str, int]
    allocated_before: int | None = None
    allocated_after: int | None = None
    num_kept_alive: int = 0
    bytes_kept_alive: int = 0

    @property
    def total_bytes_before(self) -> int:
        return sum(self.bytes_before.values())

    @property
    def total_bytes_after(self) -> int:
        return sum(self.bytes_after.values())

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        if not self.converted:
            return f"nothing converted: all {self.num_skipped} tensors were already on the target device and dtype"

        def sizes(by_device: dict[str, int]) -> str:
            return ", ".join(f"{format_bytes(n)} on {device}" for device, n in sorted(by_device.items())) or "0 B"

        text = (
            f"converted {self.num_converted} tensors ({self.num_skipped} already matched): parameters and buffers"
            f" {sizes(self.bytes_before)} -> {sizes(self.bytes_after)}"
        )
        if self.num_kept_alive:
            text += (
                f"; {format_bytes(self.bytes_kept_alive)} of the old tensors ({self.num_kept_alive}) is still"
                " held by other references and not freed"
            )
        return text


def _bytes_by_device(module: torch.nn.Module) -> dict[str, int]:
    fp = model_footprint(module)
    out: dict[str, int] = {}
    for row in fp.rows:
        if row.category in ("parameters", "buffers"):
            out[row.device] = out.get(row.device, 0) + row.bytes
    return out


def _needs(tensor: torch.Tensor, device: torch.device | None, dtype: torch.dtype | None) -> bool:
    if device is not None and tensor.device != device:
        return True
    return bool(dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype)


def _allocated(device: torch.device | None) -> int | None:
    if device is None or not supports_device_memory(device):
        return None
    try:
        return read_memory(device).allocated_bytes
    except RuntimeError:  # a driver error: the figure stays unknown, the conversion is what matters
        return None


def _weak_storages(tensors: list[torch.Tensor]) -> dict[StorageKey, tuple[Any, int]]:
    """Weak references to the distinct storages of ``tensors`` with their sizes (none where torch has none).

    A function of its own so that no local variable outlives it and keeps a storage alive.
    """
    out: dict[StorageKey, tuple[Any, int]] = {}
    for tensor in tensors:
        key, ref = storage_key(tensor), _torch_private.storage_weak_ref(tensor)
        if key is not None and ref is not None:
            out[key] = (ref, storage_bytes(tensor))
    return out


def to_device_and_dtype(
    model: torch.nn.Module,
    device: torch.device | str | int | None = None,
    dtype: torch.dtype | None = None,
) -> ConversionResult:
    """Move and cast ``model`` in place, skipping the call when nothing would change, and report the bytes.

    ``nn.Module.to`` replaces each parameter's data in place, so the old storage is freed unless something
    else still references it (a state dict, the original weights kept in a variable, a ``deepcopy``). Calling
    ``.to`` several times (a dtype cast, then a device move, then a second move of an already placed
    model) is harmless only if nothing holds the intermediate copies: convert once, here, with both targets.
    A dtype applies to floating-point tensors only (integer buffers such as ``num_batches_tracked`` keep
    theirs), as with ``nn.Module.to``.

    Args:
        model: The module (a ``LightningModule`` too).
        device: Target device; ``None`` keeps each tensor where it is.
        dtype: Target floating-point dtype; ``None`` keeps dtypes.

    Returns:
        A :class:`ConversionResult`; ``converted`` is ``False`` when the call was a no-op.

    Raises:
        ValueError: if ``model`` is not a module, ``device`` names no device (see ``read_memory``) or ``dtype`` is not
            a floating-point ``torch.dtype``.

    Examples:
        >>> model = torch.nn.Linear(4, 4)
        >>> first = to_device_and_dtype(model, dtype=torch.bfloat16)
        >>> first.converted, first.total_bytes_before, first.total_bytes_after, model.weight.dtype
        (True, 80, 40, torch.bfloat16)
        >>> to_device_and_dtype(model, device="cpu", dtype=torch.bfloat16).converted  # already there: skipped
        False
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(
            f"`model` must be a torch.nn.Module (a LightningModule too), got {model!r} ({type(model).__name__})."
        )
    check_device("device", device)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ValueError(
            f"`dtype` must be a floating-point torch.dtype such as torch.bfloat16 or torch.float16, got {dtype!r}."
            " Integer tensors are never cast by a model conversion."
        )
    target = None
    if device is not None:
        target = resolve_device(device)
    tensors = [*model.parameters(), *model.buffers()]
    pending = [t for t in tensors if _needs(t, target, dtype)]
    before = _bytes_by_device(model)
    if not pending:
        return ConversionResult(False, 0, len(tensors), before, before)
    reading_device = target if target is not None else pending[0].device
    alloc_before = _allocated(reading_device)
    kwargs: dict[str, Any] = {}
    if target is not None:
        kwargs["device"] = target
    if dtype is not None:
        kwargs["dtype"] = dtype
    num_converted, num_skipped = len(pending), len(tensors) - len(pending)
    # Weak references to the old storages: after the conversion, a live one is held by someone else.
    old = _weak_storages(pending)
    del tensors, pending  # our own references to old buffers must not keep them alive
    model.to(**kwargs)
    kept = [nbytes for ref, nbytes in old.values() if not ref.expired()]
    result = ConversionResult(
        converted=True,
        num_converted=num_converted,
        num_skipped=num_skipped,
        bytes_before=before,
        bytes_after=_bytes_by_device(model),
        allocated_before=alloc_before,
        allocated_after=_allocated(reading_device),
        num_kept_alive=len(kept),
        bytes_kept_alive=sum(kept),
    )
    if kept:
        warnings.warn(
            f"to_device_and_dtype: {format_bytes(sum(kept))} of the model's old tensors ({len(kept)} storages) were"
            " not freed: something else still references them (a `state_dict()`, the weights kept in a"
            " variable, a copy of the model). The conversion saved less than it shows; drop those references.",
            stacklevel=2,
        )
    return result
