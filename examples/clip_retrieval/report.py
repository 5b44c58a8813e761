"""The text the example prints at the end: retrieval vs chance, matrix sizes vs measured memory, paths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["TOP_K", "naive_matrix_bytes", "report"]

#: The K of the logged R@K.
TOP_K = (1, 5, 10)


def naive_matrix_bytes(num_videos: int, num_texts: int, bytes_per_score: int = 4) -> int:
    """Bytes of a dense ``num_videos x num_texts`` score matrix (float32 by default).

    Example:
        >>> naive_matrix_bytes(117_120, 117_120) / 2**30 > 51
        True
    """
    return num_videos * num_texts * bytes_per_score


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _fraction(x: float) -> str:
    return f"{x:.1e}" if 0 < x < 1e-3 else f"{x:.4f}"


def report(summary: dict[str, Any]) -> str:
    """The text printed at the end (rank zero): retrieval vs chance, matrix sizes vs measured memory, paths."""
    lines = [""]
    metrics, chance, cost = summary["metrics"], summary["chance"], summary["metric_compute"]
    if cost:
        lines.append(f"retrieval on {cost['num_videos']:,} clips x {cost['num_unique_texts']:,} distinct captions:")
    for direction in ("v2t", "t2v"):
        parts = [
            f"R@{k} {metrics.get(f'val/{direction}/R@{k}', float('nan')):.4f} "
            f"(chance {_fraction(chance.get(f'{direction}/R@{k}', float('nan')))})"
            for k in TOP_K
        ]
        parts += [
            f"MedR {metrics.get(f'val/{direction}/MedR', float('nan')):.0f}",
            f"MeanR {metrics.get(f'val/{direction}/MeanR', float('nan')):.1f}",
        ]
        lines.append(f"  {direction}: " + ", ".join(parts))
    if "val/category_acc" in metrics:
        lines.append(f"  category accuracy (second task): {metrics['val/category_acc']:.4f}")
    if cost:
        n, u = cost["num_videos"], cost["num_unique_texts"]
        lines.append("similarity matrix if materialised (float32):")
        lines.append(f"  {n:,} x {n:,} (captions not deduplicated): {_size(summary['naive_matrix_bytes'])}")
        lines.append(f"  {n:,} x {u:,} (deduplicated captions):     {_size(summary['naive_dedup_matrix_bytes'])}")
        bv, bt = cost["block_sizes"]
        lines.append(
            f"StreamingRetrievalMetric.compute(): {cost['seconds']:.1f} s, blocks of {bv} x {bt}, budget "
            f"{_size(cost['budget_bytes'])} (planned working set {_size(cost['planned_working_set_bytes'])})"
        )
        growth = cost["rss_growth_bytes"]
        ratio = (
            f"; {summary['naive_dedup_matrix_bytes'] / growth:.0f}x less than the deduplicated matrix"
            if growth >= 2**20
            else ""
        )
        lines.append(
            f"  features held on CPU: {_size(cost['stored_feature_bytes_this_rank'])}; peak RSS growth during "
            f"compute: {_size(growth)} (RSS {_size(cost['rss_start_bytes'])} -> peak "
            f"{_size(cost['rss_peak_bytes'])}){ratio}"
        )
    lines.append(f"logs:         {summary['log_dir']}")
    logs = [Path(p) for p in summary["memory_logs"]]
    if logs:
        from lightning_memopt.analysis import analyze_memory_logs

        plot = logs[0].parent / "memory_timeline.png" if summary["plot"] else None
        lines.append(f"memory log:   {', '.join(str(p) for p in logs)}")
        try:
            _, text = analyze_memory_logs(logs, plot=plot)
        except ImportError:
            _, text = analyze_memory_logs(logs)
            text += "\n(no plot: install matplotlib)"
        lines.append("memory summary:")
        lines.append(text.replace("\nplot: ", "\nmemory plot:  "))
    lines.append(f"wall time:    {summary['wall_seconds']:.1f} s")
    return "\n".join(lines)
