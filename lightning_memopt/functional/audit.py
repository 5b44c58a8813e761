"""The Trainer-free core of ``MemoryAudit``: the model audit, where stray copies are held, the DataLoader watch and
the texts of the findings.

Nothing here knows about a Trainer or a hook; :class:`~lightning_memopt.callbacks.MemoryAudit` calls these, writes
the records and warns.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_memopt.functional.footprint import (
    Duplicates,
    Footprint,
    LiveTensor,
    StorageKey,
    find_duplicates,
    find_storage_holders,
    unexplained_bytes,
)
from lightning_memopt.functional.footprint.storage import INSPECTION_ERRORS
from lightning_memopt.functional.leaks import tensors_with_grad_fn
from lightning_memopt.functional.loaders import LoaderMemory, batch_bytes, loader_memory
from lightning_memopt.utilities.formatting import format_bytes

__all__ = [
    "LoaderWatch",
    "ModelAudit",
    "audit_model",
    "duplicates_message",
    "fit_loaders",
    "metric_states_message",
    "named_loaders",
    "validation_findings",
    "where_held",
]

Signature = tuple[StorageKey, tuple[int, ...], str]


@dataclass(frozen=True)
class ModelAudit:
    """One audit of a model: its footprint, what the allocator holds beyond it, unowned tensors and stray copies."""

    footprint: Footprint
    device: str
    unexplained: int | None
    unowned: list[LiveTensor]
    duplicates: Duplicates

    def fields(self, when: str, max_listed: int) -> dict[str, Any]:
        """The keys of an ``audit`` record after the reading (``docs/memory-log.md``)."""
        return {
            "audit": when,
            "footprint": self.footprint.as_dict(),
            "footprint_device_bytes": self.footprint.total_bytes(self.device),
            "unexplained_bytes": self.unexplained,
            "unowned_tensor_bytes": sum(t.bytes for t in self.unowned),
            "num_unowned_tensors": len(self.unowned),
            "largest_unowned": [t.as_dict(with_name=False) for t in self.unowned[:max_listed]],
            "duplicates": self.duplicates.as_dict() if self.duplicates.num_tensors else None,
        }

    def metrics(self, with_duplicates: bool) -> dict[str, float]:
        """The logged ``memory/audit/*`` metrics; ``duplicate_bytes`` counts only when the copies are warned about."""
        metrics = {f"memory/audit/{k}_bytes": float(v) for k, v in self.footprint.bytes_by_category().items()}
        if self.unexplained is not None:
            metrics["memory/audit/unexplained_bytes"] = float(self.unexplained)
        metrics["memory/audit/duplicate_bytes"] = float(self.duplicates.bytes if with_duplicates else 0)
        return metrics

    def text(self, when: str) -> str:
        """The printed summary: the footprint table, unexplained bytes and unowned live tensors."""
        lines = [f"MemoryAudit ({when.replace('_', ' ')}): model and optimizer footprint", self.footprint.table()]
        if self.unexplained is not None:
            lines.append(
                f"unexplained allocated bytes on {self.device}: {format_bytes(self.unexplained)}"
                f" ({self.unexplained} bytes)"
            )
        lines.append(
            f"live tensors on {self.device} not owned by the model or optimizer: {len(self.unowned)},"
            f" {format_bytes(sum(t.bytes for t in self.unowned))}"
        )
        return "\n".join(lines)


def audit_model(
    module: torch.nn.Module,
    footprint: Footprint,
    live: Sequence[LiveTensor],
    allocated_bytes: int | None,
    device: str,
    max_listed: int = 5,
    known: Iterable[Signature] = (),
) -> ModelAudit:
    """Audit ``module`` from its ``footprint`` and the ``live`` tensors (named with ``tensor_names``).

    ``known`` are the copies an earlier audit found (``Duplicates.signatures``): they still count after training
    moved the weights away from their values.

    Example:
        >>> from lightning_memopt.functional.footprint import live_tensors, model_footprint, tensor_names
        >>> model = torch.nn.Linear(4, 2)
        >>> result = audit_model(model, model_footprint(model), live_tensors("cpu", tensor_names(model)), None, "cpu")
        >>> result.fields("fit_start", 5)["footprint_device_bytes"], result.unexplained
        (40, None)
    """
    unowned = [t for t in live if t.name is None]
    duplicates = find_duplicates(module, live, max_listed=max_listed, known=known)
    return ModelAudit(footprint, device, unexplained_bytes(allocated_bytes, footprint, device), unowned, duplicates)


def where_held(module: torch.nn.Module, dup: Duplicates) -> str:
    """Where the largest copies are held, as attribute paths from the LightningModule, in one sentence.

    Example:
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = torch.nn.Linear(2, 2)
        ...         self._hparams = {"backbone": torch.nn.Linear(2, 2)}
        >>> from lightning_memopt.functional.footprint import live_tensors, tensor_names
        >>> net = Net()
        >>> where_held(net, find_duplicates(net, live_tensors("cpu", tensor_names(net)), match_values=False))[:42]
        "Held at self._hparams['backbone']. That is"
    """
    try:
        found = find_storage_holders(module, [t.key for t in dup.largest if t.key is not None])
    except INSPECTION_ERRORS:
        found = {}
    paths = sorted(set(found.values()))
    if not paths:
        return "Where: not in an attribute of the LightningModule (a variable, a closure or another object holds them)."
    text = "Held at " + ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "") + "."
    names = sorted({m.group(1) for p in paths if (m := re.search(r"_hparams(?:_initial)?\[['\"](\w+)['\"]\]", p))})
    if names:
        ignore = ", ".join(f'"{n}"' for n in names)
        text += (
            " That is a copy kept by `save_hyperparameters()`: call"
            f" `self.save_hyperparameters(ignore=[{ignore}])` (the weights are in the checkpoint's `state_dict`"
            " already), or save only its configuration."
        )
    elif any("hparams" in p for p in paths):
        text += (
            " That is a copy kept by `save_hyperparameters()`: pass `ignore=[...]` with the module's argument"
            " name, or save only its configuration."
        )
    return text


def duplicates_message(rank: int, when: str, device: str, dup: Duplicates, held: str) -> str:
    """The duplicate-copies warning: how many, their bytes and dtypes, where they are held, the likely cause."""
    largest = ", ".join(
        f"{tuple(t.shape)} {t.dtype.replace('torch.', '')} {format_bytes(t.bytes)}" for t in dup.largest
    )
    return (
        f"MemoryAudit [rank {rank}] ({when.replace('_', ' ')}): {dup.num_tensors} tensors on {device}"
        f" ({format_bytes(dup.bytes)} = {dup.bytes} bytes, dtypes {', '.join(dup.dtypes)}) are not owned by the"
        f" model or optimizer but have the shapes of its parameters: {dup.fraction:.2f}x the parameters'"
        f" elements. {held} Likely cause: {dup.cause}. Largest: {largest}."
    )


def validation_findings(rank: int, outputs: Any, batch_idx: int, grad_enabled: bool) -> list[tuple[str, str]]:
    """``(key, warning)`` for a ``validation_step`` that returned tensors with autograd history or left grad on.

    Example:
        >>> [key for key, _ in validation_findings(0, {"out": torch.ones(1, requires_grad=True) * 2}, 0, True)]
        ['validation-graph', 'validation-grad-enabled']
    """
    found = []
    count, nbytes = tensors_with_grad_fn(outputs)
    if count:
        found.append(
            (
                "validation-graph",
                f"MemoryAudit [rank {rank}]: validation_step (batch {batch_idx}) returned {count} tensors with"
                f" autograd history ({format_bytes(nbytes)} plus their graphs): validation code ran with grad"
                " enabled (`torch.enable_grad()`/`set_grad_enabled(True)`) and built graphs. Detach what you"
                " return, or compute under `torch.no_grad()`.",
            )
        )
    if grad_enabled:
        found.append(
            (
                "validation-grad-enabled",
                f"MemoryAudit [rank {rank}]: grad is enabled after validation_step (batch {batch_idx}):"
                " something called `torch.set_grad_enabled(True)` in validation code, so every validation"
                " forward builds an autograd graph. Use `with torch.enable_grad():` around the part that needs it.",
            )
        )
    return found


def metric_states_message(rank: int, found: Sequence[str]) -> str:
    """The warning for metric states that hold tensors requiring grad (from ``metric_states_requiring_grad``)."""
    return (
        f"MemoryAudit [rank {rank}]: metric states hold tensors that require grad: {', '.join(found)}."
        " Each `update` keeps its autograd graph alive until `reset`: pass detached tensors"
        " (`metric.update(preds.detach(), target)`)."
    )


def named_loaders(name: str, loaders: Any) -> list[tuple[str, Any]]:
    """``(name, loader)`` for a loader or a list / dict of them, as the Trainer holds them.

    Example:
        >>> named_loaders("val", ["a", "b"]), named_loaders("train", "a"), named_loaders("val", None)
        ([('val[0]', 'a'), ('val[1]', 'b')], [('train', 'a')], [])
    """
    if isinstance(loaders, (list, tuple)):
        return [(f"{name}[{i}]" if len(loaders) > 1 else name, dl) for i, dl in enumerate(loaders)]
    if isinstance(loaders, dict):
        return [(f"{name}[{key}]", dl) for key, dl in loaders.items()]
    return [] if loaders is None else [(name, loaders)]


def fit_loaders(train: Any, val: Any, limit_val_batches: Any = 1) -> list[tuple[str, Any]]:
    """``(name, loader)`` of a fit's loaders: ``train`` and, unless validation is off, ``val``.

    Example:
        >>> fit_loaders("t", ["v"]), fit_loaders("t", ["v"], limit_val_batches=0)
        ([('train', 't'), ('val', 'v')], [('train', 't')])
    """
    named = named_loaders("train", train)
    if val is not None and limit_val_batches != 0:
        named += named_loaders("val", val)
    return named


class LoaderWatch:
    """The DataLoaders of a fit: their settings at train start, their bytes at each one's first batch.

    Args:
        device_type: Where training runs (``"cuda"``, ``"cpu"``...).
        host_total_bytes: The host's memory, for the finding about batches prepared ahead.

    Example:
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> watch = LoaderWatch("cpu", host_total_bytes=2**34)
        >>> [info.host_bytes for info in watch.start([("train", DataLoader(TensorDataset(torch.zeros(8, 4))))])]
        [None]
        >>> watch.measure("train", [torch.zeros(1, 4)]).batch_bytes, [i.name for i in watch.loaders]
        (16, ['train'])
    """

    def __init__(self, device_type: str, host_total_bytes: int) -> None:
        self.device_type = device_type
        self.host_total_bytes = host_total_bytes
        self.loaders: list[LoaderMemory] = []
        self.unmeasured: dict[str, Any] = {}

    def start(self, named: Sequence[tuple[str, Any]]) -> list[LoaderMemory]:
        """The settings of every loader now (before its workers start): one :class:`LoaderMemory` per DataLoader."""
        self.unmeasured = dict(named)
        return [info for name, loader in named if (info := self._audit(name, loader, None)) is not None]

    def measure(self, name: str, batch: Any) -> LoaderMemory | None:
        """The loader ``name`` again with the bytes of its first ``batch`` (``None`` once measured)."""
        loader = self.unmeasured.pop(name, None)
        return None if loader is None else self._audit(name, loader, batch_bytes(batch))

    def _audit(self, name: str, loader: Any, nbytes: int | None) -> LoaderMemory | None:
        info = loader_memory(
            loader,
            name,
            self.device_type,
            host_total_bytes=self.host_total_bytes,
            evaluation=name.startswith("val"),
            batch_bytes=nbytes,
        )
        if info is not None:
            self.loaders = [*(i for i in self.loaders if i.name != name), info]
        return info
