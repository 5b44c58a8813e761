"""What a DataLoader's settings cost in host memory, and the settings that waste it.

A DataLoader with ``num_workers`` workers keeps up to ``num_workers x prefetch_factor`` batches prepared ahead (in
shared memory), and with ``pin_memory`` a page-locked copy of each before it goes to the GPU. Each worker is a
process with its own copy of the dataset object: Python lists and dicts in it are copied page by page as the
workers touch their reference counts, so a dataset of Python objects grows by one copy per worker.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from lightning_memopt.utilities.formatting import format_bytes

__all__ = ["LoaderMemory", "batch_bytes", "loader_memory"]

#: A Python list, tuple or dict with at least this many elements in a dataset is worth a finding under workers.
PYTHON_OBJECTS_THRESHOLD = 100_000
#: Batches prepared ahead beyond this fraction of the host's memory get a finding.
HOST_FRACTION = 0.25


def batch_bytes(obj: Any, _depth: int = 0) -> int:
    """Bytes of the tensors and arrays in ``obj`` (nested dicts, lists, tuples, dataclasses).

    Example:
        >>> batch_bytes({"x": torch.zeros(4, 8), "y": [torch.zeros(4, dtype=torch.int64), "label"]})
        160
    """
    if _depth > 8:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    nbytes = getattr(obj, "nbytes", None)  # numpy arrays
    if isinstance(nbytes, int) and hasattr(obj, "dtype"):
        return nbytes
    if isinstance(obj, Mapping):
        return sum(batch_bytes(v, _depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(batch_bytes(v, _depth + 1) for v in obj)
    if hasattr(obj, "__dataclass_fields__"):
        return sum(batch_bytes(getattr(obj, f, None), _depth + 1) for f in obj.__dataclass_fields__)
    return 0


@dataclass(frozen=True)
class LoaderMemory:
    """Host memory one DataLoader holds or will hold, and what in its settings wastes memory (each with the fix)."""

    name: str
    batch_size: int | None
    num_workers: int
    prefetch_factor: int | None
    pin_memory: bool
    persistent_workers: bool
    #: Estimated bytes of one batch (``batch_size`` x the bytes of the first sample); ``None`` if unknown.
    batch_bytes: int | None
    #: Batches prepared ahead: ``num_workers x prefetch_factor`` (0 without workers).
    in_flight: int
    #: Bytes of those batches, plus their page-locked copies with ``pin_memory`` on CUDA.
    host_bytes: int | None
    pinned_bytes: int | None
    findings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def summary(self) -> str:
        held = "unknown (first sample not readable)" if self.host_bytes is None else format_bytes(self.host_bytes)
        pinned = f", {format_bytes(self.pinned_bytes)} of it pinned" if self.pinned_bytes else ""
        batch = "?" if self.batch_bytes is None else format_bytes(self.batch_bytes)
        return (f"{self.name}: batch_size={self.batch_size}, num_workers={self.num_workers},"
                f" prefetch_factor={self.prefetch_factor}, pin_memory={self.pin_memory},"
                f" persistent_workers={self.persistent_workers}: {self.in_flight} batch(es) of {batch} prepared"
                f" ahead = {held}{pinned}")


def _first_sample_bytes(dataset: Any) -> int | None:
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        return None  # an iterable dataset: its samples are not reachable without starting it
    try:
        if len(dataset) == 0:
            return None
        return batch_bytes(dataset[0])
    except Exception:
        return None


def _python_object_attributes(dataset: Any) -> list[tuple[str, int]]:
    """Attributes of ``dataset`` (and of a wrapped ``.dataset``) that are big Python containers."""
    found = []
    seen: set[int] = set()
    target, prefix = dataset, "dataset"
    for _ in range(3):  # Subset / wrappers hold the real dataset in `.dataset`
        if target is None or id(target) in seen:
            break
        seen.add(id(target))
        for name, value in vars(target).items() if hasattr(target, "__dict__") else ():
            if isinstance(value, (list, tuple, dict)) and len(value) >= PYTHON_OBJECTS_THRESHOLD:
                found.append((f"{prefix}.{name}", len(value)))
        target, prefix = getattr(target, "dataset", None), f"{prefix}.dataset"
    return found


def loader_memory(
    loader: Any,
    name: str,
    device_type: str,
    cpu_count: int | None = None,
    host_total_bytes: int | None = None,
    evaluation: bool = False,
) -> LoaderMemory | None:
    """What ``loader`` (a ``torch.utils.data.DataLoader``) holds in host memory and what in its settings wastes it.

    ``device_type`` is where training runs (pinning helps only CUDA copies); ``evaluation`` marks a validation
    loader (persistent workers there stay alive, with their batches, through training). Returns ``None`` for
    objects that are not DataLoaders.

    Example:
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> loader = DataLoader(TensorDataset(torch.zeros(64, 256)), batch_size=8, num_workers=2, prefetch_factor=4)
        >>> info = loader_memory(loader, "train", "cuda", cpu_count=8, host_total_bytes=2**34)
        >>> info.in_flight, info.batch_bytes, info.host_bytes, info.findings
        (8, 8192, 65536, [])
    """
    if not isinstance(loader, torch.utils.data.DataLoader):
        return None
    workers = int(loader.num_workers or 0)
    prefetch = loader.prefetch_factor if workers > 0 else None
    batch_size = loader.batch_size
    if batch_size is None:
        batch_size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    sample = _first_sample_bytes(loader.dataset)
    one_batch = None if sample is None or batch_size is None else sample * int(batch_size)
    in_flight = workers * int(prefetch or 0)
    pin = bool(loader.pin_memory)
    pinned_batches = (in_flight or 1) if pin and device_type == "cuda" else 0
    host = None if one_batch is None else one_batch * in_flight
    pinned = None if one_batch is None else one_batch * pinned_batches
    if host is not None and pinned:
        host += pinned
    cpu_count = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    findings = []
    if workers > cpu_count:
        findings.append(
            f"{name}: num_workers={workers} exceeds the {cpu_count} CPU cores: each worker is a process with its own"
            f" copy of the dataset and {prefetch} batch(es) prepared ahead. Use num_workers <= {cpu_count}."
        )
    if host is not None and host_total_bytes and host > HOST_FRACTION * host_total_bytes:
        findings.append(
            f"{name}: {in_flight} batches prepared ahead (num_workers={workers} x prefetch_factor={prefetch}) of"
            f" {format_bytes(one_batch)} hold {format_bytes(host)}, over {HOST_FRACTION:.0%} of the host's"
            f" {format_bytes(host_total_bytes)}. Lower prefetch_factor (2 is the default) or num_workers."
        )
    if pin and device_type != "cuda" and torch.cuda.is_available():
        findings.append(
            f"{name}: pin_memory=True while training on {device_type}: page-locked copies help only copies to a CUDA"
            " GPU. Set pin_memory=False."
        )
    if evaluation and workers > 0 and bool(getattr(loader, "persistent_workers", False)):
        findings.append(
            f"{name}: persistent_workers=True keeps {workers} validation worker(s), their dataset copies and their"
            " prepared batches alive through training. Set persistent_workers=False on the validation loader"
            " unless validation runs every few steps."
        )
    if workers > 0:
        for attribute, length in _python_object_attributes(loader.dataset):
            findings.append(
                f"{name}: `{attribute}` is a Python container of {length:,} objects: each of the {workers} workers"
                " copies the pages it touches (reference counts), so host memory grows by up to one copy per"
                " worker. Store it as a NumPy array or a tensor (or load samples lazily)."
            )
    return LoaderMemory(
        name=name,
        batch_size=None if batch_size is None else int(batch_size),
        num_workers=workers,
        prefetch_factor=None if prefetch is None else int(prefetch),
        pin_memory=pin,
        persistent_workers=bool(getattr(loader, "persistent_workers", False)),
        batch_bytes=one_batch,
        in_flight=in_flight,
        host_bytes=host,
        pinned_bytes=pinned if pinned else (0 if one_batch is not None else None),
        findings=findings,
    )
