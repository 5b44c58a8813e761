"""What a DataLoader's settings cost in host memory, the settings that waste it, and the loaders of a fit.

A DataLoader with ``num_workers`` workers keeps up to ``num_workers x prefetch_factor`` batches prepared ahead (in
shared memory), and with ``pin_memory`` a page-locked copy of each before it goes to the GPU. Each worker is a
process with its own copy of the dataset object: Python lists and dicts in it are copied page by page as the
workers touch their reference counts, so a dataset of Python objects grows by one copy per worker.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_memopt.utilities.formatting import format_bytes

__all__ = ["LoaderMemory", "batch_bytes", "fit_loaders", "loader_memory", "named_loaders"]

#: A Python list, tuple or dict with at least this many elements in a dataset is worth a finding under workers.
PYTHON_OBJECTS_THRESHOLD = 100_000
#: Batches prepared ahead beyond this fraction of the host's memory get a finding.
HOST_FRACTION = 0.25


def batch_bytes(batch: Any) -> int:
    """Bytes of the tensors (and NumPy arrays) in ``batch``: nested dicts, lists, tuples, namedtuples, dataclasses.

    Examples:
        >>> batch_bytes({"x": torch.zeros(4, 8), "y": [torch.zeros(4, dtype=torch.int64), "label"]})
        160
    """
    kinds: tuple[type, ...] = (torch.Tensor,)
    if "numpy" in sys.modules:  # without NumPy imported there can be no arrays
        kinds += (sys.modules["numpy"].ndarray,)
    sizes: list[int] = []
    apply_to_collection(batch, kinds, lambda x: sizes.append(int(x.nbytes)))
    return sum(sizes)


@dataclass(frozen=True)
class LoaderMemory:
    """Host memory one DataLoader holds or will hold, and what in its settings wastes memory (each with the fix)."""

    name: str
    batch_size: int | None
    num_workers: int
    prefetch_factor: int | None
    pin_memory: bool
    persistent_workers: bool
    #: Bytes of one batch (measured on a batch the loader yielded); ``None`` until one was seen.
    batch_bytes: int | None
    #: Batches prepared ahead: ``num_workers x prefetch_factor`` (0 without workers).
    in_flight: int
    #: Bytes of those batches, plus their page-locked copies with ``pin_memory`` on CUDA.
    host_bytes: int | None
    pinned_bytes: int | None
    findings: list[str] = field(default_factory=list)
    #: What the padding masks of the measured batch say of its samples' lengths (``batch.lengths`` of the OOM report).
    padding: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def summary(self) -> str:
        held = "unknown (no batch seen yet)"
        if self.host_bytes is not None:
            held = format_bytes(self.host_bytes)
        pinned = ""
        if self.pinned_bytes:
            pinned = f", {format_bytes(self.pinned_bytes)} of it pinned"
        batch = "?"
        if self.batch_bytes is not None:
            batch = format_bytes(self.batch_bytes)
        return (
            f"{self.name}: batch_size={self.batch_size}, num_workers={self.num_workers},"
            f" prefetch_factor={self.prefetch_factor}, pin_memory={self.pin_memory},"
            f" persistent_workers={self.persistent_workers}: {self.in_flight} batch(es) of {batch} prepared"
            f" ahead = {held}{pinned}"
        )


def _python_object_attributes(dataset: Any) -> list[tuple[str, int]]:
    """Attributes of ``dataset`` (and of a wrapped ``.dataset``) that are big Python containers."""
    found = []
    seen: set[int] = set()
    target, prefix = dataset, "dataset"
    for _ in range(3):  # Subset / wrappers hold the real dataset in `.dataset`
        if target is None or id(target) in seen:
            break
        seen.add(id(target))
        attributes: Iterable[tuple[str, Any]] = ()
        if hasattr(target, "__dict__"):
            attributes = vars(target).items()
        for name, value in attributes:
            if isinstance(value, (list, tuple, dict)) and len(value) >= PYTHON_OBJECTS_THRESHOLD:
                found.append((f"{prefix}.{name}", len(value)))
        target, prefix = getattr(target, "dataset", None), f"{prefix}.dataset"
    return found


def _cpu_cores(cpu_count: int | None) -> int:
    """``cpu_count`` when given, else this machine's CPU count (at least 1)."""
    if cpu_count is not None:
        return cpu_count
    return os.cpu_count() or 1


def loader_memory(
    loader: Any,
    name: str,
    device_type: str,
    cpu_count: int | None = None,
    host_total_bytes: int | None = None,
    evaluation: bool = False,
    batch_bytes: int | None = None,
    padding: list[dict[str, Any]] | None = None,
) -> LoaderMemory | None:
    """What ``loader`` (a ``torch.utils.data.DataLoader``) holds in host memory and what in its settings wastes it.

    ``device_type`` is where training runs (pinning helps only CUDA copies); ``evaluation`` marks a validation
    loader (persistent workers there stay alive, with their batches, through training); ``batch_bytes`` is the size
    of a batch the loader yielded (see :func:`batch_bytes`); without it the bytes stay unknown; ``padding`` is what
    that batch's padding masks say of its samples' lengths (a batch mostly padding gets a finding). The dataset is
    never read here: a sample read in the main process could leave a file handle open that forked workers then share.
    Returns ``None`` for objects that are not DataLoaders.

    Examples:
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> loader = DataLoader(TensorDataset(torch.zeros(64, 256)), batch_size=8, num_workers=2, prefetch_factor=4)
        >>> info = loader_memory(loader, "train", "cuda", cpu_count=8, host_total_bytes=2**34, batch_bytes=8192)
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
    one_batch = batch_bytes
    in_flight = workers * int(prefetch or 0)
    pin = bool(loader.pin_memory)
    pinned_batches = (in_flight or 1) if pin and device_type == "cuda" else 0
    host = None if one_batch is None else one_batch * in_flight
    pinned = None if one_batch is None else one_batch * pinned_batches
    if host is not None and pinned:
        host += pinned
    cpu_count = _cpu_cores(cpu_count)
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
    findings += _padding_findings(name, padding or [])
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
        pinned_bytes=pinned,
        findings=findings,
        padding=list(padding or []),
    )


#: A measured batch whose positions are at least this share padding gets a finding.
PADDING_SHARE = 0.25


def _padding_findings(name: str, padding: list[dict[str, Any]]) -> list[str]:
    """One finding for the most padded mask of a measured batch, when at least :data:`PADDING_SHARE` is padding.

    Examples:
        >>> found = {"path": "m", "samples": 8, "padded_to": 512, "longest": 40, "median": 12, "padding_share": 0.97}
        >>> _padding_findings("train", [found])[0][:61]
        'train: 97 % of the first batch is padding (`m`: 8 samples pad'
    """
    if not padding:
        return []
    worst = max(padding, key=lambda found: float(found.get("padding_share") or 0))
    share, padded_to, longest = worst.get("padding_share") or 0, worst.get("padded_to"), worst.get("longest")
    if share < PADDING_SHARE:
        return []
    beyond = isinstance(padded_to, int) and isinstance(longest, int) and longest < padded_to
    if beyond:
        fix = "Pad each batch to its longest sample, not to `max_length`, and batch samples of similar length"
    else:
        fix = "Batch samples of similar length"
    return [
        f"{name}: {100 * share:.0f} % of the first batch is padding (`{worst.get('path')}`: {worst.get('samples')}"
        f" samples padded to {padded_to}, the longest {longest}, the median {worst.get('median')}): memory and"
        f" compute go to padding. {fix} (`TokenBudgetBatchSampler`, docs/batching.md)."
    ]


def named_loaders(name: str, loaders: Any) -> list[tuple[str, Any]]:
    """``(name, loader)`` for a loader or a list / dict of them, as the Trainer holds them.

    Examples:
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

    Examples:
        >>> fit_loaders("t", ["v"]), fit_loaders("t", ["v"], limit_val_batches=0)
        ([('train', 't'), ('val', 'v')], [('train', 't')])
    """
    named = named_loaders("train", train)
    if val is not None and limit_val_batches != 0:
        named += named_loaders("val", val)
    return named
