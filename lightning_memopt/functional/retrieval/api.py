"""The functional entry points: :func:`retrieval_ranks` (per-query ranks) and :func:`streaming_retrieval` (R@K...)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_memopt.functional.retrieval.ids import as_id_tensor, first_occurrence
from lightning_memopt.functional.retrieval.options import (
    DEFAULT_MEMORY_BUDGET_BYTES,
    MEDIANS,
    PROTOCOLS,
    TIES,
    V2T_GALLERIES,
    Median,
    Protocol,
    Ties,
    V2TGallery,
    blocks_device,
    check_features,
    repeated_text_message,
)
from lightning_memopt.functional.retrieval.ranking import LOCAL, RetrievalRanks, rank_rows
from lightning_memopt.functional.retrieval.summaries import summarize_ranks, top_k_tuple
from lightning_memopt.utilities.checks import check_choice, check_device, check_positive_int

__all__ = ["retrieval_ranks", "streaming_retrieval"]


def retrieval_ranks(
    video_features: Tensor,
    text_features: Tensor,
    text_ids: Any = None,
    *,
    video_ids: Any = None,
    sample_ids: Any = None,
    protocol: Protocol = "dedup",
    v2t_gallery: V2TGallery = "texts",
    ties: Ties = "optimistic",
    video_block_size: int | None = None,
    text_block_size: int | None = None,
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
    device: torch.device | str | None = None,
) -> RetrievalRanks:
    """Per-query ``rank0`` in both directions from one row per sample (the functional form of the metric).

    Features of any float dtype are rounded to float32 before scoring (float64 too, with one warning).

    Args:
        video_features: ``(N, D)`` one row per sample.
        text_features: ``(N, D)`` the caption of each sample.
        text_ids: caption id of each row (ints or strings); rows with the same id share one gallery text (the first
            row's features; later rows of the id with other features warn). Needed by ``protocol="dedup"``; ignored
            by ``"paired"``.
        video_ids: video id of each row; rows with the same id are one video whose positives are all its captions.
            ``None``: each (deduplicated) row is its own video.
        sample_ids: sample id of each row; repeated samples (padding of a distributed sampler) count once.
        protocol: ``"dedup"`` or ``"paired"`` (row i <-> row i, no deduplication).
        v2t_gallery: ``"texts"`` (best of captions) or ``"groups"`` (one gallery item per video, group max).
        ties: ``"optimistic"`` or ``"pessimistic"``; it alone decides a tie, also between a positive and an exact copy
            of it under another id (see :mod:`lightning_memopt.functional.retrieval`).
        video_block_size: videos per block (``None``: from the memory budget).
        text_block_size: texts per block (``None``: from the memory budget).
        memory_budget_bytes: working-set budget for the blocks.
        device: where blocks are computed (default: where ``video_features`` are).

    Examples:
        >>> v = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
        >>> r = retrieval_ranks(v, v.clone(), text_ids=[0, 1, 2])
        >>> r.v2t.tolist(), r.t2v.tolist()
        ([0, 0, 0], [0, 0, 0])
        >>> r = retrieval_ranks(v, v.clone(), text_ids=[0, 1, 2], ties="pessimistic")
        >>> r.v2t.tolist(), r.t2v.tolist()
        ([1, 1, 0], [1, 1, 0])
    """
    check_choice("protocol", protocol, PROTOCOLS)
    check_choice("v2t_gallery", v2t_gallery, V2T_GALLERIES)
    check_choice("ties", ties, TIES)
    check_positive_int("video_block_size", video_block_size, allow_none=True)
    check_positive_int("text_block_size", text_block_size, allow_none=True)
    check_positive_int("memory_budget_bytes", memory_budget_bytes, hint="Give the budget in bytes, e.g. 2**31.")
    check_device("device", device)
    check_features(video_features, text_features)
    n = video_features.shape[0]
    if n == 0:
        raise ValueError("No rows to rank: `video_features` is empty. Pass at least one sample.")
    sample_keys = None
    if sample_ids is not None:
        sample_keys = as_id_tensor(sample_ids, "sample_ids", n)
    video_keys = None
    if video_ids is not None:
        video_keys = as_id_tensor(video_ids, "video_ids", n)
    if protocol == "paired":
        text_keys = torch.zeros(n, dtype=torch.int64)  # unused: a row's text is the row itself
    elif text_ids is None:
        raise ValueError("`text_ids` is required by protocol='dedup'; pass caption ids or use protocol='paired'.")
    else:
        text_keys = as_id_tensor(text_ids, "text_ids", n)
        _warn_if_texts_differ(text_keys, text_features)
    counts = rank_rows(
        video_features.detach(),
        text_keys,
        text_features.detach(),
        sample_ids=sample_keys,
        video_ids=video_keys,
        protocol=protocol,
        v2t_gallery=v2t_gallery,
        ties=ties,
        video_block_size=video_block_size,
        text_block_size=text_block_size,
        memory_budget_bytes=memory_budget_bytes,
        device=blocks_device(device, video_features),
        collectives=LOCAL,
    )
    return counts.ranks()


def streaming_retrieval(
    video_features: Tensor,
    text_features: Tensor,
    text_ids: Any = None,
    *,
    top_k: Sequence[int] = (1, 5, 10),
    median: Median = "floor",
    **kwargs: Any,
) -> dict[str, Tensor]:
    """The metric's dict (``"v2t/R@1"``, ..., ``"t2v/MeanR"``) computed from tensors in one call.

    Takes the arguments of :func:`retrieval_ranks` plus ``top_k`` and ``median``.

    Examples:
        >>> v = torch.eye(3)
        >>> out = streaming_retrieval(v, v.clone(), text_ids=[0, 1, 2], top_k=(1,))
        >>> {k: v.item() for k, v in out.items()}
        {'v2t/R@1': 1.0, 'v2t/MedR': 1.0, 'v2t/MeanR': 1.0, 't2v/R@1': 1.0, 't2v/MedR': 1.0, 't2v/MeanR': 1.0}
    """
    top_k = top_k_tuple(top_k)
    check_choice("median", median, MEDIANS)
    ranks = retrieval_ranks(video_features, text_features, text_ids, **kwargs)
    out = summarize_ranks(ranks.v2t, top_k, median, prefix="v2t/")
    out.update(summarize_ranks(ranks.t2v, top_k, median, prefix="t2v/"))
    return out


def _warn_if_texts_differ(text_keys: Tensor, text_features: Tensor) -> None:
    """Warn when a caption id's later rows carry other features than its first row (the one that is ranked)."""
    _, first, inverse = first_occurrence(text_keys)
    source = first[inverse]
    repeats = torch.nonzero(source != torch.arange(text_keys.numel())).flatten()
    if repeats.numel() == 0:
        return
    features = text_features.detach()
    kept = features.index_select(0, source[repeats].to(features.device))
    message = repeated_text_message(
        text_keys[repeats], features.index_select(0, repeats.to(features.device)), kept, "retrieval_ranks"
    )
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=4)
