"""The figure ``analyze_memory_logs`` draws, kept open so that tests can read its axes."""

from __future__ import annotations

from lightning_memopt.analysis import analyze_memory_logs


def plotted_figure(monkeypatch, paths, target):
    """The matplotlib figure `analyze_memory_logs` draws, kept open for inspection."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kept = []
    with monkeypatch.context() as patch:
        patch.setattr(plt, "close", kept.append)
        analyze_memory_logs(paths, plot=target)
    assert len(kept) == 1 and target.stat().st_size > 10_000
    return kept[0]
