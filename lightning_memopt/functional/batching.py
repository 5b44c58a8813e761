"""Batches by a memory budget: samples grouped by length into batches whose padded size stays within a budget, and each
rank's share of them with equal counts. Trainer-free; :class:`~lightning_memopt.data.TokenBudgetBatchSampler` is the
sampler built on it.

A sample's *lengths* are a tuple of ints, one per axis that grows with the input (source and target tokens, frames and
tokens, peaks). A batch is padded to the longest sample on every axis, so what it costs is set by its number of samples
and those longest lengths. The budget says how many samples a batch of given padded lengths may hold
(:data:`LargestBatch`): from a token count per axis (:func:`token_budget`) or from a table of length buckets
(:func:`table_budget`, e.g. one planned by the estimator).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "LargestBatch",
    "LengthSample",
    "as_lengths",
    "check_every_sample_fits",
    "group_batches",
    "longest_first",
    "padded_tokens",
    "rank_share",
    "sort_by_length",
    "sort_in_groups",
    "table_budget",
    "token_budget",
]

Lengths = tuple[int, ...]
#: The largest number of samples a batch padded to the given lengths may hold (0: not even one).
LargestBatch = Callable[[Lengths], int]
LengthsLike = int | Sequence[int]


def as_lengths(lengths: Sequence[LengthsLike], name: str = "lengths") -> list[Lengths]:
    """Every sample's lengths as a tuple of positive ints, all of one size.

    Raises:
        ValueError: naming the argument, the first bad sample and what is allowed.

    Examples:
        >>> as_lengths([3, 5]), as_lengths([(3, 1), (5, 2)])
        ([(3,), (5,)], [(3, 1), (5, 2)])
    """
    if len(lengths) == 0:
        raise ValueError(f"`{name}` is empty: give one length (an int, or a tuple of ints) per sample of the dataset.")
    out = [(value,) if isinstance(value, int) else tuple(value) for value in lengths]
    axes = len(out[0])
    for i, sample in enumerate(out):
        if len(sample) != axes or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in sample):
            raise ValueError(
                f"`{name}[{i}]` is {lengths[i]!r}: every sample needs {axes} positive int length(s), like `{name}[0]`"
                f" ({lengths[0]!r}). Count a sample's tokens (frames, peaks) per axis; give 1 for an empty one."
            )
    return out


def token_budget(max_tokens: Sequence[int]) -> LargestBatch:
    """At most ``max_tokens[k]`` padded tokens on axis ``k`` (batch size x the longest length on that axis).

    Examples:
        >>> largest = token_budget((4096, 768))
        >>> largest((512, 36)), largest((30, 94))  # the target axis bounds the second: 8 x 94 <= 768
        (8, 8)
    """
    return lambda lengths: min(tokens // length for tokens, length in zip(max_tokens, lengths))


def table_budget(table: Mapping[LengthsLike, int]) -> LargestBatch:
    """The largest batch of the table's entries whose lengths cover the batch's on every axis (each entry: lengths
    up to which that many samples fit); 0 when no entry covers them.

    Examples:
        >>> largest = table_budget({64: 263, 128: 120, 512: 28})
        >>> largest((100,)), largest((64,)), largest((513,))
        (120, 263, 0)
    """
    entries = sorted(((as_lengths([key], "table key")[0], int(size)) for key, size in table.items()), reverse=True)
    if len(entries) > 0 and len(entries[0][0]) == 1:  # one axis: a sorted search
        keys = [key[0] for key, _ in reversed(entries)]
        sizes = [size for _, size in reversed(entries)]
        best = [max(sizes[i:]) for i in range(len(sizes))]

        def one_axis(lengths: Lengths) -> int:
            at = bisect.bisect_left(keys, lengths[0])
            return best[at] if at < len(keys) else 0

        return one_axis
    return lambda lengths: max(
        (size for key, size in entries if all(k >= n for k, n in zip(key, lengths))),
        default=0,
    )


def check_every_sample_fits(lengths: Sequence[Lengths], largest: LargestBatch, what: str) -> None:
    """Raise a ``ValueError`` naming the first sample that no batch of the budget ``what`` holds, even alone.

    Examples:
        >>> check_every_sample_fits([(3,), (9,)], token_budget((8,)), "max_tokens=8")
        Traceback (most recent call last):
        ...
        ValueError: Sample 1 has lengths (9,), which no batch of max_tokens=8 holds even alone (the longest ...
    """
    for i, sample in enumerate(lengths):
        if largest(sample) < 1:
            raise ValueError(
                f"Sample {i} has lengths {sample}, which no batch of {what} holds even alone (the longest lengths that"
                " fit are below it). Raise the budget or add a longer bucket to the table, or truncate or drop the"
                " samples that long (e.g. filter the dataset by its lengths first)."
            )


def sort_by_length(lengths: Sequence[Lengths], seed: int | None) -> list[int]:
    """Sample indices by increasing lengths; samples of equal lengths in an order drawn from ``seed`` (``None``: in
    index order).

    Examples:
        >>> sort_by_length([(5,), (3,), (5,), (1,)], None)
        [3, 1, 0, 2]
    """
    order = list(range(len(lengths)))
    if seed is not None:
        random.Random(seed).shuffle(order)
    return sorted(order, key=lambda i: lengths[i])  # stable: ties keep the drawn order


def sort_in_groups(lengths: Sequence[Lengths], order: Sequence[int], group: int) -> list[int]:
    """``order`` (by the first axis) cut into runs of ``group`` samples, each run sorted by the other axes: batches
    then pad little on every axis, where a sort by the first axis alone leaves the others in random order.

    Examples:
        >>> sort_in_groups([(1, 9), (2, 1), (3, 5), (4, 2)], [0, 1, 2, 3], 2)
        [1, 0, 3, 2]
    """
    out: list[int] = []
    for start in range(0, len(order), group):
        out += sorted(order[start : start + group], key=lambda i: (lengths[i][1:], lengths[i][0]))
    return out


def group_batches(lengths: Sequence[Lengths], order: Sequence[int], largest: LargestBatch) -> list[list[int]]:
    """The samples in ``order`` cut into batches greedily: a sample joins the batch when the batch, padded to its new
    longest lengths, still holds one more sample; otherwise it starts the next batch.

    Examples:
        >>> lengths = [(2,), (2,), (3,), (8,)]
        >>> group_batches(lengths, [0, 1, 2, 3], token_budget((8,)))
        [[0, 1], [2], [3]]
    """
    batches: list[list[int]] = []
    current: list[int] = []
    longest: Lengths = ()
    for i in order:
        grown = lengths[i]
        if current:
            grown = tuple(map(max, longest, grown))
        if current and len(current) + 1 > largest(grown):
            batches.append(current)
            current, grown = [], lengths[i]
        current.append(i)
        longest = grown
    if current:
        batches.append(current)
    return batches


def padded_tokens(batch: Sequence[int], lengths: Sequence[Lengths]) -> int:
    """What ``batch`` costs padded: its samples x the sum of its longest lengths over the axes.

    Examples:
        >>> padded_tokens([0, 1], [(3, 1), (5, 2)])
        14
    """
    return len(batch) * sum(max(lengths[i][k] for i in batch) for k in range(len(lengths[batch[0]])))


def longest_first(batches: list[list[int]], lengths: Sequence[Lengths], count: int) -> list[list[int]]:
    """``batches`` with the ``count`` costliest (:func:`padded_tokens`) moved to the front, costliest first, the others
    in their order: with one per rank, every rank's first batch is among the largest, so a budget too large for the
    device fails at the first step.

    Examples:
        >>> longest_first([[0], [1, 2], [3]], [(1,), (4,), (4,), (2,)], 1)
        [[1, 2], [0], [3]]
    """
    costs = [padded_tokens(b, lengths) for b in batches]
    first = sorted(range(len(batches)), key=lambda k: -costs[k])[:count]
    chosen = set(first)
    return [batches[k] for k in first] + [b for k, b in enumerate(batches) if k not in chosen]


def rank_share(count: int, rank: int, world: int, drop_last: bool) -> list[int]:
    """The batch positions rank ``rank`` of ``world`` takes from a list of ``count``: every ``world``-th, the list first
    cut to a multiple of ``world`` (``drop_last``) or filled up from its start, so every rank gets as many batches.

    Examples:
        >>> [rank_share(5, r, 2, drop_last=False) for r in (0, 1)]
        [[0, 2, 4], [1, 3, 0]]
        >>> [rank_share(5, r, 2, drop_last=True) for r in (0, 1)]
        [[0, 2], [1, 3]]
    """
    total = (count // world) * world if drop_last else -(-count // world) * world
    return [k % count for k in range(rank, total, world)]


class LengthSample:
    """The samples' lengths of a loader's first batches (what their padding masks say), for one finding: every batch
    padded beyond the length 99 % of the samples fit in, which a cap on ``max_length`` would cut.

    Examples:
        >>> sample = LengthSample(batches=2)
        >>> for _ in range(2):
        ...     sample.add([{"path": "m", "padded_to": 512, "lengths": [30, 40, 60, 80]}])
        >>> sample.done, sample.finding("train")[:59]
        (True, 'train: each of the first 2 batches is padded to 512 or more')
    """

    def __init__(self, batches: int = 16, without_masks: int = 3) -> None:
        self.batches, self.without_masks = batches, without_masks
        self.lengths: list[int] = []
        self.padded_to: list[int] = []
        self.path: str | None = None
        self.seen = self.unmasked = 0

    @property
    def done(self) -> bool:
        """Enough batches seen (or a few without masks: nothing to learn)."""
        return self.seen >= self.batches or self.unmasked >= self.without_masks

    def add(self, padding: list[dict[str, Any]]) -> None:
        """One batch's ``padding`` (see :func:`~lightning_memopt.functional.oom.batch.batch_padding`); its first
        mask counts."""
        if not padding:
            self.unmasked += 1
            return
        first = padding[0]
        self.seen += 1
        self.path = self.path or str(first.get("path"))
        self.padded_to.append(int(first.get("padded_to") or 0))
        self.lengths += [int(n) for n in first.get("lengths") or []]

    def p99(self) -> int | None:
        """The length 99 % of the samples seen fit in (``None``: none seen)."""
        if not self.lengths:
            return None
        ordered = sorted(self.lengths)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]

    def finding(self, name: str) -> str | None:
        """The finding, or ``None`` when some batch is padded within the length 99 % of the samples fit in."""
        p99 = self.p99()
        if p99 is None or not self.padded_to:
            return None
        shortest_pad = min(self.padded_to)
        if shortest_pad < 1.25 * p99:
            return None
        batches, share = len(self.padded_to), 1 - p99 / shortest_pad
        return (
            f"{name}: each of the first {batches} batches is padded to {shortest_pad} or more (`{self.path}`), while"
            f" 99 % of their {len(self.lengths)} samples are at most {p99} long: {100 * share:.0f} % of every sample's"
            f" length is padding. Cap `max_length` at {p99} (the 1 % longer are truncated), or pad each batch to its"
            " longest sample and batch samples of similar length (docs/batching.md)."
        )
