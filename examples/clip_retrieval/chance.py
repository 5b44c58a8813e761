"""What a random ranking scores: the chance level the example's report prints next to each R@K."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["chance_recall_at_k", "chance_recalls"]


def chance_recall_at_k(num_positives: np.ndarray, gallery_size: int, k: int) -> float:
    """Expected R@K of a random ranking: mean over queries of P(at least one of m positives in the top K).

    Args:
        num_positives: positives of each query (``m``).
        gallery_size: items ranked per query (positives included).
        k: the K of R@K.

    Example:
        >>> round(chance_recall_at_k(np.array([1, 1]), 100, 5), 3), round(chance_recall_at_k(np.array([2]), 4, 1), 3)
        (0.05, 0.5)
    """
    m = np.asarray(num_positives, dtype=np.float64)
    miss = np.ones_like(m)
    for i in range(min(k, gallery_size)):
        miss *= np.clip((gallery_size - m - i) / (gallery_size - i), 0.0, 1.0)
    return float(np.mean(1.0 - miss))


def chance_recalls(caption_ids: np.ndarray, top_k: Sequence[int]) -> dict[str, float]:
    """Expected ``v2t/R@K`` and ``t2v/R@K`` of a random ranking under the metric's protocol (deduplicated captions).

    Args:
        caption_ids: the caption id of every row (one video per row).
        top_k: the K of R@K.

    Example:
        >>> {k: round(v, 4) for k, v in chance_recalls(np.array([0, 0, 1, 2]), (1,)).items()}
        {'v2t/R@1': 0.3333, 't2v/R@1': 0.3333}
    """
    n_videos, n_texts = caption_ids.size, int(np.unique(caption_ids).size)
    per_text = np.bincount(caption_ids)
    per_text = per_text[per_text > 0]
    out = {}
    for k in top_k:
        out[f"v2t/R@{k}"] = chance_recall_at_k(np.ones(n_videos), n_texts, k)
        out[f"t2v/R@{k}"] = chance_recall_at_k(per_text, n_videos, k)
    return out
