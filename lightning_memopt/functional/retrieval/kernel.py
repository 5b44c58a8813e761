"""Blockwise rank counting: one pass over ``(video block x text block)`` products serves both directions.

For each block ``S_b = V_b @ T_b.T`` (full float32, TF32 off), the positives' own cells and their exact duplicates
(:mod:`~lightning_memopt.functional.retrieval.ties`) take the positive's score, and the gallery items above each
query's best positive are counted for both directions; the positives' own contributions are removed by index at the
end (an ``O(pairs)`` correction). No similarity matrix, sort or top-k is ever materialised.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from lightning_memopt.functional.retrieval.options import DEFAULT_MEMORY_BUDGET_BYTES, TIES, Ties, blocks_device
from lightning_memopt.functional.retrieval.scores import full_fp32_matmul, pair_scores
from lightning_memopt.functional.retrieval.ties import TieCells
from lightning_memopt.utilities.checks import check_choice, check_positive_int

__all__ = ["BlockLayout", "choose_block_sizes", "count_ranks"]

# Block-size caps: on CPU, blocks that stay near the last-level cache count fastest; on a GPU, big blocks keep the
# matrix units busy. The memory budget can only shrink them.
_CPU_MAX_BLOCK = (2048, 4096)
_CUDA_MAX_BLOCK = (16384, 32768)
# Score-block rows compared per pass on CPU: 128 rows of a 4096-text block (2 MiB) stay in cache between passes.
_CMP_ROWS = 128

Compare = Callable[..., Tensor]


def choose_block_sizes(
    n_video: int,
    n_text: int,
    dim: int,
    device: torch.device | str = "cpu",
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
    video_block_size: int | None = None,
    text_block_size: int | None = None,
    n_groups: int = 0,
) -> tuple[int, int]:
    """Block sizes whose working set fits ``memory_budget_bytes``; explicit sizes are kept up to the data's size.

    A block never holds more rows than there are (an explicit ``video_block_size=10**12`` on 6 videos is a block of
    6): every buffer sized by a block is then sized by the data.

    The working set is the float32 texts on the device, one float32 video block, the score block and the comparison
    buffer (and, for the group-max gallery, one float per video and group).

    Examples:
        >>> choose_block_sizes(117_000, 23_000, 512)
        (2048, 4096)
        >>> choose_block_sizes(117_000, 23_000, 512, memory_budget_bytes=80 * 2**20)
        (1024, 4096)
        >>> choose_block_sizes(6, 3, 512, video_block_size=10**12, text_block_size=10**12)
        (6, 3)
    """
    device = torch.device(device)
    max_video_block, max_text_block = _CUDA_MAX_BLOCK if device.type == "cuda" else _CPU_MAX_BLOCK
    text_block = max(1, min(text_block_size or max_text_block, n_text))
    if video_block_size is not None:
        return max(1, min(video_block_size, n_video)), text_block
    fixed = n_text * dim * 4
    per_video_row = (2 * text_block + dim + n_groups) * 4
    video_block = (memory_budget_bytes - fixed) // per_video_row
    video_block = int(max(1, min(max_video_block, max(n_video, 1), video_block)))
    if video_block >= 64:
        video_block = video_block // 64 * 64
    return video_block, text_block


class BlockLayout(NamedTuple):
    """How ``n_video x n_text`` scores are cut into blocks of ``video_block x text_block``.

    Examples:
        >>> layout = BlockLayout(10, 3, video_block=4, text_block=2)
        >>> layout.n_video_blocks, layout.n_text_blocks, layout.video_range(2), layout.text_range(1)
        (3, 2, (8, 10), (2, 3))
    """

    n_video: int
    n_text: int
    video_block: int
    text_block: int

    @property
    def n_video_blocks(self) -> int:
        return math.ceil(self.n_video / self.video_block)

    @property
    def n_text_blocks(self) -> int:
        return math.ceil(self.n_text / self.text_block)

    def video_range(self, i: int) -> tuple[int, int]:
        """``[start, stop)`` of video block ``i``."""
        return i * self.video_block, min(self.n_video, (i + 1) * self.video_block)

    def text_range(self, j: int) -> tuple[int, int]:
        """``[start, stop)`` of text block ``j``."""
        return j * self.text_block, min(self.n_text, (j + 1) * self.text_block)


class _PositivesByBlock:
    """The positive pairs sorted by block, so that each block writes its positives' own scores with one scatter."""

    def __init__(
        self, pair_video: Tensor, pair_text: Tensor, scores: Tensor, layout: BlockLayout, device: torch.device
    ):
        self.n_text_blocks = layout.n_text_blocks
        block_of_pair = (pair_video // layout.video_block) * self.n_text_blocks + pair_text // layout.text_block
        order = torch.argsort(block_of_pair, stable=True)
        n_blocks = layout.n_video_blocks * self.n_text_blocks
        self.offsets = [0, *torch.bincount(block_of_pair, minlength=n_blocks).cumsum(0).tolist()]
        self.video = pair_video[order].to(device)
        self.text = pair_text[order].to(device)
        self.scores = scores[order].to(device)

    def in_block(self, i: int, j: int) -> tuple[Tensor, Tensor, Tensor]:
        """``(video index, text index, score)`` of the positive pairs in block ``(i, j)``."""
        start, stop = self.offsets[i * self.n_text_blocks + j], self.offsets[i * self.n_text_blocks + j + 1]
        return self.video[start:stop], self.text[start:stop], self.scores[start:stop]


class _MembershipsByTextBlock:
    """For the group-max v2t gallery: the ``(caption, group)`` memberships sorted by text block."""

    def __init__(self, member_text: Tensor, member_group: Tensor, layout: BlockLayout, device: torch.device):
        member_text, member_group = member_text.to(torch.int64).cpu(), member_group.to(torch.int64).cpu()
        text_block_of = member_text // layout.text_block
        order = torch.argsort(text_block_of, stable=True)
        self.offsets = [0, *torch.bincount(text_block_of, minlength=layout.n_text_blocks).cumsum(0).tolist()]
        self.text = member_text[order].to(device)
        self.group = member_group[order].to(device)

    def in_text_block(self, j: int) -> tuple[Tensor, Tensor]:
        """``(text index, group index)`` of the memberships whose caption lies in text block ``j``."""
        start, stop = self.offsets[j], self.offsets[j + 1]
        return self.text[start:stop], self.group[start:stop]


class _BlockCounter:
    """The device buffers and running counts of one :func:`count_ranks` call; counts one video block at a time."""

    def __init__(
        self,
        video: Tensor,
        text: Tensor,
        video_threshold: Tensor,
        text_threshold: Tensor,
        layout: BlockLayout,
        compare: Compare,
        device: torch.device,
        memberships: _MembershipsByTextBlock | None,
        own_group: Tensor | None,
        n_groups: int,
    ) -> None:
        self.video, self.layout, self.compare, self.device = video, layout, compare, device
        self.memberships, self.own_group = memberships, own_group
        self.video_counts = torch.zeros(layout.n_video, dtype=torch.int64, device=device)
        self.text_counts = torch.zeros(layout.n_text, dtype=torch.int64, device=device)
        self.video_threshold = video_threshold.to(device=device, dtype=torch.float32)
        self.text_threshold = text_threshold.to(device=device, dtype=torch.float32)
        self.text32 = text.to(device=device, dtype=torch.float32).contiguous()
        block_cells = layout.video_block * min(layout.text_block, layout.n_text)
        self.score_buf = torch.empty(block_cells, dtype=torch.float32, device=device)
        # the comparisons run over a few rows of the score block at a time, so that the rows and their flags stay in
        # cache between the two comparisons and the two sums (40 % less time than whole-block passes on CPU)
        self.rows_per_pass = layout.video_block if device.type == "cuda" else min(layout.video_block, _CMP_ROWS)
        self.flag_buf = torch.empty(
            self.rows_per_pass * min(layout.text_block, layout.n_text), dtype=torch.float32, device=device
        )
        self.group_hits = None
        if memberships is not None:
            self.group_hits = torch.empty(layout.video_block, n_groups, dtype=torch.float32, device=device)

    def count_video_block(self, i: int, positives: _PositivesByBlock, tie_cells: TieCells) -> None:
        """Count video block ``i`` against every text block: its v2t counts, and its share of the t2v counts."""
        v0, v1 = self.layout.video_range(i)
        n_rows = v1 - v0
        video_block = self.video[v0:v1].to(device=self.device, dtype=torch.float32, non_blocking=True)
        video_thresholds = self.video_threshold[v0:v1].unsqueeze(1)
        video_hits = torch.zeros(n_rows, dtype=torch.int64, device=self.device)
        if self.group_hits is not None:
            self.group_hits[:n_rows].zero_()
        for j in range(self.layout.n_text_blocks):
            scores = self._block_scores(video_block, i, j, positives, tie_cells)
            self._compare_block(scores, j, video_thresholds, video_hits)
        if self.group_hits is not None and self.own_group is not None:
            hits = self.group_hits[:n_rows]
            own = hits[torch.arange(n_rows, device=self.device), self.own_group[v0:v1]]
            video_hits = (hits.sum(1) - own).to(torch.int64)
        self.video_counts[v0:v1] = video_hits

    def _block_scores(
        self, video_block: Tensor, i: int, j: int, positives: _PositivesByBlock, tie_cells: TieCells
    ) -> Tensor:
        """The score block ``(i, j)``, its positives' and tie cells' scores replaced by the positives' exact scores."""
        (v0, v1), (t0, t1) = self.layout.video_range(i), self.layout.text_range(j)
        scores = self.score_buf[: (v1 - v0) * (t1 - t0)].view(v1 - v0, t1 - t0)
        torch.mm(video_block, self.text32[t0:t1].T, out=scores)
        pair_video, pair_text, pair_score = positives.in_block(i, j)
        if pair_video.numel():
            scores[pair_video - v0, pair_text - t0] = pair_score
        for cell_rows, cell_cols, values in tie_cells.cells(v0, v1, t0, t1):
            scores[(cell_rows - v0).to(self.device), (cell_cols - t0).to(self.device)] = values.to(self.device)
        return scores

    def _compare_block(self, scores: Tensor, j: int, video_thresholds: Tensor, video_hits: Tensor) -> None:
        """Count the cells above each row's (video) and each column's (text) threshold, a few rows at a time."""
        t0, t1 = self.layout.text_range(j)
        n_rows, n_cols = scores.shape
        text_thresholds = self.text_threshold[t0:t1].unsqueeze(0)
        text_hits = torch.zeros(n_cols, dtype=torch.float32, device=self.device)  # exact: at most `video_block`
        if self.memberships is not None:
            member_text, member_group = self.memberships.in_text_block(j)
        for r0 in range(0, n_rows, self.rows_per_pass):
            r1 = min(n_rows, r0 + self.rows_per_pass)
            rows = scores[r0:r1]
            flags = self.flag_buf[: (r1 - r0) * n_cols].view(r1 - r0, n_cols)
            self.compare(rows, video_thresholds[r0:r1], out=flags)
            if self.group_hits is None:
                video_hits[r0:r1] += flags.sum(1).to(torch.int64)
            elif member_text.numel():
                member_flags = flags.index_select(1, member_text - t0)
                index = member_group.unsqueeze(0).expand(r1 - r0, -1)
                self.group_hits[r0:r1].scatter_reduce_(1, index, member_flags, "amax")
            self.compare(rows, text_thresholds, out=flags)
            text_hits += flags.sum(0)
        self.text_counts[t0:t1] += text_hits.to(torch.int64)

    def remove_positives(self, pair_video: Tensor, pair_text: Tensor, pair_score: Tensor) -> None:
        """Take out the positives' own counts: they were compared with their own scores in the blocks."""
        pair_video, pair_text = pair_video.to(self.device), pair_text.to(self.device)
        pair_score = pair_score.to(self.device)
        if self.group_hits is None:
            above = self.compare(pair_score, self.video_threshold[pair_video]).to(torch.int64)
            self.video_counts.index_add_(0, pair_video, above, alpha=-1)
        above = self.compare(pair_score, self.text_threshold[pair_text]).to(torch.int64)
        self.text_counts.index_add_(0, pair_text, above, alpha=-1)


def count_ranks(
    video: Tensor,
    text: Tensor,
    pair_video: Tensor,
    pair_text: Tensor,
    video_threshold: Tensor,
    text_threshold: Tensor,
    *,
    ties: Ties = "optimistic",
    video_groups: Tensor | None = None,
    group_pairs: tuple[Tensor, Tensor, int] | None = None,
    positive_scores: Tensor | None = None,
    positive_video_keys: tuple[Tensor, Tensor] | None = None,
    video_block_size: int | None = None,
    text_block_size: int | None = None,
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """Count, per video and per text, the non-positive gallery items scoring above the query's best positive.

    One pass over ``(video block x text block)`` products serves both directions. ``video`` rows may be only this
    process's videos: the v2t counts are then complete and the t2v counts are this process's share (sum them over
    processes). Positives and the exact duplicates of positives take the positive's own score (see
    :mod:`~lightning_memopt.functional.retrieval.ties`), so ``ties`` alone decides a tie.

    Args:
        video: ``(V, D)`` video features (any float dtype; blocks are upcast to float32).
        text: ``(T, D)`` text features.
        pair_video: video index of each positive pair.
        pair_text: text index of each positive pair.
        video_threshold: ``(V,)`` best positive score of each video (from :func:`pair_scores`).
        text_threshold: ``(T,)`` best positive score of each text (over all processes' videos).
        ties: ``"optimistic"`` counts strictly higher items, ``"pessimistic"`` also counts ties.
        video_groups: for the group-max v2t gallery, the group (global video index) of each local video.
        group_pairs: for the group-max v2t gallery, ``(text index, group index, number of groups)`` of every
            (caption, video) membership over all processes.
        positive_scores: the :func:`pair_scores` of the pairs (computed here when ``None``).
        positive_video_keys: ``(text index, video key)`` of the positive pairs over all processes whose video's
            :func:`embedding_keys` value is shared by another video anywhere; ``None`` in a single process (found
            from the local videos).
        video_block_size: rows of ``video`` per block; chosen from ``memory_budget_bytes`` when ``None``.
        text_block_size: rows of ``text`` per block; chosen likewise when ``None``.
        memory_budget_bytes: working-set budget used to choose block sizes.
        device: where blocks are computed; defaults to ``video``'s device.

    Returns:
        ``(v2t_counts, t2v_counts)`` as int64 tensors on CPU.

    Examples:
        >>> from lightning_memopt.functional.retrieval import positive_thresholds
        >>> v = torch.tensor([[1.0, 0.0], [0.0, 1.0]]); t = torch.tensor([[1.0, 0.0], [0.6, 0.8]])
        >>> pv, pt = torch.tensor([0, 1]), torch.tensor([0, 1])
        >>> s = pair_scores(v, t, pv, pt)
        >>> count_ranks(v, t, pv, pt, positive_thresholds(s, pv, 2), positive_thresholds(s, pt, 2))
        (tensor([0, 0]), tensor([0, 0]))
    """
    check_choice("ties", ties, TIES)
    device = blocks_device(device, video)
    n_video, dim = video.shape
    n_text = text.shape[0]
    if video_groups is not None and group_pairs is None:
        raise ValueError("`video_groups` needs `group_pairs` (the group-max v2t gallery).")
    n_groups = group_pairs[2] if video_groups is not None and group_pairs is not None else 0
    video_block, text_block = choose_block_sizes(
        n_video, n_text, dim, device, memory_budget_bytes, video_block_size, text_block_size, n_groups
    )
    check_positive_int("video_block_size", video_block)
    check_positive_int("text_block_size", text_block)
    if n_video == 0 or n_text == 0:
        return torch.zeros(n_video, dtype=torch.int64), torch.zeros(n_text, dtype=torch.int64)
    layout = BlockLayout(n_video, n_text, video_block, text_block)
    compare = torch.gt if ties == "optimistic" else torch.ge

    pair_video, pair_text = pair_video.to(torch.int64).cpu(), pair_text.to(torch.int64).cpu()
    with torch.no_grad():
        scores = positive_scores
        if scores is None:
            scores = pair_scores(video, text, pair_video, pair_text)
        scores = scores.float().cpu()
        tie_cells = TieCells(video, text, pair_video, pair_text, scores, positive_video_keys)
    positives = _PositivesByBlock(pair_video, pair_text, scores, layout, device)
    memberships, own_group = None, None
    if video_groups is not None and group_pairs is not None:
        memberships = _MembershipsByTextBlock(group_pairs[0], group_pairs[1], layout, device)
        own_group = video_groups.to(device=device, dtype=torch.int64)
    counter = _BlockCounter(
        video, text, video_threshold, text_threshold, layout, compare, device, memberships, own_group, n_groups
    )
    with full_fp32_matmul(), torch.no_grad():
        for i in range(layout.n_video_blocks):
            counter.count_video_block(i, positives, tie_cells)
        counter.remove_positives(pair_video, pair_text, scores)
    return counter.video_counts.cpu(), counter.text_counts.cpu()
