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

Protocols (see :func:`retrieval_ranks`):

- ``"dedup"`` (default): texts are deduplicated by ``text_ids``; the v2t gallery is the unique texts and a video's
  positives are its captions (one, or all captions of rows sharing a ``video_ids`` value); the t2v gallery is the
  videos and a text's positives are all videos with that caption, ranked by the best of them.
- ``"paired"``: row ``i`` <-> row ``i`` only, no deduplication (open_clip, CLIP4Clip 1:1). Repeated captions are
  then separate gallery items that tie with the positive, which ``ties`` decides.
- ``v2t_gallery="groups"``: the v2t gallery holds one item per video, scored by the best of that video's captions
  (CLIP4Clip multi-sentence "group max"); a video's rank counts the other videos whose best caption beats its own.
- ``ties="optimistic"`` counts only strictly higher negatives (a tie goes to the positive); ``"pessimistic"``
  counts ties against the query.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import operator
import reprlib
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from lightning_memopt.utilities.checks import check_choice, check_device, check_positive_int

__all__ = [
    "DEFAULT_MEMORY_BUDGET_BYTES",
    "RetrievalPlan",
    "RetrievalRanks",
    "as_id_tensor",
    "choose_block_sizes",
    "count_ranks",
    "embedding_keys",
    "full_fp32_matmul",
    "pair_scores",
    "plan_retrieval",
    "positive_thresholds",
    "retrieval_ranks",
    "streaming_retrieval",
    "summarize_rank_histogram",
    "summarize_ranks",
]

#: Default working-set budget for one block computation (score block, comparison buffer, upcast features).
DEFAULT_MEMORY_BUDGET_BYTES = 2 * 1024**3

Protocol = Literal["dedup", "paired"]
Ties = Literal["optimistic", "pessimistic"]
Median = Literal["floor", "mean", "lower"]
V2TGallery = Literal["texts", "groups"]

PROTOCOLS = ("dedup", "paired")
TIES = ("optimistic", "pessimistic")
MEDIANS = ("floor", "mean", "lower")
V2T_GALLERIES = ("texts", "groups")

# Block-size caps: on CPU, blocks that stay near the last-level cache count fastest; on a GPU, big blocks keep the
# matrix units busy. The memory budget can only shrink them.
_CPU_MAX_BLOCK = (2048, 4096)
_CUDA_MAX_BLOCK = (16384, 32768)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
#: Feature dtypes accepted (blocks are multiplied in float32 whatever the storage dtype; float64 is rounded to float32).
FEATURE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# Positive pairs are scored in chunks whose float64 buffer holds about this many bytes (two buffers, reused): big
# enough that per-operation latency does not add up, small enough to stay in cache (512 rows of 512 dims).
_PAIR_CHUNK_BYTES = 1 << 21
# Row keys read this many evenly spaced columns: cheap next to the block products, and rows that agree on all of
# them are compared in full before they count as duplicates.
_KEY_COLUMNS = 32
# Odd multipliers below 2**26: 32 products of int32 bits and these stay far inside int64 (no overflow anywhere).
_KEY_MULTIPLIERS = torch.tensor(
    [(2654435761 * (i + 1)) % (1 << 26) | 1 for i in range(_KEY_COLUMNS)], dtype=torch.int64
)
# Score-block rows compared per pass on CPU: 128 rows of a 4096-text block (2 MiB) stay in cache between passes.
_CMP_ROWS = 128
# Tie cells written into a block per chunk (bounds the index memory when a duplicate group is huge).
_TIE_CHUNK = 1 << 22


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


# --------------------------------------------------------------------------------------------------- ids


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

    Example:
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


# --------------------------------------------------------------------------------------------------- planning


def _first_occurrence(keys: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Sorted unique keys, the position of each unique key's first occurrence, and the inverse map."""
    uniq, inverse = torch.unique(keys, sorted=True, return_inverse=True)
    positions = torch.arange(keys.numel(), dtype=torch.int64)
    first = torch.full((uniq.numel(),), keys.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, positions, reduce="amin")
    return uniq, first, inverse


def plan_retrieval(row_keys: Tensor, video_keys: Tensor, text_keys: Tensor) -> RetrievalPlan:
    """Deduplicate rows by ``row_keys`` and build the galleries and positive pairs from ids only.

    Rows are in global order (rank by rank in a distributed run), so "first occurrence" is the same everywhere.

    Example:
        >>> plan = plan_retrieval(torch.tensor([0, 1, 2, 0]), torch.tensor([0, 1, 2, 0]), torch.tensor([7, 7, 5, 7]))
        >>> plan.kept_rows.tolist(), plan.text_keys.tolist(), plan.pair_video.tolist(), plan.pair_text.tolist()
        ([True, True, True, False], [5, 7], [0, 1, 2], [1, 1, 0])
    """
    n = row_keys.numel()
    kept = torch.zeros(n, dtype=torch.bool)
    if n:
        _, first_rows, _ = _first_occurrence(row_keys)
        kept[first_rows] = True
    kept_idx = kept.nonzero().squeeze(1)
    v_keys_rows = video_keys[kept_idx]
    t_keys_rows = text_keys[kept_idx]
    v_uniq, v_first, v_inv = _first_occurrence(v_keys_rows)
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


# --------------------------------------------------------------------------------------------------- kernels


@contextlib.contextmanager
def full_fp32_matmul() -> Iterator[None]:
    """Multiply float32 matrices in full precision inside the block (TF32 off), restoring the setting after.

    Example:
        >>> before = torch.get_float32_matmul_precision()
        >>> with full_fp32_matmul():
        ...     inside = torch.get_float32_matmul_precision()
        >>> inside, torch.get_float32_matmul_precision() == before
        ('highest', True)
    """
    try:
        previous = torch.get_float32_matmul_precision()
    except Exception:  # the newer per-backend API is in use; leave it alone
        previous = None
    if previous is not None and previous != "highest":
        torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        if previous is not None and previous != "highest":
            torch.set_float32_matmul_precision(previous)


def pair_scores(video: Tensor, text: Tensor, pair_video: Tensor, pair_text: Tensor, chunk: int | None = None) -> Tensor:
    """Scores of the positive pairs: float64 dot products of the float32 features in a fixed order, rounded to float32.

    The products of float32 values are exact in float64, and the sum halves each row repeatedly with elementwise adds,
    so the order depends only on the feature dim, never on the chunk, the device, the process or a BLAS kernel's
    choice: equal feature rows give bit-identical scores, which is what lets an exact copy of a positive tie with it
    (see the module docstring). Features are rounded to float32 first, as the blocks are. ``chunk`` is the number of
    pairs per chunk (``None``: what fills a 2 MiB float64 buffer).

    Example:
        >>> v, t = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, -1.0], [0.5, 0.5]])
        >>> pair_scores(v, t, torch.tensor([0, 0]), torch.tensor([0, 1]))
        tensor([1.0000, 1.5000])
    """
    n, dim = pair_video.numel(), video.shape[1]
    out = torch.empty(n, dtype=torch.float32, device=video.device)
    if n == 0:
        return out
    size = 1 << max(dim - 1, 0).bit_length()
    if chunk is None:
        chunk = max(64, _PAIR_CHUNK_BYTES // (8 * size))
    rows = min(chunk, n)
    # two float64 buffers reused for every chunk; the padding columns [dim, size) stay zero
    acc = torch.zeros(rows, size, dtype=torch.float64, device=video.device)
    other = torch.empty(rows, dim, dtype=torch.float64, device=video.device)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        pv = pair_video[start : start + m].to(video.device)
        pt = pair_text[start : start + m].to(text.device)
        a, b = acc[:m], other[:m]
        a[:, :dim].copy_(video.index_select(0, pv).float())
        b.copy_(text.index_select(0, pt).to(video.device).float())
        a[:, :dim].mul_(b)
        width = size
        while width > 1:
            width //= 2
            a[:, :width].add_(a[:, width : 2 * width])
        out[start : start + m] = a[:, 0]
    return out


def embedding_keys(features: Tensor) -> Tensor:
    """An int64 key per row, equal for rows with equal values (``-0.0`` equals ``0.0``); int64 on CPU.

    Read from up to 32 evenly spaced columns of the float32 values with integer arithmetic only, so the key is the
    same on every device and process. Different rows can share a key: treat equal keys as candidates and compare.

    Example:
        >>> x = torch.tensor([[1.0, -0.0], [1.0, 0.0], [2.0, 0.0]])
        >>> k = embedding_keys(x)
        >>> bool(k[0] == k[1]), bool(k[0] == k[2])
        (True, False)
    """
    n, dim = features.shape
    if dim == 0:
        return torch.zeros(n, dtype=torch.int64)
    m = min(dim, _KEY_COLUMNS)
    columns = torch.div(torch.arange(m) * (dim - 1), max(m - 1, 1), rounding_mode="floor").to(features.device)
    sample = features.index_select(1, columns).float() + 0.0  # + 0.0 turns -0.0 into 0.0
    bits = sample.view(torch.int32).to(torch.int64)
    return (bits * _KEY_MULTIPLIERS[:m].to(bits.device)).sum(1).cpu()


class _Groups(NamedTuple):
    """Rows grouped by exact equality: ``gid`` per row (numbered by first row), ``size`` and ``rep`` per group."""

    gid: Tensor
    size: Tensor
    rep: Tensor


def _exact_groups(features: Tensor, keys: Tensor) -> _Groups | None:
    """Group rows with exactly equal values (``None`` when all rows differ, the common case)."""
    n = keys.numel()
    _, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
    if counts.numel() == n:
        return None
    candidates = (counts[inverse] > 1).nonzero().squeeze(1)
    rows = features.index_select(0, candidates.to(features.device)).float() + 0.0
    _, sub = torch.unique(rows.view(torch.int32), dim=0, return_inverse=True)
    label = torch.arange(n, dtype=torch.int64) + n
    label[candidates] = sub.cpu()
    uniq, first, inv = _first_occurrence(label)
    if uniq.numel() == n:
        return None
    order = torch.argsort(first)
    rank_of = torch.empty_like(order)
    rank_of[order] = torch.arange(order.numel())
    gid = rank_of[inv]
    return _Groups(gid, torch.bincount(gid, minlength=uniq.numel()), first[order])


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


class _TieCells:
    """Cells whose true score equals a positive's exactly, and that score (see the module docstring).

    v2t: for a video and each text group holding one of its positives, every text of that group. t2v: for a text and
    each key of its positives' videos (over all processes), every local video with that key (a key shared by
    different embeddings only means those cells get their own exact pair score, which is harmless).
    """

    def __init__(
        self,
        video: Tensor,
        text: Tensor,
        pv: Tensor,
        pt: Tensor,
        scores: Tensor,
        positive_video_keys: tuple[Tensor, Tensor] | None,
    ) -> None:
        n_video, n_text = video.shape[0], text.shape[0]
        self.n_video, self.n_text = n_video, n_text
        empty = torch.empty(0, dtype=torch.int64)
        self.v2t = (empty, empty, torch.empty(0))
        self.t2v = (empty, empty, torch.empty(0))
        self.text_codes, self.video_codes = empty, empty
        text_groups = _exact_groups(text, embedding_keys(text)) if n_text else None
        if text_groups is not None and pv.numel():
            multi = text_groups.size[text_groups.gid[pt]] > 1
            q, g = pv[multi], text_groups.gid[pt[multi]]
            first = _first_occurrence(q * text_groups.size.numel() + g)[1]  # sorted by video, then group
            self.v2t = (q[first], g[first], scores[multi][first])
            in_multi = (text_groups.size[text_groups.gid] > 1).nonzero().squeeze(1)
            self.text_codes = torch.sort(text_groups.gid[in_multi] * n_text + in_multi).values
        if not n_video:
            return
        keys = None
        if positive_video_keys is None:  # one process: keys of the positives' videos shared by another local video
            keys = embedding_keys(video)
            _, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
            shared = counts[inverse[pv]] > 1
            positive_video_keys = (pt[shared], keys[pv[shared]])
        p_text, p_key = (t.to(torch.int64).cpu() for t in positive_video_keys)
        if p_text.numel() == 0:
            return
        if keys is None:
            keys = embedding_keys(video)
        groups = _exact_groups(video, keys)
        gid = groups.gid if groups is not None else torch.arange(n_video)
        rep = groups.rep if groups is not None else torch.arange(n_video)
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


def positive_thresholds(scores: Tensor, index: Tensor, size: int) -> Tensor:
    """Best positive score per query: ``max`` of ``scores`` grouped by ``index`` (``-inf`` where none).

    Example:
        >>> positive_thresholds(torch.tensor([0.5, 2.0, -1.0]), torch.tensor([0, 0, 2]), 3).tolist()
        [2.0, -inf, -1.0]
    """
    out = torch.full((size,), float("-inf"), dtype=torch.float32, device=scores.device)
    return out.scatter_reduce_(0, index.to(scores.device), scores.float(), reduce="amax")


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
    """Block sizes whose working set fits ``memory_budget_bytes``; explicit sizes are kept as given.

    The working set is the float32 texts on the device, one float32 video block, the score block and the comparison
    buffer (and, for the group-max gallery, one float per video and group).

    Example:
        >>> choose_block_sizes(117_000, 23_000, 512)
        (2048, 4096)
        >>> choose_block_sizes(117_000, 23_000, 512, memory_budget_bytes=80 * 2**20)
        (1024, 4096)
    """
    device = torch.device(device)
    cap_v, cap_t = _CUDA_MAX_BLOCK if device.type == "cuda" else _CPU_MAX_BLOCK
    bt = text_block_size or max(1, min(cap_t, n_text))
    if video_block_size is not None:
        return video_block_size, bt
    fixed = n_text * dim * 4
    per_video_row = (2 * bt + dim + n_groups) * 4
    bv = (memory_budget_bytes - fixed) // per_video_row
    bv = int(max(1, min(cap_v, max(n_video, 1), bv)))
    if bv >= 64:
        bv = bv // 64 * 64
    return bv, bt


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
    processes). Positives and the exact duplicates of positives take the positive's own score (see the module
    docstring), so ``ties`` alone decides a tie.

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

    Example:
        >>> v = torch.tensor([[1.0, 0.0], [0.0, 1.0]]); t = torch.tensor([[1.0, 0.0], [0.6, 0.8]])
        >>> pv, pt = torch.tensor([0, 1]), torch.tensor([0, 1])
        >>> s = pair_scores(v, t, pv, pt)
        >>> count_ranks(v, t, pv, pt, positive_thresholds(s, pv, 2), positive_thresholds(s, pt, 2))
        (tensor([0, 0]), tensor([0, 0]))
    """
    check_choice("ties", ties, TIES)
    device = torch.device(device) if device is not None else video.device
    n_video, dim = video.shape
    n_text = text.shape[0]
    grouped = video_groups is not None
    if grouped and group_pairs is None:
        raise ValueError("`video_groups` needs `group_pairs` (the group-max v2t gallery).")
    n_groups = group_pairs[2] if grouped and group_pairs is not None else 0
    bv, bt = choose_block_sizes(
        n_video, n_text, dim, device, memory_budget_bytes, video_block_size, text_block_size, n_groups
    )
    check_positive_int("video_block_size", bv)
    check_positive_int("text_block_size", bt)
    v_counts = torch.zeros(n_video, dtype=torch.int64, device=device)
    t_counts = torch.zeros(n_text, dtype=torch.int64, device=device)
    if n_video == 0 or n_text == 0:
        return v_counts.cpu(), t_counts.cpu()
    compare = torch.gt if ties == "optimistic" else torch.ge
    n_vb, n_tb = math.ceil(n_video / bv), math.ceil(n_text / bt)

    pv, pt = pair_video.to(torch.int64).cpu(), pair_text.to(torch.int64).cpu()
    with torch.no_grad():
        ps = (positive_scores if positive_scores is not None else pair_scores(video, text, pv, pt)).float().cpu()
        tie_cells = _TieCells(video, text, pv, pt, ps, positive_video_keys)
    # bucket the positive pairs by block: each block writes its positives' own scores with one scatter
    key = (pv // bv) * n_tb + pt // bt
    order = torch.argsort(key, stable=True)
    offsets = [0, *torch.bincount(key, minlength=n_vb * n_tb).cumsum(0).tolist()]
    pv_s, pt_s, ps_s = pv[order].to(device), pt[order].to(device), ps[order].to(device)
    if grouped and group_pairs is not None:
        g_text, g_group, _ = group_pairs
        g_text, g_group = g_text.to(torch.int64).cpu(), g_group.to(torch.int64).cpu()
        g_order = torch.argsort(g_text // bt, stable=True)
        g_offsets = [0, *torch.bincount(g_text // bt, minlength=n_tb).cumsum(0).tolist()]
        g_text_s, g_group_s = g_text[g_order].to(device), g_group[g_order].to(device)
        own_group = video_groups.to(device=device, dtype=torch.int64)

    v_thr = video_threshold.to(device=device, dtype=torch.float32)
    t_thr = text_threshold.to(device=device, dtype=torch.float32)
    text32 = text.to(device=device, dtype=torch.float32).contiguous()
    score_buf = torch.empty(bv * min(bt, n_text), dtype=torch.float32, device=device)
    # the comparisons run over a few rows of the score block at a time, so that the rows and their flags stay in
    # cache between the two comparisons and the two sums (40 % less time than whole-block passes on CPU)
    rows = bv if device.type == "cuda" else min(bv, _CMP_ROWS)
    cmp_buf = torch.empty(rows * min(bt, n_text), dtype=torch.float32, device=device)
    hits = torch.empty(bv, n_groups, dtype=torch.float32, device=device) if grouped else None

    with full_fp32_matmul(), torch.no_grad():
        for i in range(n_vb):
            v0, v1 = i * bv, min(n_video, (i + 1) * bv)
            nv = v1 - v0
            vb = video[v0:v1].to(device=device, dtype=torch.float32, non_blocking=True)
            thr_col = v_thr[v0:v1].unsqueeze(1)
            v_acc = torch.zeros(nv, dtype=torch.int64, device=device)
            if hits is not None:
                hits[:nv].zero_()
            for j in range(n_tb):
                t0, t1 = j * bt, min(n_text, (j + 1) * bt)
                nt = t1 - t0
                scores = score_buf[: nv * nt].view(nv, nt)
                torch.mm(vb, text32[t0:t1].T, out=scores)
                a, b = offsets[i * n_tb + j], offsets[i * n_tb + j + 1]
                if b > a:
                    scores[pv_s[a:b] - v0, pt_s[a:b] - t0] = ps_s[a:b]
                for cell_rows, cell_cols, values in tie_cells.cells(v0, v1, t0, t1):
                    scores[(cell_rows - v0).to(device), (cell_cols - t0).to(device)] = values.to(device)
                t_thr_row = t_thr[t0:t1].unsqueeze(0)
                t_acc = torch.zeros(nt, dtype=torch.float32, device=device)  # exact: at most `bv` per column
                ga, gb = (g_offsets[j], g_offsets[j + 1]) if hits is not None else (0, 0)
                for r0 in range(0, nv, rows):
                    r1 = min(nv, r0 + rows)
                    part = scores[r0:r1]
                    flags = cmp_buf[: (r1 - r0) * nt].view(r1 - r0, nt)
                    compare(part, thr_col[r0:r1], out=flags)
                    if hits is None:
                        v_acc[r0:r1] += flags.sum(1).to(torch.int64)
                    elif gb > ga:
                        cols = flags.index_select(1, g_text_s[ga:gb] - t0)
                        index = g_group_s[ga:gb].unsqueeze(0).expand(r1 - r0, -1)
                        hits[r0:r1].scatter_reduce_(1, index, cols, "amax")
                    compare(part, t_thr_row, out=flags)
                    t_acc += flags.sum(0)
                t_counts[t0:t1] += t_acc.to(torch.int64)
            if hits is not None:
                hit = hits[:nv]
                v_acc = (hit.sum(1) - hit[torch.arange(nv, device=device), own_group[v0:v1]]).to(torch.int64)
            v_counts[v0:v1] = v_acc
        # the positives were counted with their own scores above: take them out again
        pv_d, pt_d, ps_d = pv.to(device), pt.to(device), ps.to(device)
        if hits is None:
            v_counts.index_add_(0, pv_d, compare(ps_d, v_thr[pv_d]).to(torch.int64), alpha=-1)
        t_counts.index_add_(0, pt_d, compare(ps_d, t_thr[pt_d]).to(torch.int64), alpha=-1)
    return v_counts.cpu(), t_counts.cpu()


# --------------------------------------------------------------------------------------------------- summaries


def _top_k_tuple(top_k: Any) -> tuple[int, ...]:
    """``top_k`` as a tuple of distinct positive ints (one int is accepted too); ``ValueError`` naming it otherwise."""
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

    Example:
        >>> hist = torch.bincount(torch.tensor([0, 0, 3, 9]), minlength=10)
        >>> {k: round(v.item(), 3) for k, v in summarize_rank_histogram(hist, (1, 5), prefix="v2t/").items()}
        {'v2t/R@1': 0.5, 'v2t/R@5': 0.75, 'v2t/MedR': 2.0, 'v2t/MeanR': 4.0}
    """
    check_choice("median", median, MEDIANS)
    top_k = _top_k_tuple(top_k)
    hist = histogram.detach().to(device="cpu", dtype=torch.int64)
    n = int(hist.sum().item())
    if n == 0:
        raise ValueError("Cannot summarize ranks of zero queries: call `update` with at least one row first.")
    cumulative = hist.cumsum(0)
    out: dict[str, Tensor] = {}
    for k in top_k:
        hits = int(cumulative[min(k, hist.numel()) - 1].item()) if k > 0 else 0
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

    Example:
        >>> summarize_ranks(torch.tensor([0, 1, 2, 3]), top_k=(1,), median="mean")
        {'R@1': tensor(0.2500), 'MedR': tensor(2.5000), 'MeanR': tensor(2.5000)}
    """
    ranks = ranks.detach().to(device="cpu", dtype=torch.int64)
    size = int(ranks.max().item()) + 1 if ranks.numel() else 1
    return summarize_rank_histogram(torch.bincount(ranks, minlength=size), top_k, median, prefix)


# --------------------------------------------------------------------------------------------------- front door


_float64_warned = False


def _warn_if_float64(*features: Tensor) -> None:
    """Say once per process that float64 features are ranked in float32 (the blocks are float32 products)."""
    global _float64_warned
    if _float64_warned or not any(x.dtype == torch.float64 for x in features):
        return
    _float64_warned = True
    warnings.warn(
        "Retrieval features of dtype float64 are ranked in float32: every score is computed from the features"
        " rounded to float32, as if `.float()` had been called on them (ties between exact copies stay exact). Pass"
        " float32 features to silence this.",
        UserWarning,
        stacklevel=3,
    )


def _check_features(video_features: Tensor, text_features: Tensor) -> None:
    allowed = ", ".join(str(d) for d in FEATURE_DTYPES)
    for name, x in (("video_features", video_features), ("text_features", text_features)):
        if not isinstance(x, Tensor):
            raise ValueError(
                f"`{name}` must be a 2-D float tensor (rows x dim), got {type(x).__name__}. Convert it with"
                " `torch.as_tensor(...)`."
            )
        if x.dim() != 2:
            raise ValueError(f"`{name}` must be a 2-D float tensor (rows x dim), got shape {tuple(x.shape)}.")
        if x.dtype not in FEATURE_DTYPES:
            raise ValueError(
                f"`{name}` has dtype {x.dtype}, but features must be one of {allowed}. Pass the embeddings, not"
                " ids or masks, or cast them with `.float()`."
            )
    if video_features.shape[0] != text_features.shape[0]:
        raise ValueError(
            f"`video_features` and `text_features` must have one row per sample each, got {video_features.shape[0]}"
            f" and {text_features.shape[0]} rows. Pass the features of the same samples."
        )
    if video_features.shape[1] != text_features.shape[1]:
        raise ValueError(
            f"`video_features` and `text_features` must have the same feature dim, got {video_features.shape[1]}"
            f" and {text_features.shape[1]}. Project both modalities into the shared embedding space first."
        )
    for name, x in (("video_features", video_features), ("text_features", text_features)):
        if x.numel() and not bool(torch.isfinite(x).all()):
            raise ValueError(f"`{name}` contains NaN or inf values; retrieval ranks are undefined for them.")
    _warn_if_float64(video_features, text_features)


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
        text_ids: caption id of each row (ints or strings); rows with the same id share one gallery text. Needed by
            ``protocol="dedup"``; ignored by ``"paired"``.
        video_ids: video id of each row; rows with the same id are one video whose positives are all its captions.
            ``None``: each (deduplicated) row is its own video.
        sample_ids: sample id of each row; repeated samples (padding of a distributed sampler) count once.
        protocol: ``"dedup"`` or ``"paired"`` (row i <-> row i, no deduplication).
        v2t_gallery: ``"texts"`` (best of captions) or ``"groups"`` (one gallery item per video, group max).
        ties: ``"optimistic"`` or ``"pessimistic"``; it alone decides a tie, also between a positive and an exact copy
            of it under another id (see the module docstring).
        video_block_size: videos per block (``None``: from the memory budget).
        text_block_size: texts per block (``None``: from the memory budget).
        memory_budget_bytes: working-set budget for the blocks.
        device: where blocks are computed (default: where ``video_features`` are).

    Example:
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
    _check_features(video_features, text_features)
    n = video_features.shape[0]
    if n == 0:
        raise ValueError("No rows to rank: `video_features` is empty. Pass at least one sample.")
    row_keys = as_id_tensor(sample_ids, "sample_ids", n) if sample_ids is not None else torch.arange(n)
    v_keys = as_id_tensor(video_ids, "video_ids", n) if video_ids is not None else row_keys
    if protocol == "paired":
        t_keys = row_keys
    elif text_ids is None:
        raise ValueError("`text_ids` is required by protocol='dedup'; pass caption ids or use protocol='paired'.")
    else:
        t_keys = as_id_tensor(text_ids, "text_ids", n)
    plan = plan_retrieval(row_keys, v_keys, t_keys)
    kept_idx = plan.kept_rows.nonzero().squeeze(1)
    # one text feature per text key: its first kept row
    _, t_first, _ = _first_occurrence(t_keys[kept_idx])
    text_rows = kept_idx[t_first].to(text_features.device)
    video = video_features.detach().index_select(0, plan.video_rows.to(video_features.device))
    text = text_features.detach().index_select(0, text_rows)
    device = torch.device(device) if device is not None else video.device
    v2t, t2v = _ranks_single(
        plan, video, text, v2t_gallery, ties, video_block_size, text_block_size, memory_budget_bytes, device
    )
    n_video = plan.video_keys.numel()
    v2t_size = n_video if v2t_gallery == "groups" else plan.text_keys.numel()
    return RetrievalRanks(v2t, t2v, plan.video_keys, plan.text_keys, v2t_size, n_video)


def _ranks_single(
    plan: RetrievalPlan,
    video: Tensor,
    text: Tensor,
    v2t_gallery: str,
    ties: Ties,
    video_block_size: int | None,
    text_block_size: int | None,
    memory_budget_bytes: int,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    n_video, n_text = plan.video_keys.numel(), plan.text_keys.numel()
    with torch.no_grad():
        scores = pair_scores(video, text, plan.pair_video, plan.pair_text).cpu()
    v_thr = positive_thresholds(scores, plan.pair_video, n_video)
    t_thr = positive_thresholds(scores, plan.pair_text, n_text)
    grouped = v2t_gallery == "groups"
    return count_ranks(
        video,
        text,
        plan.pair_video,
        plan.pair_text,
        v_thr,
        t_thr,
        ties=ties,
        video_groups=torch.arange(n_video) if grouped else None,
        group_pairs=(plan.pair_text, plan.pair_video, n_video) if grouped else None,
        positive_scores=scores,
        video_block_size=video_block_size,
        text_block_size=text_block_size,
        memory_budget_bytes=memory_budget_bytes,
        device=device,
    )


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

    Example:
        >>> v = torch.eye(3)
        >>> out = streaming_retrieval(v, v.clone(), text_ids=[0, 1, 2], top_k=(1,))
        >>> {k: v.item() for k, v in out.items()}
        {'v2t/R@1': 1.0, 'v2t/MedR': 1.0, 'v2t/MeanR': 1.0, 't2v/R@1': 1.0, 't2v/MedR': 1.0, 't2v/MeanR': 1.0}
    """
    top_k = _top_k_tuple(top_k)
    check_choice("median", median, MEDIANS)
    ranks = retrieval_ranks(video_features, text_features, text_ids, **kwargs)
    out = summarize_ranks(ranks.v2t, top_k, median, prefix="v2t/")
    out.update(summarize_ranks(ranks.t2v, top_k, median, prefix="t2v/"))
    return out
