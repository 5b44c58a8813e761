"""Tie cells: gallery items whose embedding equals a positive's exactly, and the positive's score they take.

In every block the positives' own cells and these cells are overwritten with the positive's :func:`pair_scores`
value before the comparison, so an exact duplicate of the best positive ties with it in every block layout, chunk
size and world size, and ``ties`` alone decides the tie. Only duplicates cost anything.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from lightning_memopt.functional.retrieval.ids import first_occurrence
from lightning_memopt.functional.retrieval.scores import embedding_keys, pair_scores

__all__ = ["TieCells", "exact_groups"]

# Tie cells written into a block per chunk (bounds the index memory when a duplicate group is huge).
_TIE_CHUNK = 1 << 22


class Groups(NamedTuple):
    """Rows grouped by exact equality: ``gid`` per row (numbered by first row), ``size`` and ``rep`` per group."""

    gid: Tensor
    size: Tensor
    rep: Tensor


def exact_groups(features: Tensor, keys: Tensor) -> Groups | None:
    """Group rows with exactly equal values (``None`` when all rows differ, the common case).

    Examples:
        >>> groups = exact_groups(torch.tensor([[1.0], [2.0], [1.0]]), torch.tensor([5, 6, 5]))
        >>> groups.gid.tolist(), groups.size.tolist(), groups.rep.tolist()
        ([0, 1, 0], [2, 1], [0, 1])
    """
    n = keys.numel()
    _, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
    if counts.numel() == n:
        return None
    candidates = (counts[inverse] > 1).nonzero().squeeze(1)
    rows = features.index_select(0, candidates.to(features.device)).float() + 0.0
    _, sub = torch.unique(rows.view(torch.int32), dim=0, return_inverse=True)
    label = torch.arange(n, dtype=torch.int64) + n
    label[candidates] = sub.cpu()
    uniq, first, inv = first_occurrence(label)
    if uniq.numel() == n:
        return None
    order = torch.argsort(first)
    rank_of = torch.empty_like(order)
    rank_of[order] = torch.arange(order.numel())
    gid = rank_of[inv]
    return Groups(gid, torch.bincount(gid, minlength=uniq.numel()), first[order])


def _members_in_range(slot_group: Tensor, codes: Tensor, n: int, lo: int, hi: int) -> Iterator[tuple[Tensor, Tensor]]:
    """For each slot, the members of its group with index in ``[lo, hi)``: yields ``(slot positions, members)``.

    ``codes`` are the sorted ``group * n + member`` of every member. Chunks hold at most ``_TIE_CHUNK`` cells (a slot
    with more members than that comes alone).
    """
    chunk = _TIE_CHUNK
    if slot_group.numel() == 0 or codes.numel() == 0:
        return
    base = slot_group * n
    start = torch.searchsorted(codes, base + lo)
    count = torch.searchsorted(codes, base + hi) - start
    live = (count > 0).nonzero().squeeze(1)
    if live.numel() == 0:
        return
    start, count = start[live], count[live]
    ends = count.cumsum(0)
    a = 0
    while a < live.numel():
        done = int(ends[a - 1]) if a else 0
        b = max(a + 1, int(torch.searchsorted(ends, torch.tensor(done + chunk), right=True)))
        c = count[a:b]
        slot = torch.repeat_interleave(torch.arange(b - a), c)
        offset = torch.arange(int(c.sum())) - (c.cumsum(0) - c)[slot]
        slots = live[a:b][slot]
        yield slots, codes[start[a:b][slot] + offset] - base[slots]
        a = b


class TieCells:
    """Cells whose true score equals a positive's exactly, and that score (see the module docstring).

    v2t: for a video and each text group holding one of its positives, every text of that group. t2v: for a text and
    each key of its positives' videos (over all processes), every local video with that key (a key shared by
    different embeddings only means those cells get their own exact pair score, which is harmless).
    """

    def __init__(
        self,
        video: Tensor,
        text: Tensor,
        pair_video: Tensor,
        pair_text: Tensor,
        scores: Tensor,
        positive_video_keys: tuple[Tensor, Tensor] | None,
    ) -> None:
        n_video, n_text = video.shape[0], text.shape[0]
        self.n_video, self.n_text = n_video, n_text
        empty = torch.empty(0, dtype=torch.int64)
        self.v2t = (empty, empty, torch.empty(0))
        self.t2v = (empty, empty, torch.empty(0))
        self.text_codes, self.video_codes = empty, empty
        text_groups = None
        if n_text:
            text_groups = exact_groups(text, embedding_keys(text))
        if text_groups is not None and pair_video.numel():
            multi = text_groups.size[text_groups.gid[pair_text]] > 1
            q, g = pair_video[multi], text_groups.gid[pair_text[multi]]
            first = first_occurrence(q * text_groups.size.numel() + g)[1]  # sorted by video, then group
            self.v2t = (q[first], g[first], scores[multi][first])
            in_multi = (text_groups.size[text_groups.gid] > 1).nonzero().squeeze(1)
            self.text_codes = torch.sort(text_groups.gid[in_multi] * n_text + in_multi).values
        if not n_video:
            return
        keys = None
        if positive_video_keys is None:  # one process: keys of the positives' videos shared by another local video
            keys = embedding_keys(video)
            _, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
            shared = counts[inverse[pair_video]] > 1
            positive_video_keys = (pair_text[shared], keys[pair_video[shared]])
        p_text, p_key = (t.to(torch.int64).cpu() for t in positive_video_keys)
        if p_text.numel() == 0:
            return
        if keys is None:
            keys = embedding_keys(video)
        groups = exact_groups(video, keys)
        if groups is not None:
            gid, rep = groups.gid, groups.rep
        else:
            gid, rep = torch.arange(n_video), torch.arange(n_video)
        group_key = keys[rep]
        by_key = torch.argsort(group_key)
        sorted_keys = group_key[by_key]
        lo = torch.searchsorted(sorted_keys, p_key)
        count = torch.searchsorted(sorted_keys, p_key, right=True) - lo
        which = torch.repeat_interleave(torch.arange(p_text.numel()), count)
        offset = torch.arange(int(count.sum())) - (count.cumsum(0) - count)[which]
        j, g = p_text[which], by_key[lo[which] + offset]
        code = torch.unique(j * rep.numel() + g)  # sorted by text, then group
        j, g = code // rep.numel(), code % rep.numel()
        self.t2v = (j, g, pair_scores(video, text, rep[g], j).cpu())
        self.video_codes = torch.sort(gid * n_video + torch.arange(n_video)).values

    def cells(self, v0: int, v1: int, t0: int, t1: int) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        """``(video index, text index, score)`` of the tie cells inside the block ``[v0, v1) x [t0, t1)``."""
        q, g, value = self.v2t
        if q.numel():
            a, b = (int(i) for i in torch.searchsorted(q, torch.tensor([v0, v1])))
            for slot, members in _members_in_range(g[a:b], self.text_codes, self.n_text, t0, t1):
                yield q[a:b][slot], members, value[a:b][slot]
        j, g, value = self.t2v
        if j.numel():
            a, b = (int(i) for i in torch.searchsorted(j, torch.tensor([t0, t1])))
            for slot, members in _members_in_range(g[a:b], self.video_codes, self.n_video, v0, v1):
                yield members, j[a:b][slot], value[a:b][slot]
