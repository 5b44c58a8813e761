"""The timeline plot: written in the format of its extension, findings labelled, threshold warnings marked."""

import pytest

from lightning_memopt.analysis import analyze_memory_logs, load_memory_log, plot_memory_timeline
from tests.helpers.analysis_logs import audit_records, jsonl_text, step_records, write, write_good_log
from tests.helpers.plots import plotted_figure


@pytest.fixture
def good_log(tmp_path):
    return write_good_log(tmp_path)


def test_plot_is_written(good_log, tmp_path):
    other = write(tmp_path / "memory_rank1.jsonl", [dict(r, rank=1) for r in load_memory_log(good_log)])
    summaries, text = analyze_memory_logs([good_log, other], plot=tmp_path / "out" / "timeline.png")
    assert {s.rank for s in summaries} == {0, 1}
    png = tmp_path / "out" / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"plot: {png}" in text


def test_plot_formats_follow_the_extension(tmp_path):
    log = tmp_path / "memory_rank0.jsonl"
    log.write_text(jsonl_text(step_records(3)))
    analyze_memory_logs([log], plot=tmp_path / "t.svg")
    assert (tmp_path / "t.svg").read_text().lstrip().startswith("<?xml")
    analyze_memory_logs([log], plot=tmp_path / "no_extension")
    assert (tmp_path / "no_extension").read_bytes()[:4] == b"\x89PNG"


def test_plot_labels_audit_findings_with_their_text(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    path = write(tmp_path / "memory_rank0.jsonl", audit_records())
    fig = plotted_figure(monkeypatch, [path], tmp_path / "p.png")
    try:
        (ax,) = fig.axes
        notes = {a.get_text().replace("\n", " "): a.xy for a in ax.texts}
        leak = next(text for text in notes if text.startswith("leak: "))
        duplicates = next(text for text in notes if text.startswith("duplicates: "))
        assert leak.startswith("leak: Live tensor memory on cpu grows by 1.00 MiB per optimizer step")
        assert duplicates.startswith("duplicates: 30 tensors on cpu (869.08 KiB")
        assert "MemoryAudit [rank 0]" not in leak + duplicates  # the panel names the rank
        assert notes[leak][0] == pytest.approx(300.5) and notes[duplicates][0] == pytest.approx(1.5)
        labels = [line.get_label() for line in ax.lines]
        assert "leak warning" in labels and "duplicates warning" in labels
        # nothing drawn as a threshold warning, and no mark at 0 for findings that have no device figure
        assert not [c for c in ax.collections if c.get_label() == "threshold warning"]
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "leak warning" in legend and "threshold warning" not in legend
    finally:
        plt.close(fig)


def test_plot_marks_threshold_warnings_at_their_figure(good_log, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    fig = plotted_figure(monkeypatch, [good_log], tmp_path / "p.png")
    try:
        (ax,) = fig.axes
        (marks,) = [c for c in ax.collections if c.get_label() == "threshold warning"]
        # the warning's allocated bytes (9500) on the MiB axis, at its time (5 s)
        assert marks.get_offsets().tolist() == [[5.0, pytest.approx(9500 / 1024**2)]]
        assert not ax.texts
    finally:
        plt.close(fig)


def test_plot_memory_timeline_keeps_its_signature(good_log, tmp_path):
    records = load_memory_log(good_log)
    written = plot_memory_timeline({"memory_rank0.jsonl": records}, tmp_path / "direct.png")
    assert written == tmp_path / "direct.png" and written.read_bytes()[:4] == b"\x89PNG"


def test_a_threshold_warning_that_names_no_figure_is_labelled_not_marked(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    warning = {"time": 2.0, "rank": 0, "phase": "train", "event": "warning", "check": "threshold", "message": "hot"}
    odd = dict(warning, time=2.5, field=["allocated_bytes"], message="odd")
    path = tmp_path / "memory_rank0.jsonl"
    path.write_text(jsonl_text([*step_records(3), warning, odd]))
    fig = plotted_figure(monkeypatch, [path], tmp_path / "p.png")
    try:
        (ax,) = fig.axes
        assert [t.get_text() for t in ax.texts] == ["threshold: hot", "threshold: odd"]
        assert not [c for c in ax.collections if c.get_label() == "threshold warning"]
    finally:
        plt.close(fig)


def test_the_envelope_keeps_the_lowest_and_highest_reading_of_every_bucket():
    """A long line is drawn from each bucket's extremes (in time order) plus the readings after the last bucket."""
    import numpy as np

    from lightning_memopt.analysis.plot import _envelope

    values = np.random.default_rng(0).normal(size=1003)
    times = np.arange(len(values), dtype=float)
    kept_times, kept_values = _envelope(times, values, buckets=7)
    size = -(-len(values) // 7)
    expected = set()
    for start in range(0, len(values) - size + 1, size):  # whole buckets only
        chunk = list(values[start : start + size])
        expected |= {start + chunk.index(min(chunk)), start + chunk.index(max(chunk))}
    expected |= set(range(len(values) // size * size, len(values)))  # the tail, kept as it is
    assert list(kept_times) == sorted(expected) and list(kept_values) == [values[i] for i in sorted(expected)]
    short = _envelope(times[:10], values[:10])  # fewer readings than buckets: all of them
    assert list(short[0]) == list(times[:10])
