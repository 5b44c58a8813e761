"""R@K, median rank and mean rank from per-query ``rank0`` values or from their histogram."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_memopt.functional.retrieval.options import MEDIANS, Median
from lightning_memopt.utilities.checks import check_choice, check_positive_int

__all__ = ["summarize_rank_histogram", "summarize_ranks", "top_k_tuple"]


def top_k_tuple(top_k: Any) -> tuple[int, ...]:
    """``top_k`` as a tuple of distinct positive ints (one int is accepted too); ``ValueError`` naming it otherwise.

    Examples:
        >>> top_k_tuple(5), top_k_tuple([1, 10])
        ((5,), (1, 10))
    """
    ks = (top_k,) if isinstance(top_k, int) and not isinstance(top_k, bool) else top_k
    if not isinstance(ks, (list, tuple)) or not ks:
        raise ValueError(
            f"`top_k` must be a positive int or a non-empty list of distinct positive ints, got {top_k!r}. Try"
            " `top_k=(1, 5, 10)`."
        )
    for k in ks:
        check_positive_int("top_k", k, hint=f"Each K of R@K must be an int >= 1; `top_k` was {top_k!r}.")
    if len(set(ks)) != len(ks):
        raise ValueError(f"`top_k` must not repeat a K (each gives one R@K key), got {top_k!r}.")
    return tuple(ks)


def _value_at(cumulative: Tensor, position: int) -> int:
    """The value at sorted ``position`` of a sample whose histogram has the given cumulative sum."""
    return int(torch.searchsorted(cumulative, torch.tensor([position], dtype=cumulative.dtype), right=True).item())


def summarize_rank_histogram(
    histogram: Tensor,
    top_k: Sequence[int] = (1, 5, 10),
    median: Median = "floor",
    prefix: str = "",
) -> dict[str, Tensor]:
    """R@K, MedR and MeanR from a histogram of ``rank0`` values (``histogram[r]`` = number of queries with rank r).

    Examples:
        >>> hist = torch.bincount(torch.tensor([0, 0, 3, 9]), minlength=10)
        >>> {k: round(v.item(), 3) for k, v in summarize_rank_histogram(hist, (1, 5), prefix="v2t/").items()}
        {'v2t/R@1': 0.5, 'v2t/R@5': 0.75, 'v2t/MedR': 2.0, 'v2t/MeanR': 4.0}
    """
    check_choice("median", median, MEDIANS)
    top_k = top_k_tuple(top_k)
    hist = histogram.detach().to(device="cpu", dtype=torch.int64)
    n = int(hist.sum().item())
    if n == 0:
        raise ValueError("Cannot summarize ranks of zero queries: call `update` with at least one row first.")
    cumulative = hist.cumsum(0)
    out: dict[str, Tensor] = {}
    for k in top_k:
        hits = 0
        if k > 0:
            hits = int(cumulative[min(k, hist.numel()) - 1].item())
        out[f"{prefix}R@{k}"] = torch.tensor(hits / n, dtype=torch.float32)
    lower = _value_at(cumulative, (n - 1) // 2)
    upper = _value_at(cumulative, n // 2)
    if median == "floor":
        med = float((lower + upper) // 2 + 1)
    elif median == "mean":
        med = (lower + upper) / 2 + 1
    else:
        med = float(lower + 1)
    total = (hist.double() * torch.arange(hist.numel(), dtype=torch.float64)).sum().item()
    out[f"{prefix}MedR"] = torch.tensor(med, dtype=torch.float32)
    out[f"{prefix}MeanR"] = torch.tensor(total / n + 1, dtype=torch.float32)
    return out


def summarize_ranks(
    ranks: Tensor, top_k: Sequence[int] = (1, 5, 10), median: Median = "floor", prefix: str = ""
) -> dict[str, Tensor]:
    """R@K, MedR and MeanR from per-query ``rank0`` values (see :func:`summarize_rank_histogram`).

    Examples:
        >>> summarize_ranks(torch.tensor([0, 1, 2, 3]), top_k=(1,), median="mean")
        {'R@1': tensor(0.2500), 'MedR': tensor(2.5000), 'MeanR': tensor(2.5000)}
    """
    ranks = ranks.detach().to(device="cpu", dtype=torch.int64)
    size = 1
    if ranks.numel():
        size = int(ranks.max().item()) + 1
    return summarize_rank_histogram(torch.bincount(ranks, minlength=size), top_k, median, prefix)
