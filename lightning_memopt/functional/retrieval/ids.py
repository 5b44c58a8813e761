"""Ids: sample, video and text ids as int64 keys, and the galleries and positive pairs they define."""

from __future__ import annotations

import hashlib
import operator
import reprlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["RetrievalPlan", "as_id_tensor", "first_occurrence", "plan_retrieval"]

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class RetrievalPlan(NamedTuple):
    """Which rows count, the video and text galleries, and the positive pairs, computed from ids alone.

    Attributes:
        kept_rows: bool mask over rows (the first occurrence of each row key is kept).
        video_keys: one key per video, in order of first kept occurrence.
        video_rows: the row each video's feature is taken from (its first kept row).
        text_keys: one key per text, sorted.
        pair_video: video index of each positive pair (unique pairs, sorted by video then text).
        pair_text: text index of each positive pair.
    """

    kept_rows: Tensor
    video_keys: Tensor
    video_rows: Tensor
    text_keys: Tensor
    pair_video: Tensor
    pair_text: Tensor


def _hash_str(value: str) -> int:
    digest = hashlib.blake2b(value.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _int_id(value: Any, position: int, name: str, values: list[Any]) -> int:
    """``value`` as an int64 id, or a ``ValueError`` naming the argument, the value and its position."""
    try:
        if isinstance(value, (bool, str)) or getattr(value, "dtype", None) == torch.bool:
            raise TypeError
        out = operator.index(value)  # ints, numpy ints, integer 0-d tensors; never floats
    except TypeError:
        raise ValueError(
            f"`{name}` must hold only ints or only strings, got {value!r} ({type(value).__name__}) at position"
            f" {position} of {reprlib.repr(values)}. Use one id type per argument."
        ) from None
    if not _INT64_MIN <= out <= _INT64_MAX:
        raise ValueError(
            f"`{name}` must fit in int64 ({_INT64_MIN} to {_INT64_MAX}), got {out!r} at position {position}."
            " Hash large ids into int64 or pass them as strings."
        )
    return out


def as_id_tensor(ids: Any, name: str, length: int | None = None) -> Tensor:
    """Turn ids (int tensor, ints, or strings hashed stably with BLAKE2b) into a 1-D int64 CPU tensor.

    Raises:
        ValueError: naming ``name`` when the ids are not 1-D ints (within int64) or strings, or their length differs
            from ``length``.

    Examples:
        >>> as_id_tensor([3, 1, 3], "text_ids")
        tensor([3, 1, 3])
        >>> bool(as_id_tensor(["a cat"], "text_ids") == as_id_tensor(("a cat",), "text_ids"))
        True
    """
    if isinstance(ids, Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ValueError(
                f"`{name}` must hold integer ids or strings, got a tensor of dtype {ids.dtype}. Pass an integer"
                " tensor (torch.int64, torch.int32, ...), a list of ints or a list of strings; cast whole-number"
                " floats with `.long()`."
            )
        if ids.dim() > 1:
            raise ValueError(f"`{name}` must be 1-D (one id per row), got shape {tuple(ids.shape)}.")
        if ids.dtype == getattr(torch, "uint64", None) and bool((ids.view(torch.int64) < 0).any()):
            raise ValueError(
                f"`{name}` must fit in int64, got a torch.uint64 tensor with values >= 2**63. Hash large ids into"
                " int64 or pass them as strings."
            )
        out = ids.detach().reshape(-1).to(device="cpu", dtype=torch.int64)
    else:
        if isinstance(ids, (str, bytes)) or (not isinstance(ids, Sequence) and not hasattr(ids, "__iter__")):
            raise ValueError(
                f"`{name}` must be a sequence of ids (one per row), got {reprlib.repr(ids)} ({type(ids).__name__})."
                f" Wrap a single id in a list: `{name}=[...]`."
            )
        values = list(ids)
        if all(isinstance(v, str) for v in values):
            out = torch.tensor([_hash_str(v) for v in values], dtype=torch.int64)
        elif all(type(v) is int and _INT64_MIN <= v <= _INT64_MAX for v in values):  # the common case, fast
            out = torch.tensor(values, dtype=torch.int64)
        else:
            out = torch.tensor([_int_id(v, i, name, values) for i, v in enumerate(values)], dtype=torch.int64)
    if length is not None and out.numel() != length:
        raise ValueError(
            f"`{name}` must have one id per row ({length}), got {out.numel()}. Pass the ids of the same batch."
        )
    return out


def first_occurrence(keys: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Sorted unique keys, the position of each unique key's first occurrence, and the inverse map.

    Examples:
        >>> [t.tolist() for t in first_occurrence(torch.tensor([7, 5, 7]))]
        [[5, 7], [1, 0], [1, 0, 1]]
    """
    uniq, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    positions = torch.arange(keys.numel(), dtype=torch.int64)
    first = torch.full((uniq.numel(),), keys.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, positions, reduce="amin")
    return uniq, first, inverse


def plan_retrieval(row_keys: Tensor, video_keys: Tensor, text_keys: Tensor) -> RetrievalPlan:
    """Deduplicate rows by ``row_keys`` and build the galleries and positive pairs from ids only.

    Rows are in global order (rank by rank in a distributed run), so "first occurrence" is the same everywhere.

    Examples:
        >>> plan = plan_retrieval(torch.tensor([0, 1, 2, 0]), torch.tensor([0, 1, 2, 0]), torch.tensor([7, 7, 5, 7]))
        >>> plan.kept_rows.tolist(), plan.text_keys.tolist(), plan.pair_video.tolist(), plan.pair_text.tolist()
        ([True, True, True, False], [5, 7], [0, 1, 2], [1, 1, 0])
    """
    n = row_keys.numel()
    kept = torch.zeros(n, dtype=torch.bool)
    if n:
        _, first_rows, _ = first_occurrence(row_keys)
        kept[first_rows] = True
    kept_idx = kept.nonzero().squeeze(1)
    v_keys_rows = video_keys[kept_idx]
    t_keys_rows = text_keys[kept_idx]
    v_uniq, v_first, v_inv = first_occurrence(v_keys_rows)
    # videos in order of first kept occurrence
    order = torch.argsort(v_first)
    rank_of = torch.empty_like(order)
    rank_of[order] = torch.arange(order.numel())
    video_index_of_row = rank_of[v_inv]
    t_uniq, t_inv = torch.unique(t_keys_rows, sorted=True, return_inverse=True)
    n_text = max(int(t_uniq.numel()), 1)
    pair_code = torch.unique(video_index_of_row * n_text + t_inv, sorted=True)
    return RetrievalPlan(
        kept_rows=kept,
        video_keys=v_uniq[order],
        video_rows=kept_idx[v_first[order]],
        text_keys=t_uniq,
        pair_video=pair_code // n_text,
        pair_text=pair_code % n_text,
    )
