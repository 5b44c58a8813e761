"""The plain-text table of :class:`~lightning_memopt.analysis.PhaseSummary` rows that ``lightning-memopt analyze``
prints, with the logs' warnings and micro-batch changes listed under it."""

from __future__ import annotations

import re
from collections.abc import Sequence

from lightning_memopt.analysis.findings import MemoryFinding
from lightning_memopt.analysis.ranks import RankComparison, compare_ranks, node_key, rank_ranges
from lightning_memopt.analysis.summary import PhaseSummary
from lightning_memopt.utilities.formatting import format_bytes, printable, wrap_to_width

__all__ = ["format_summary"]

#: The run column of records without a ``run_id``.
_NO_RUN = "-"


def _growth_text(s: PhaseSummary) -> str:
    """The growth cell: the fitted change over the steps it was measured on, "flat", or "too short to tell"."""
    if s.growth is None:
        return "n/a"
    first, last, n = s.growth_first_step, s.growth_last_step, s.growth_readings
    if s.growth == "too short":
        if not n or first is None:
            text = "too short to tell (no step readings)"
        elif n == 1:
            text = f"too short to tell (1 reading, step {first})"
        elif first == last:
            text = f"too short to tell ({n} readings, all at step {first})"
        else:
            text = f"too short to tell ({n} readings over steps {first}-{last})"
    elif s.growth == "flat" or s.growth_bytes_per_1k_steps is None or first is None or last is None:
        text = f"flat over steps {first}-{last}"
    else:
        change = s.growth_bytes_per_1k_steps * (last - first) / 1000
        text = f"{'+' if change >= 0 else '-'}{format_bytes(abs(change))} over steps {first}-{last}"
    return text + (" (RSS)" if s.growth_field == "host_rss_bytes" else "")


def format_summary(summaries: Sequence[PhaseSummary]) -> str:
    """A plain-text table of summaries, one row per (rank, phase); a ``run`` column when there are several runs.

    The table holds the sizes; under it, one line per row gives its growth and where its peak was (so the
    printout fits 100 columns). The growth is the fitted change over the steps it was measured on
    (``+96.00 MiB over steps 200-400``), ``flat over steps ...``, or ``too short to tell (N readings over steps
    ...)``; ``(RSS)`` marks host memory where the device gives no figures. The ``warnings`` column counts
    warnings per check (``1 duplicates, 1 leak``), and below the table each warning is listed with its text
    (the first five of each check per row).

    When a log holds AutoMicroBatch's ``micro_batch`` records, a ``micro-batch`` column gives the first and last
    size and the number of changes (``16 -> 4 (2 changes)``), and each change is listed under the table.

    When the ranks ran on more than one node (the logs of several machines), a ``node`` column gives each row's
    node rank, a ``nodes:`` line names each node's host and ranks, and the rows are named ``rank 2 (node 1)`` under
    the table. With two ranks or more, ``across ranks:`` gives per run and phase the rank that peaks,
    the lowest one, their ratio (``imbalanced`` from :data:`~lightning_memopt.analysis.ranks.IMBALANCE_RATIO` on)
    and, across nodes, the rank that peaks on each node.
    """
    several_runs = len({s.run_id for s in summaries}) > 1
    nodes = _nodes(summaries)
    several_nodes = len(nodes) > 1
    with_changes = any(s.num_micro_batch_changes for s in summaries)
    header = (
        "rank",
        *(("node",) if several_nodes else ()),
        *(("run",) if several_runs else ()),
        "phase",
        "readings",
        "peak alloc",
        "peak reserved",
        "mean alloc",
        "peak host RSS",
        "warnings",
        *(("micro-batch",) if with_changes else ()),
    )
    rows = [header]
    trends: list[str] = []
    findings: list[str] = []
    changes: list[str] = []
    for s in summaries:
        checks = s.warnings_by_check or ({"warning": s.warnings} if s.warnings else {})
        warned = ", ".join(f"{count} {printable(check)}" for check, count in checks.items()) or "0"
        if s.peak_global_step is None:
            peak_at = "n/a"
        else:
            peak_at = f"step {s.peak_global_step}, epoch {s.peak_epoch}, {s.peak_seconds:.1f} s"
        node_cell = "-" if s.node_rank is None else str(s.node_rank)
        rows.append(_row(s, warned, node_cell, several_nodes, several_runs, with_changes))
        rank = f"rank {s.rank}" + (f" (node {node_cell})" if several_nodes else "")
        where = printable(rank + (f", run {s.run_id or _NO_RUN}" if several_runs else "") + f", {s.phase}")
        trend = f"  {where}: growth {_growth_text(s)}; peak at {peak_at}"
        trends.append(wrap_to_width(trend))
        for f in s.micro_batch_changes:
            changes.append(f"{_listed_at(where, f)}: {printable(f.message)}")
        if s.num_micro_batch_changes > len(s.micro_batch_changes):
            changes.append(
                f"  {where}: {s.num_micro_batch_changes - len(s.micro_batch_changes)} more changes (not listed)"
            )
        for f in s.findings:
            findings.append(f"{_listed_at(where, f)}: {printable(f.check)}: {printable(f.message)}")
        for check, count in checks.items():
            listed = sum(f.check == check for f in s.findings)
            if count > listed:
                findings.append(f"  {where}: {count - listed} more {printable(check)} warnings (not listed)")
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines += _footer(summaries, nodes)
    lines += ["growth and peak, by row:", *trends]
    lines += _across_ranks(summaries, several_runs)
    if findings:
        lines += ["warnings in the logs:", *findings]
    if changes:
        lines += ["micro-batch changes (AutoMicroBatch):", *changes]
    return "\n".join(lines)


def _row(
    s: PhaseSummary, warned: str, node_cell: str, several_nodes: bool, several_runs: bool, with_changes: bool
) -> tuple[str, ...]:
    """One row of the table, with the node, run and micro-batch cells where the table has those columns."""
    node = (node_cell,) if several_nodes else ()
    run: tuple[str, ...] = ()
    if several_runs:
        run = (printable(s.run_id or _NO_RUN),)
    micro: tuple[str, ...] = ()
    if with_changes:
        micro = (_micro_batch_cell(s),)
    return (
        str(s.rank),
        *node,
        *run,
        printable(s.phase),
        str(s.num_readings),
        format_bytes(s.peak_allocated_bytes),
        format_bytes(s.peak_reserved_bytes),
        format_bytes(s.mean_allocated_bytes),
        format_bytes(s.peak_host_rss_bytes),
        warned,
        *micro,
    )


def _footer(summaries: Sequence[PhaseSummary], nodes: dict[tuple[int, str], list[int]]) -> list[str]:
    """The line under the table (devices and their total) and, with several nodes, the node legend."""
    devices = {s.device for s in summaries if s.device}
    totals = {s.device_total_bytes for s in summaries if s.device_total_bytes}
    foot = f"device: {printable(', '.join(sorted(devices))) or 'n/a'}"
    if totals:
        foot += f"; device total {format_bytes(max(totals))}"
    if len(nodes) > 1:
        return [foot, _node_legend(nodes)]
    return [foot]


def _across_ranks(summaries: Sequence[PhaseSummary], several_runs: bool) -> list[str]:
    """The ``across ranks:`` section (none with one rank per run and phase)."""
    comparisons = compare_ranks(summaries)
    if not comparisons:
        return []
    return ["across ranks:", *(_comparison_line(c, several_runs) for c in comparisons)]


def _nodes(summaries: Sequence[PhaseSummary]) -> dict[tuple[int, str], list[int]]:
    """The ranks of each node, keyed by (node rank, host) (-1 and "" for what a log does not say), in node order."""
    nodes: dict[tuple[int, str], list[int]] = {}
    for s in summaries:
        ranks = nodes.setdefault(node_key(s.node_rank, s.host), [])
        if s.rank not in ranks:
            ranks.append(s.rank)
    return dict(sorted(nodes.items()))


def _node_legend(nodes: dict[tuple[int, str], list[int]]) -> str:
    """``nodes: 0 gpu-a (ranks 0-1); 1 gpu-b (ranks 2-3)``, wrapped."""
    parts = []
    for (node_rank, host), ranks in nodes.items():
        name = " ".join(part for part in ("?" if node_rank < 0 else str(node_rank), host) if part)
        parts.append(f"{name} (rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)})")
    return wrap_to_width(printable("nodes: " + "; ".join(parts)))


def _comparison_line(c: RankComparison, several_runs: bool) -> str:
    """One comparison: ``  train, 4 ranks: peak 1.20 GiB on rank 3 (node 1, gpu-b); lowest ...; 1.20x, imbalanced``
    and, over several nodes, ``; highest per node: ...``."""
    run = f"run {c.run_id or _NO_RUN}, " if several_runs else ""
    rss = " host RSS" if c.field == "peak_host_rss_bytes" else ""
    ratio = "lowest is 0" if c.ratio is None else f"{c.ratio:.2f}x"
    verdict = "imbalanced" if c.imbalanced else "balanced"
    text = (
        f"  {run}{c.phase}, {c.num_ranks} ranks: peak{rss} {format_bytes(c.highest.bytes)} on {c.highest.where()};"
        f" lowest {format_bytes(c.lowest.bytes)} on {c.lowest.where()}; {ratio}, {verdict}"
    )
    if c.node_peaks:
        text += "; highest per node: " + ", ".join(f"{format_bytes(p.bytes)} on {p.where()}" for p in c.node_peaks)
    return wrap_to_width(printable(text))


def _listed_at(where: str, f: MemoryFinding) -> str:
    """The start of a listed finding's line: the row, its step (when known) and its time."""
    step = "" if f.global_step is None else f", step {f.global_step}"
    return f"  {where}{step}, {f.seconds:.1f} s"


def _micro_batch_cell(s: PhaseSummary) -> str:
    """The micro-batch cell: first and last size and the number of changes (``16 -> 4 (2 changes)``), or ``-``."""
    if not s.num_micro_batch_changes:
        return "-"
    start = "?"
    if s.micro_batch_changes:
        first = re.match(r"micro-batch (\S+) ->", s.micro_batch_changes[0].message)
        if first:
            start = printable(first.group(1))
    end = "?" if s.micro_batch_size is None else str(s.micro_batch_size)
    count = s.num_micro_batch_changes
    return f"{start} -> {end} ({count} change{'s' if count != 1 else ''})"
