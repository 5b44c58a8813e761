"""Stray copies of a model's weights among the live tensors: a leftover fp32 copy, a state dict, a ``deepcopy``."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from lightning_memopt.functional.footprint.live import LiveTensor
from lightning_memopt.functional.footprint.sharding import shard_rows
from lightning_memopt.functional.footprint.storage import (
    INSPECTION_ERRORS,
    StorageKey,
    gc_tensors,
    plain_tensor,
    storage_key,
)

__all__ = ["Duplicates", "find_duplicates"]


@dataclass(frozen=True)
class Duplicates:
    """Live tensors that are not owned by the model or optimizer but mirror its parameters.

    Args:
        num_tensors: How many such storages are alive.
        bytes: Their storage bytes (shared storages counted once).
        fraction: Their elements over the parameters' elements: ``1.0`` is one full copy of the weights,
            ``2.0`` two copies.
        dtypes: Their dtypes, most bytes first.
        cause: The likely cause, in words.
        largest: The largest few of them.
        num_same_shape_other_values: Unowned tensors that have a parameter's shape but other values (a
            batch or a dataset tensor that happens to have that shape, another model's weights): not counted
            above.
        signatures: ``(storage key, shape, dtype)`` of every copy (not part of comparisons, ``repr`` or
            :meth:`as_dict`); pass them as ``known`` to a later :func:`find_duplicates`.
    """

    num_tensors: int
    bytes: int
    fraction: float
    dtypes: tuple[str, ...]
    cause: str
    largest: tuple[LiveTensor, ...]
    num_same_shape_other_values: int = 0
    signatures: frozenset[tuple[StorageKey, tuple[int, ...], str]] = field(
        default=frozenset(), compare=False, repr=False
    )

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        out = asdict(self)
        out.pop("signatures", None)
        out["largest"] = [t.as_dict() for t in self.largest]
        out["dtypes"] = list(self.dtypes)
        return out


def _unique(module: torch.nn.Module) -> Iterable[torch.Tensor]:
    seen: set[int] = set()
    for param in module.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            yield param


#: A parameter's values to compare a candidate with: ``(rows of the candidate, samples)``; rows ``None``: all of it
#: (a candidate of the local shape), else this rank's rows of a whole (unsharded) copy of a sharded parameter.
_Reference = tuple[slice | None, torch.Tensor]


def _references(module: torch.nn.Module, wanted: set[tuple[int, ...]]) -> dict[tuple[int, ...], list[_Reference]]:
    """The sampled values of the parameters whose local shape, or whole shape (sharded on dim 0), is ``wanted``."""
    references: dict[tuple[int, ...], list[_Reference]] = {}
    for param in _unique(module):
        plain = plain_tensor(param)
        shape = tuple(int(s) for s in plain.shape)
        if shape in wanted:
            references.setdefault(shape, []).append((None, _sampled_values(plain)))
        rows = shard_rows(param)
        if rows is not None and rows[0] in wanted and rows[0] != shape:
            references.setdefault(rows[0], []).append((rows[1], _sampled_values(plain)))
    return references


def _mirrors(tensor: torch.Tensor, references: Sequence[_Reference]) -> bool:
    for rows, ref in references:
        part = tensor if rows is None else tensor[rows]
        if part.numel() and torch.allclose(_sampled_values(part), ref, rtol=1e-2, atol=1e-3):
            return True
    return False


#: How many evenly spaced elements of a tensor are compared with a parameter's to call it a mirror.
_NUM_SAMPLED = 64


def _sampled_values(tensor: torch.Tensor) -> torch.Tensor:
    """Up to :data:`_NUM_SAMPLED` evenly spaced elements as float32 on the CPU (one small transfer)."""
    flat = tensor.detach().reshape(-1)
    step = max(1, flat.numel() // _NUM_SAMPLED)
    return flat[::step][:_NUM_SAMPLED].to("cpu", torch.float32)


def _mirroring_keys(module: torch.nn.Module, candidates: Sequence[LiveTensor]) -> set[StorageKey]:
    """The storage keys among ``candidates`` whose values match a same-shape parameter of ``module``.

    Values are compared on evenly spaced samples, to bf16 rounding (``rtol=1e-2``), so an fp32 copy of
    bf16 weights, a ``deepcopy`` or a state dict mirrors its parameter, while a batch or a dataset tensor that
    merely has a parameter's shape does not. One extra ``gc.get_objects()`` walk, run only when there are
    candidates.
    """
    wanted = {t.key: t.shape for t in candidates if t.key is not None}
    if not wanted:
        return set()
    samples = _references(module, set(wanted.values()))
    found: set[StorageKey] = set()
    tensors = gc_tensors()
    try:
        for obj in tensors:
            try:
                tensor = plain_tensor(obj)
                key = storage_key(tensor)
                shape = tuple(int(s) for s in tensor.shape)
                if key not in wanted or key in found or wanted[key] != shape:
                    continue
                if _mirrors(tensor, samples.get(shape, ())):
                    found.add(key)
            except INSPECTION_ERRORS:
                continue
    finally:
        del tensors
    return found


def _cause(copies: Sequence[LiveTensor], shapes: dict[tuple[int, ...], set[str]], whole_bytes: int) -> str:
    """The likely cause of ``copies``, in words (``whole_bytes``: of them, whole copies of sharded parameters)."""
    nbytes = sum(t.bytes for t in copies)
    other_dtype = sum(t.bytes for t in copies if t.dtype not in shapes[t.shape])
    with_grad = sum(t.bytes for t in copies if t.requires_grad)
    if not copies:
        return "no copies found"
    if whole_bytes * 2 >= nbytes:
        return (
            "a whole (unsharded) copy of the sharded weights on this rank: a full state dict"
            " (`get_model_state_dict(..., options=StateDictOptions(full_state_dict=True))`, `DTensor.full_tensor()`)"
            " kept in a variable; gather it on one rank only, offload it to the CPU (`cpu_offload=True`), or drop it"
            " after saving"
        )
    if other_dtype * 2 >= nbytes:
        return (
            "a copy in another dtype than the model's: the weights from before a dtype conversion (an fp32 model"
            " or state dict kept after `.to(torch.bfloat16)`/`.half()`), or an fp32 master copy; convert once in"
            " place (`to_device_and_dtype`) and drop the other reference"
        )
    if with_grad * 2 >= nbytes:
        return (
            "a second model object: a `copy.deepcopy` of the model, an EMA/teacher model that is not a submodule,"
            " or the model loaded twice"
        )
    return (
        "a state dict or detached copy of the weights on this device: `torch.load(..., map_location=<device>)`"
        " or `model.state_dict()` kept in a variable, or weights cached in a list or dict"
    )


def find_duplicates(
    module: torch.nn.Module,
    live: Sequence[LiveTensor],
    max_listed: int = 5,
    match_values: bool = True,
    known: Iterable[tuple[StorageKey, tuple[int, ...], str]] = (),
) -> Duplicates:
    """Find unowned live tensors that mirror ``module``'s parameters.

    A live tensor counts when it has no owner name (see :func:`tensor_names` and :func:`live_tensors`), its
    shape is the shape of one of the parameters and (with ``match_values``) its values are that parameter's
    up to bf16 rounding, compared on 64 evenly spaced elements: a stray fp32 copy of the weights, a state dict
    loaded onto the device, a ``deepcopy`` of the model. Views and tied weights share a storage with an
    owned tensor, so they carry its name and never count. Same-shape tensors with other values (a batch
    that happens to have a weight's shape, another model) are only counted in
    ``num_same_shape_other_values``.

    Args:
        module: The model whose parameters are mirrored.
        live: Live storages with names attached (``live_tensors(device, names=tensor_names(...))``).
        max_listed: How many of the largest copies to keep in ``largest``.
        match_values: Whether a copy must also hold the parameter's values; ``False`` matches on shape alone.
        known: Copies found before (``Duplicates.signatures`` of an earlier call): a live storage with the same
            key, shape and dtype still counts when training has moved the weights away from its values since.

    Examples:
        >>> from lightning_memopt.functional.footprint import live_tensors, tensor_names
        >>> model = torch.nn.Linear(64, 64)
        >>> stray = {k: v.to(torch.float64) for k, v in model.state_dict().items()}
        >>> dup = find_duplicates(model, live_tensors("cpu", names=tensor_names(model)))
        >>> dup.num_tensors >= 2, dup.fraction >= 1.0, dup.dtypes[0]
        (True, True, 'torch.float64')
    """
    shapes: dict[tuple[int, ...], set[str]] = {}
    local: set[tuple[int, ...]] = set()
    whole_shapes: set[tuple[int, ...]] = set()  # of the sharded parameters: a whole (unsharded) copy has them
    total_numel = 0
    for param in _unique(module):
        plain = plain_tensor(param)
        local.add(tuple(int(s) for s in plain.shape))
        shapes.setdefault(tuple(int(s) for s in plain.shape), set()).add(str(plain.dtype))
        total_numel += int(plain.numel())
        rows = shard_rows(param)
        if rows is not None:
            whole_shapes.add(rows[0])
            shapes.setdefault(rows[0], set()).add(str(plain.dtype))
    candidates = [t for t in live if t.name is None and t.shape in shapes and t.bytes > 0]
    known = set(known)
    if match_values and candidates:
        seen_before = {t.key for t in candidates if (t.key, t.shape, t.dtype) in known}
        unknown = [t for t in candidates if t.key not in seen_before]
        mirrored = _mirroring_keys(module, unknown) | seen_before
        copies = [t for t in candidates if t.key in mirrored]
    else:
        copies = candidates
    numel = sum(math.prod(t.shape) for t in copies)
    nbytes = sum(t.bytes for t in copies)
    by_dtype: dict[str, int] = {}
    for t in copies:
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.bytes
    whole = sum(t.bytes for t in copies if t.shape in whole_shapes - local)
    cause = _cause(copies, shapes, whole)
    return Duplicates(
        num_tensors=len(copies),
        bytes=nbytes,
        fraction=numel / total_numel if total_numel else 0.0,
        dtypes=tuple(sorted(by_dtype, key=lambda d: -by_dtype[d])),
        cause=cause,
        largest=tuple(copies[:max_listed]),
        num_same_shape_other_values=len(candidates) - len(copies),
        signatures=frozenset((t.key, t.shape, t.dtype) for t in copies if t.key is not None),
    )
