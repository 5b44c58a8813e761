"""The one orchestration behind :func:`retrieval_ranks` and ``StreamingRetrievalMetric``: ids -> galleries -> ranks.

:func:`rank_rows` ranks this process's rows against every process's texts. Whatever needs the other processes goes
through the :class:`Collectives` it is given: :data:`LOCAL` (a world of one process) for the functional form,
``torch.distributed`` collectives for the metric under DDP. Video features never leave their process; processes
share row ids, the unique text embeddings (each sent once, by the first process that holds it) and per-text
vectors, and sum (t2v ranks, v2t rank histogram) or max-reduce (best positive score per text) what they count.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Protocol

import torch
from torch import Tensor

from lightning_memopt.functional.retrieval.ids import RetrievalPlan, first_occurrence, plan_retrieval
from lightning_memopt.functional.retrieval.kernel import choose_block_sizes, count_ranks
from lightning_memopt.functional.retrieval.options import DEFAULT_MEMORY_BUDGET_BYTES, Ties, V2TGallery
from lightning_memopt.functional.retrieval.options import Protocol as RetrievalProtocol
from lightning_memopt.functional.retrieval.scores import embedding_keys, pair_scores, positive_thresholds

__all__ = ["LOCAL", "Collectives", "LocalCollectives", "RankCounts", "RetrievalRanks", "ReduceOp", "rank_rows"]

ReduceOp = Literal["sum", "max"]


class Collectives(Protocol):
    """The collectives :func:`rank_rows` needs; every process calls each of them in the same order.

    Attributes:
        rank: this process's index in ``[0, world)``.
        world: the number of processes.
    """

    rank: int
    world: int

    def all_gather_rows(self, rows: Tensor) -> Tensor:
        """Every process's rows of a 2-D tensor (row counts may differ), concatenated in rank order."""
        ...

    def all_reduce(self, values: Tensor, op: ReduceOp) -> Tensor:
        """The elementwise ``"sum"`` or ``"max"`` of ``values`` over processes."""
        ...


class LocalCollectives:
    """A world of one process: gathering and reducing return their input.

    Examples:
        >>> LOCAL.all_gather_rows(torch.ones(2, 3)).shape, LOCAL.rank, LOCAL.world
        (torch.Size([2, 3]), 0, 1)
    """

    rank = 0
    world = 1

    def all_gather_rows(self, rows: Tensor) -> Tensor:
        return rows

    def all_reduce(self, values: Tensor, op: ReduceOp) -> Tensor:
        return values


#: The collectives of a single process.
LOCAL = LocalCollectives()


class RetrievalRanks(NamedTuple):
    """Per-query ``rank0`` values (0 = the best positive is first) and the ids of the queries.

    ``v2t[i]`` belongs to video ``video_ids[i]``; ``t2v[j]`` to text ``text_ids[j]`` (int64 keys; string ids are
    hashed by :func:`as_id_tensor`). ``v2t_gallery_size`` and ``t2v_gallery_size`` are the gallery sizes.
    """

    v2t: Tensor
    t2v: Tensor
    video_ids: Tensor
    text_ids: Tensor
    v2t_gallery_size: int
    t2v_gallery_size: int


class RankCounts(NamedTuple):
    """What :func:`rank_rows` returns, the same on every process.

    Attributes:
        v2t: ``rank0`` of every video (``None`` unless ``gather_v2t``).
        v2t_histogram: ``v2t_histogram[r]`` = number of videos with ``rank0 == r``.
        t2v: ``rank0`` of every text.
        plan: the galleries and positive pairs (global video and text keys).
        v2t_gallery_size: texts, or videos for the group-max gallery.
        num_rows: rows counted (repeated samples count once).
        embed_dim: the feature dim.
        block_sizes: ``(videos, texts)`` per block on this process.
        sample_ids_given: whether the rows came with sample ids.
    """

    v2t: Tensor | None
    v2t_histogram: Tensor
    t2v: Tensor
    plan: RetrievalPlan
    v2t_gallery_size: int
    num_rows: int
    embed_dim: int
    block_sizes: tuple[int, int]
    sample_ids_given: bool

    def ranks(self) -> RetrievalRanks:
        """The per-query ranks with the ids of the queries (needs ``gather_v2t=True``)."""
        if self.v2t is None:
            raise ValueError("The per-video ranks were not gathered: call `rank_rows(..., gather_v2t=True)`.")
        plan = self.plan
        return RetrievalRanks(
            self.v2t, self.t2v, plan.video_keys, plan.text_keys, self.v2t_gallery_size, plan.video_keys.numel()
        )


def _gather(collectives: Collectives, values: Tensor, width: int | None = None) -> Tensor:
    """:meth:`Collectives.all_gather_rows` of a 1-D (one column) or 2-D tensor of ``width`` columns."""
    rows = values
    if values.dim() == 1:
        rows = values.unsqueeze(1)
    if width is not None and rows.shape[1] != width:
        rows = rows.reshape(0, width)
    return collectives.all_gather_rows(rows)


class _Shapes(NamedTuple):
    rows_per_rank: list[int]
    dim: int
    sample_ids_given: bool
    video_ids_given: bool


def _exchange_shapes(collectives: Collectives, video: Tensor, has_samples: bool, has_videos: bool) -> _Shapes:
    """Every process's row count, and the feature dim and optional ids they agree on (``ValueError`` otherwise)."""
    n_local = video.shape[0]
    dim_local = int(video.shape[1]) if n_local else 0
    meta = _gather(collectives, torch.tensor([[n_local, dim_local, int(has_samples), int(has_videos)]]))
    nonempty = meta[meta[:, 0] > 0]
    if nonempty.shape[0] == 0:
        raise ValueError(
            "`StreamingRetrievalMetric.compute()` found no rows on any process: call `update()` with features"
            " first (or check that the validation loop ran)."
        )
    dims = set(nonempty[:, 1].tolist())
    if len(dims) > 1:
        raise ValueError(f"Processes hold features of different dims {sorted(dims)}; use one embedding size.")
    for col, name in ((2, "sample_ids"), (3, "video_ids")):
        if len(set(nonempty[:, col].tolist())) > 1:
            raise ValueError(f"`{name}` were given on some processes and not on others; give them everywhere.")
    return _Shapes(meta[:, 0].tolist(), dims.pop(), bool(nonempty[0, 2]), bool(nonempty[0, 3]))


def _text_gallery(collectives: Collectives, plan: RetrievalPlan, keys: Tensor, features: Tensor, dim: int) -> Tensor:
    """The ``(texts, dim)`` float32 gallery: each text is sent once, by the first process holding it (rank order)."""
    all_keys = _gather(collectives, keys).squeeze(1)
    counts = _gather(collectives, torch.tensor([[keys.numel()]]))[:, 0].tolist()
    start = sum(counts[: collectives.rank])
    first = first_occurrence(all_keys)[1]
    owned = first[(first >= start) & (first < start + keys.numel())] - start
    owned = owned[torch.isin(keys[owned], plan.text_keys)]
    sent_keys = _gather(collectives, keys[owned]).squeeze(1)
    sent_features = _gather(collectives, features[owned.to(features.device)].float(), width=dim)
    text = torch.empty(plan.text_keys.numel(), dim, dtype=torch.float32, device=sent_features.device)
    text[torch.searchsorted(plan.text_keys, sent_keys)] = sent_features
    return text


def _positive_video_keys(
    collectives: Collectives, plan: RetrievalPlan, mine: Tensor, my_video: Tensor
) -> tuple[Tensor, Tensor]:
    """``(text index, video key)`` of the positive pairs whose video's row key is shared by another video anywhere.

    Exact copies of a positive video may sit on another process: one key per video is shared, so every process gives
    its copies the positive's own score (see :class:`~lightning_memopt.functional.retrieval.ties.TieCells`).
    """
    keys = _gather(collectives, torch.stack([mine, embedding_keys(my_video)], 1))
    video_key = torch.empty(plan.video_keys.numel(), dtype=torch.int64)
    video_key[keys[:, 0]] = keys[:, 1]
    _, key_index, key_count = torch.unique(video_key, return_inverse=True, return_counts=True)
    shared = key_count[key_index[plan.pair_video]] > 1
    return plan.pair_text[shared], video_key[plan.pair_video[shared]]


def _rows_of_width(rows: Tensor, dim: int) -> Tensor:
    """``rows`` as they are, or as ``(0, dim)`` when they hold no row (an empty tensor of any shape)."""
    if rows.shape[0]:
        return rows
    return rows.reshape(0, dim)


def _video_keys(video_ids_given: bool, video_ids: Tensor | None, row_keys: Tensor, empty_ids: Tensor) -> Tensor:
    """The video key of each local row: its video id where the processes give them (none without local rows), else
    its row key."""
    if not video_ids_given:
        return row_keys
    if video_ids is not None:
        return video_ids
    return empty_ids


def _text_keys(
    protocol: RetrievalProtocol, row_keys: Tensor, row_text_ids: Tensor, n_local: int, empty_ids: Tensor
) -> Tensor:
    """The text key of each local row: its row key for ``protocol="paired"``, else its caption id."""
    if protocol == "paired":
        return row_keys
    if n_local:
        return row_text_ids
    return empty_ids


def rank_rows(
    video: Tensor,
    row_text_ids: Tensor,
    text_features: Tensor,
    text_ids: Tensor | None = None,
    *,
    sample_ids: Tensor | None = None,
    video_ids: Tensor | None = None,
    protocol: RetrievalProtocol = "dedup",
    v2t_gallery: V2TGallery = "texts",
    ties: Ties = "optimistic",
    video_block_size: int | None = None,
    text_block_size: int | None = None,
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
    device: torch.device | None = None,
    collectives: Collectives = LOCAL,
    gather_v2t: bool = True,
) -> RankCounts:
    """Rank this process's rows against every process's texts; with several processes, every one must call it.

    Arguments are checked by the callers (:func:`retrieval_ranks`, the metric's ``update``); this raises a
    ``ValueError`` only for what the processes disagree on, or when no process holds a row.

    Args:
        video: ``(n, D)`` this process's rows (``n`` may be 0, then any ``D``).
        row_text_ids: ``(n,)`` int64 caption id of each row (unused by ``protocol="paired"``).
        text_features: the captions' features: one row per row of ``video`` when ``text_ids`` is ``None``, else one
            per entry of ``text_ids``.
        text_ids: int64 ids of the rows of ``text_features`` (e.g. each caption held here once), or ``None``.
        sample_ids: ``(n,)`` int64 sample ids (repeats count once), or ``None`` (rows numbered in rank order).
        video_ids: ``(n,)`` int64 video ids, or ``None`` (each row its own video).
        protocol: ``"dedup"`` or ``"paired"`` (the text key of a row is its row key).
        v2t_gallery: ``"texts"`` or ``"groups"``.
        ties: ``"optimistic"`` or ``"pessimistic"``.
        video_block_size: videos per block (``None``: from the budget).
        text_block_size: texts per block (``None``: from the budget).
        memory_budget_bytes: working-set budget of one block.
        device: where blocks are computed (``None``: where ``video`` is).
        collectives: how the processes talk (:data:`LOCAL`: one process).
        gather_v2t: also gather every video's rank (the histogram is always reduced).

    Examples:
        >>> x = torch.eye(3)
        >>> counts = rank_rows(x, torch.tensor([0, 1, 2]), x.clone())
        >>> counts.v2t.tolist(), counts.t2v.tolist(), counts.v2t_histogram.tolist(), counts.num_rows
        ([0, 0, 0], [0, 0, 0], [3, 0, 0], 3)
    """
    shapes = _exchange_shapes(collectives, video, sample_ids is not None, video_ids is not None)
    dim, rank = shapes.dim, collectives.rank
    n_local, offset = video.shape[0], sum(shapes.rows_per_rank[:rank])
    empty_ids = torch.empty(0, dtype=torch.int64)
    video = _rows_of_width(video, dim)
    if not shapes.sample_ids_given:
        row_keys = torch.arange(offset, offset + n_local)
    else:
        row_keys = sample_ids if sample_ids is not None else empty_ids
    video_keys = _video_keys(shapes.video_ids_given, video_ids, row_keys, empty_ids)
    text_keys = _text_keys(protocol, row_keys, row_text_ids, n_local, empty_ids)

    # global id tables (ints only), in rank order
    table = _gather(collectives, torch.stack([row_keys, video_keys, text_keys], 1))
    row_rank = torch.repeat_interleave(torch.arange(len(shapes.rows_per_rank)), torch.tensor(shapes.rows_per_rank))
    plan = plan_retrieval(table[:, 0], table[:, 1], table[:, 2])
    n_video, n_text = plan.video_keys.numel(), plan.text_keys.numel()

    if text_ids is None:  # one caption per row: the rows that count offer their captions
        kept_here = plan.kept_rows[offset : offset + n_local].nonzero().squeeze(1)
        text_ids = text_keys[kept_here]
        text_features = text_features.index_select(0, kept_here.to(text_features.device))
    text_features = _rows_of_width(text_features, dim)
    text = _text_gallery(collectives, plan, text_ids, text_features, dim)

    # this process's videos: those whose first kept row lives here
    mine = (row_rank[plan.video_rows] == rank).nonzero().squeeze(1)
    local_rows = plan.video_rows[mine] - offset
    if local_rows.numel() == n_local and bool((local_rows == torch.arange(n_local)).all()):
        my_video = video
    else:
        my_video = video.index_select(0, local_rows.to(video.device))
    local_index = torch.full((n_video,), -1, dtype=torch.int64)
    local_index[mine] = torch.arange(mine.numel())
    is_mine = local_index[plan.pair_video] >= 0
    pair_video, pair_text = local_index[plan.pair_video[is_mine]], plan.pair_text[is_mine]
    positive_video_keys = _positive_video_keys(collectives, plan, mine, my_video)

    device = device if device is not None else my_video.device
    with torch.no_grad():
        scores = pair_scores(my_video, text, pair_video, pair_text)
    video_threshold = positive_thresholds(scores, pair_video, mine.numel())
    text_threshold = collectives.all_reduce(positive_thresholds(scores, pair_text, n_text), "max")
    grouped = v2t_gallery == "groups"
    block_sizes = choose_block_sizes(
        mine.numel(),
        n_text,
        dim,
        device,
        memory_budget_bytes,
        video_block_size,
        text_block_size,
        n_video if grouped else 0,
    )
    video_counts, text_counts = count_ranks(
        my_video,
        text,
        pair_video,
        pair_text,
        video_threshold,
        text_threshold,
        ties=ties,
        video_groups=mine if grouped else None,
        group_pairs=(plan.pair_text, plan.pair_video, n_video) if grouped else None,
        positive_scores=scores,
        positive_video_keys=positive_video_keys,
        video_block_size=block_sizes[0],
        text_block_size=block_sizes[1],
        memory_budget_bytes=memory_budget_bytes,
        device=device,
    )
    t2v = collectives.all_reduce(text_counts, "sum")
    v2t_size = n_video if grouped else n_text
    histogram = collectives.all_reduce(torch.bincount(video_counts, minlength=v2t_size), "sum")
    v2t = None
    if gather_v2t:
        gathered = _gather(collectives, torch.stack([mine, video_counts], 1))
        v2t = torch.empty(n_video, dtype=torch.int64)
        v2t[gathered[:, 0]] = gathered[:, 1]
    num_rows = int(plan.kept_rows.sum())
    return RankCounts(v2t, histogram, t2v, plan, v2t_size, num_rows, dim, block_sizes, shapes.sample_ids_given)
