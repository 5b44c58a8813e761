"""Across ranks and nodes: which log holds each rank's records, and how the ranks' peaks compare.

A job on several machines writes one ``memory_rank{r}.jsonl`` per global rank, each on its own node (with the
node's rank and host name in every record, see ``docs/memory-log.md``). :class:`RankSources` checks, while the logs
of all nodes stream by, that no global rank of a run was written by two processes at once (two jobs resumed from
one checkpoint share its run id; a log passed twice, as a copy, repeats its records); :func:`compare_ranks` then
finds, per run and phase, the rank that peaks, the lowest one, their ratio, and the rank that peaks on each node.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lightning_memopt.analysis.summary import PhaseSummary

__all__ = [
    "IMBALANCE_RATIO",
    "RankComparison",
    "RankPeak",
    "RankSources",
    "compare_ranks",
    "node_key",
    "rank_ranges",
    "rank_where",
]


def node_key(node_rank: int | None, host: str | None) -> tuple[int, str]:
    """A node, to group and sort ranks by: its node rank, then its host (-1 and "" for what a log does not say).

    Examples:
        >>> sorted([node_key(1, "b"), node_key(None, None), node_key(0, "a")])
        [(-1, ''), (0, 'a'), (1, 'b')]
    """
    return (-1 if node_rank is None else node_rank, host or "")


def rank_where(rank: int, node_rank: int | None, host: str | None) -> str:
    """``rank 3 (node 1, gpu-b)``, or ``rank 3`` when the log does not say where it ran.

    Examples:
        >>> rank_where(3, 1, "gpu-b"), rank_where(3, None, None)
        ('rank 3 (node 1, gpu-b)', 'rank 3')
    """
    node = [] if node_rank is None else [f"node {node_rank}"]
    node += [] if host is None else [host]
    if not node:
        return f"rank {rank}"
    return f"rank {rank} ({', '.join(node)})"


#: A phase is called imbalanced when its highest rank's peak is at least this many times its lowest rank's.
IMBALANCE_RATIO = 1.1
#: Clashes named in the error; the rest are counted.
_LISTED_CLASHES = 3


@dataclass(frozen=True)
class RankPeak:
    """One rank's peak in a phase, with where it ran (``node_rank`` and ``host`` are ``None`` in older logs)."""

    rank: int
    node_rank: int | None
    host: str | None
    bytes: int

    def where(self) -> str:
        """:func:`rank_where` of this rank."""
        return rank_where(self.rank, self.node_rank, self.host)


@dataclass(frozen=True)
class RankComparison:
    """How the ranks of one run's phase compare.

    ``field`` is the figure compared: ``peak_allocated_bytes``, or ``peak_host_rss_bytes`` where a rank's device gives
    no figures (CPU). ``highest`` is the rank that peaks (the lowest rank of a tie), ``lowest`` the rank with the
    lowest peak; ``ratio`` is highest over lowest (``None`` when the lowest is 0) and ``imbalanced`` whether it is at
    least :data:`IMBALANCE_RATIO`. ``node_peaks`` holds the rank that peaks on each node, by node, when the ranks ran
    on more than one node (empty otherwise).
    """

    run_id: str | None
    phase: str
    field: str
    num_ranks: int
    highest: RankPeak
    lowest: RankPeak
    ratio: float | None
    imbalanced: bool
    node_peaks: tuple[RankPeak, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _peak(s: PhaseSummary, field: str) -> RankPeak:
    value = getattr(s, field)
    return RankPeak(s.rank, s.node_rank, s.host, int(value))


def _compared_field(rows: Sequence[PhaseSummary]) -> str | None:
    for field in ("peak_allocated_bytes", "peak_host_rss_bytes"):
        if all(getattr(s, field) is not None for s in rows):
            return field
    return None


def _node_peaks(peaks: Sequence[RankPeak]) -> tuple[RankPeak, ...]:
    """The rank that peaks on each node (by node rank, then host), when the ranks ran on more than one node."""
    best: dict[tuple[int, str], RankPeak] = {}
    for p in peaks:
        if p.node_rank is None and p.host is None:
            return ()  # a log that does not say where its rank ran: no per-node view
        key = node_key(p.node_rank, p.host)
        if key not in best or p.bytes > best[key].bytes:
            best[key] = p
    if len(best) <= 1:
        return ()
    return tuple(best[k] for k in sorted(best))


def compare_ranks(summaries: Sequence[PhaseSummary]) -> list[RankComparison]:
    """Per run and phase with at least two ranks: the rank that peaks, the lowest one and the peak per node.

    Compared: the peak allocated bytes where every rank of the phase has them, else the peak host RSS (CPU runs).

    Examples:
        >>> rows = [PhaseSummary(rank=r, phase="train", device="cpu", num_readings=1, peak_allocated_bytes=None,
        ...                      peak_reserved_bytes=None, mean_allocated_bytes=None, mean_reserved_bytes=None,
        ...                      peak_host_rss_bytes=100 + 30 * r, mean_host_rss_bytes=None, device_total_bytes=None,
        ...                      growth_field=None, growth_bytes_per_1k_steps=None, warnings=0, peak_global_step=None,
        ...                      peak_epoch=None, peak_seconds=None, node_rank=r // 2, host=f"gpu-{r // 2}")
        ...         for r in range(4)]
        >>> c = compare_ranks(rows)[0]
        >>> c.field, c.highest.where(), c.lowest.where(), round(c.ratio, 2), c.imbalanced
        ('peak_host_rss_bytes', 'rank 3 (node 1, gpu-1)', 'rank 0 (node 0, gpu-0)', 1.9, True)
        >>> [p.rank for p in c.node_peaks]
        [1, 3]
    """
    groups: dict[tuple[str | None, str], list[PhaseSummary]] = {}
    for s in summaries:
        groups.setdefault((s.run_id, s.phase), []).append(s)
    found = []
    for (run, phase), rows in groups.items():
        field = _compared_field(rows)
        if len(rows) < 2 or field is None:
            continue
        peaks = sorted((_peak(s, field) for s in rows), key=lambda p: p.rank)
        highest = max(peaks, key=lambda p: p.bytes)  # max and min keep the first of a tie: the lowest rank
        lowest = min(peaks, key=lambda p: p.bytes)
        ratio = highest.bytes / lowest.bytes if lowest.bytes > 0 else None
        imbalanced = highest.bytes > 0 if ratio is None else ratio >= IMBALANCE_RATIO
        found.append(
            RankComparison(run, phase, field, len(peaks), highest, lowest, ratio, imbalanced, _node_peaks(peaks))
        )
    return found


def rank_ranges(ranks: Sequence[int]) -> str:
    """Ranks as runs of consecutive numbers: ``0-3, 8, 10-11``.

    Examples:
        >>> rank_ranges([3, 0, 1, 2, 8, 10, 11])
        '0-3, 8, 10-11'
    """
    ordered = sorted(set(ranks))
    parts: list[str] = []
    start = 0
    for i, r in enumerate(ordered):
        if i + 1 == len(ordered) or ordered[i + 1] != r + 1:  # the end of a run of consecutive ranks
            first = ordered[start]
            parts.append(str(r) if first == r else f"{first}-{r}")
            start = i + 1
    return ", ".join(parts)


@dataclass
class _Span:
    """The time span of one source's records of one rank."""

    first: float
    last: float


#: Where records of a rank come from: (file, host, node rank).
_Source = tuple[str, str | None, int | None]


class RankSources:
    """Which log (and host) holds each rank's records of each run, and over which time.

    One process writes a rank's records; a run resumed from a checkpoint keeps its run id and may write its rank's
    later records into another directory, on another machine, but later. So records of one run's rank that come
    from two files, or from two hosts, over the same time are a clash: two jobs that share a run id (started from
    one checkpoint) or one log passed twice (a copy). :meth:`clashes` says which.

    Examples:
        >>> sources = RankSources()
        >>> rank2 = {"rank": 2, "run_id": "ab", "host": "gpu-b", "node_rank": 1}
        >>> for t in (1.0, 5.0):
        ...     sources.add({**rank2, "time": t}, "n1/memory_rank2.jsonl")
        >>> sources.add({**rank2, "time": 9.0, "host": "gpu-c"}, "n2/memory_rank2.jsonl")
        >>> sources.clashes()  # a run resumed on another machine: later, not at the same time
        []
        >>> sources.add({**rank2, "time": 3.0}, "copy.jsonl")
        >>> len(sources.clashes())
        1
    """

    def __init__(self) -> None:
        self._spans: dict[tuple[str | None, int], dict[_Source, _Span]] = {}

    def add(self, record: Mapping[str, Any], source: str) -> None:
        """Take one checked record read from ``source`` (a file's path)."""
        t = float(record["time"])
        spans = self._spans.setdefault((record.get("run_id"), record["rank"]), {})
        key = (source, record.get("host"), record.get("node_rank"))
        span = spans.get(key)
        if span is None:
            spans[key] = _Span(t, t)
        elif t < span.first:
            span.first = t
        elif t > span.last:
            span.last = t

    def clashes(self) -> list[str]:
        """One line per rank of a run whose records come from two sources over the same time (the first pair)."""
        found = []
        for (run, rank), spans in self._spans.items():
            pair = _overlapping(spans)
            if pair is not None:
                where = " and ".join(_describe(source) for source in pair)
                run_text = f"run {run}" if run is not None else "the records without a run_id"
                found.append(f"rank {rank} of {run_text} is in {where} over the same time")
        return found

    def error(self) -> str | None:
        """The error for the clashes (``None`` without any): each named, with what causes them and the fix."""
        clashes = self.clashes()
        if not clashes:
            return None
        listed = "; ".join(clashes[:_LISTED_CLASHES])
        more = f"; and {len(clashes) - _LISTED_CLASHES} more" if len(clashes) > _LISTED_CLASHES else ""
        return (
            f"{listed}{more}. One process writes a rank's records: these are two jobs that share a run id (resumed"
            " from one checkpoint) or one log passed twice (a copy); analyse them separately"
        )


def _overlapping(spans: Mapping[_Source, _Span]) -> tuple[_Source, _Source] | None:
    """The first two sources whose spans overlap (sorted by start: each needs comparing only with the latest end)."""
    ordered = sorted(spans.items(), key=lambda item: item[1].first)
    reach: tuple[_Source, _Span] | None = None
    for source, span in ordered:
        if reach is not None and span.first <= reach[1].last:
            return reach[0], source
        if reach is None or span.last > reach[1].last:
            reach = (source, span)
    return None


def _describe(source: _Source) -> str:
    path, host, node_rank = source
    where = [] if host is None else [f"host {host}"]
    where += [] if node_rank is None else [f"node {node_rank}"]
    if not where:
        return path
    return path + f" ({', '.join(where)})"
