r"""Exact video<->text retrieval ranks computed in blocks, without the full similarity matrix.

Every number the field reports (R@K, median rank, mean rank) is a function of one integer per query,

.. math::

    \mathrm{rank0}(q) = \#\{\, g \notin P(q) : S[q, g] > \max_{p \in P(q)} S[q, p] \,\}

where :math:`S` is the score matrix (query x gallery) and :math:`P(q)` the positives of query :math:`q`. From it,

.. math::

    \mathrm{R@K} = \operatorname{mean}_q [\mathrm{rank0}(q) < K], \quad
    \mathrm{MeanR} = \operatorname{mean}_q \mathrm{rank0}(q) + 1, \quad
    \mathrm{MedR} = \lfloor \operatorname{median}_q \mathrm{rank0}(q) \rfloor + 1

(the open_clip / VSE++ median convention; ``median="mean"`` keeps the half, ``median="lower"`` takes the lower
middle value as torchmetrics and CLIP4Clip's multi-sentence code do).

No sort and no top-k is needed: for each block ``S_b = V_b @ T_b.T`` the counts of gallery items above each
query's best positive are accumulated for both directions from the same product, and the positives' own
contributions are removed by index afterwards (an ``O(pairs)`` correction). Blocks are multiplied in full float32
(TF32 is switched off for the duration and restored), whatever the storage dtype of the features; float64 features
are ranked in float32 too (a warning says so once).

Ties are decided by ``ties`` and never by rounding. A positive's score (the threshold a negative must beat) is a
float64 dot product summed in a fixed pairwise order and rounded to float32, so equal inputs give the same bits on
every device, in every chunk and on every process. Gallery items whose embedding equals a positive's exactly (a
caption or a video embedded twice, under another id, on this process or another) are found by a row key and an exact
comparison; in every block, their cells and the positives' own cells take that same score before the comparison. An
exact duplicate of the best positive therefore ties with it in every block layout, chunk size and world size. Only
duplicates cost anything: without them the extra work is one key per row.

Protocols (see :func:`retrieval_ranks`; the guide is ``docs/retrieval.md``):

- ``"dedup"`` (default): texts are deduplicated by ``text_ids``; the v2t gallery is the unique texts and a video's
  positives are its captions (one, or all captions of rows sharing a ``video_ids`` value); the t2v gallery is the
  videos and a text's positives are all videos with that caption, ranked by the best of them.
- ``"paired"``: row ``i`` <-> row ``i`` only, no deduplication (open_clip, CLIP4Clip 1:1). Repeated captions are
  then separate gallery items that tie with the positive, which ``ties`` decides.
- ``v2t_gallery="groups"``: the v2t gallery holds one item per video, scored by the best of that video's captions
  (CLIP4Clip multi-sentence "group max"); a video's rank counts the other videos whose best caption beats its own.
- ``ties="optimistic"`` counts only strictly higher negatives (a tie goes to the positive); ``"pessimistic"``
  counts ties against the query.

Modules: :mod:`.ids` (ids to keys, galleries and positive pairs), :mod:`.scores` (exact pair scores, row keys),
:mod:`.ties` (exact duplicates of positives), :mod:`.kernel` (block sizes and blockwise counting),
:mod:`.summaries` (R@K, MedR, MeanR), :mod:`.ranking` (the orchestration shared with the metric, collectives
injected), :mod:`.api` (the functional entry points), :mod:`.options` (option values and feature checks).
"""

from lightning_memopt.functional.retrieval.api import retrieval_ranks, streaming_retrieval
from lightning_memopt.functional.retrieval.ids import RetrievalPlan, as_id_tensor, plan_retrieval
from lightning_memopt.functional.retrieval.kernel import choose_block_sizes, count_ranks
from lightning_memopt.functional.retrieval.options import (
    DEFAULT_MEMORY_BUDGET_BYTES,
    FEATURE_DTYPES,
    MEDIANS,
    PROTOCOLS,
    TIES,
    V2T_GALLERIES,
    Median,
    Protocol,
    Ties,
    V2TGallery,
)
from lightning_memopt.functional.retrieval.ranking import (
    LOCAL,
    Collectives,
    LocalCollectives,
    RankCounts,
    RetrievalRanks,
    rank_rows,
)
from lightning_memopt.functional.retrieval.scores import (
    embedding_keys,
    full_fp32_matmul,
    pair_scores,
    positive_thresholds,
)
from lightning_memopt.functional.retrieval.summaries import summarize_rank_histogram, summarize_ranks

__all__ = [
    "DEFAULT_MEMORY_BUDGET_BYTES",
    "FEATURE_DTYPES",
    "LOCAL",
    "MEDIANS",
    "PROTOCOLS",
    "TIES",
    "V2T_GALLERIES",
    "Collectives",
    "LocalCollectives",
    "Median",
    "Protocol",
    "RankCounts",
    "RetrievalPlan",
    "RetrievalRanks",
    "Ties",
    "V2TGallery",
    "as_id_tensor",
    "choose_block_sizes",
    "count_ranks",
    "embedding_keys",
    "full_fp32_matmul",
    "pair_scores",
    "plan_retrieval",
    "positive_thresholds",
    "rank_rows",
    "retrieval_ranks",
    "streaming_retrieval",
    "summarize_rank_histogram",
    "summarize_ranks",
]
