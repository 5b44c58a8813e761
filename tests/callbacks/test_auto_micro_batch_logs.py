"""AutoMicroBatch's changes in the memory log (with MemoryMonitor), in the printout and in `analyze`."""

from __future__ import annotations

import json
import logging

import pytest

from lightning_memopt import MemoryMonitor
from lightning_memopt.analysis.memory_log import analyze_memory_logs, load_memory_log
from lightning_memopt.callbacks.auto_micro_batch import AutoMicroBatch
from lightning_memopt.cli import main
from tests.helpers.amb import Net, fit
from tests.helpers.plots import plotted_figure


def _fit_with_monitor(tmp_path, caplog):
    model = Net(forward_budget=4, batch_size=16)
    callback = AutoMicroBatch()
    monitor = MemoryMonitor(dirpath=tmp_path / "memory", log_every_n_steps=1)
    with caplog.at_level(logging.INFO):
        trainer = fit(tmp_path, model, [monitor, callback], max_steps=3)
    return trainer, callback, tmp_path / "memory" / "memory_rank0.jsonl"


def test_each_change_is_a_micro_batch_record_in_the_memory_log(tmp_path, caplog):
    trainer, callback, path = _fit_with_monitor(tmp_path, caplog)
    records = load_memory_log(path)
    changes = [r for r in records if r["event"] == "micro_batch"]
    assert [(r["previous_micro_batch_size"], r["micro_batch_size"]) for r in changes] == [(16, 8), (8, 4)]
    for r in changes:
        assert r["batch_size"] == 16 and r["reason"] == "out of memory" and r["phase"] == "train"
        assert r["global_step"] == 0 and r["batch_idx"] == 0 and r["rank"] == 0
        assert r["run_id"] == records[0]["run_id"] and r["host_rss_bytes"] > 0  # a reading taken at the change
    assert [r["retries"] for r in changes] == [1, 2]
    # the records sit in the timeline: after the train phase started, before its first step record
    events = [r["event"] for r in records]
    assert events.index("phase_start") < events.index("micro_batch") < events.index("step")
    # printed once per change, by rank zero, with the reason
    printed = [m for m in caplog.messages if m.startswith("AutoMicroBatch:")]
    assert printed == [
        "AutoMicroBatch: micro-batch 16 -> 8 (out of memory; batch of 16, global step 0).",
        "AutoMicroBatch: micro-batch 8 -> 4 (out of memory; batch of 16, global step 0).",
    ]
    assert trainer.global_step == 3 and callback.micro_batch_size == 4


def test_no_monitor_no_record_and_the_callback_still_works(tmp_path):
    model = Net(forward_budget=4, batch_size=16)
    callback = AutoMicroBatch()
    fit(tmp_path, model, [callback], max_steps=1)
    assert callback.micro_batch_size == 4 and not list(tmp_path.rglob("*.jsonl"))


def test_a_failing_log_never_stops_the_recovery(tmp_path, caplog, monkeypatch):
    record = MemoryMonitor._record

    def broken(self, trainer, reading, phase, event, *args, **kwargs):
        if event == "micro_batch":
            raise OSError("disk gone")
        return record(self, trainer, reading, phase, event, *args, **kwargs)

    monkeypatch.setattr(MemoryMonitor, "_record", broken)
    with pytest.warns(UserWarning, match=r"writing a 'micro_batch' record failed"):
        trainer, callback, _ = _fit_with_monitor(tmp_path, caplog)
    assert trainer.global_step == 3 and callback.micro_batch_size == 4


def test_analyze_lists_the_changes_and_marks_them_on_the_plot(tmp_path, caplog, capsys, monkeypatch):
    _, _, path = _fit_with_monitor(tmp_path, caplog)
    (summary,) = [s for s in analyze_memory_logs([path])[0] if s.phase == "train"]
    assert summary.num_micro_batch_changes == 2 and summary.micro_batch_size == 4
    assert [c.message for c in summary.micro_batch_changes] == [
        "micro-batch 16 -> 8 (out of memory; batch of 16)",
        "micro-batch 8 -> 4 (out of memory; batch of 16)",
    ]

    assert main(["analyze", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    column = lines[0].index("micro-batch")
    train = next(line for line in lines if line.startswith("0     train"))
    assert train[column:].startswith("16 -> 4 (2 changes)")
    listed = lines[lines.index("micro-batch changes (AutoMicroBatch):") + 1 :]
    assert listed[0].startswith("  rank 0, train, step 0, ") and listed[0].endswith(
        ": micro-batch 16 -> 8 (out of memory; batch of 16)"
    )
    assert listed[1].endswith(": micro-batch 8 -> 4 (out of memory; batch of 16)")

    import matplotlib.pyplot as plt

    fig = plotted_figure(monkeypatch, [path], tmp_path / "p.png")
    try:
        (ax,) = fig.axes
        notes = [a.get_text().replace("\n", " ") for a in ax.texts]
        assert "micro-batch 16 -> 8 (out of memory; batch of 16)" in notes
        assert "micro-batch 8 -> 4 (out of memory; batch of 16)" in notes
        dotted = [line for line in ax.lines if line.get_label() == "micro-batch change"]
        assert len(dotted) == 1 and dotted[0].get_linestyle() == ":"
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "micro-batch change" in legend
    finally:
        plt.close(fig)


def test_analyze_has_no_micro_batch_column_without_changes(tmp_path, capsys):
    path = tmp_path / "memory_rank0.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "time": float(s),
                    "rank": 0,
                    "phase": "train",
                    "event": "step",
                    "global_step": s,
                    "host_rss_bytes": 100,
                }
            )
            + "\n"
            for s in range(3)
        )
    )
    assert main(["analyze", str(path)]) == 0
    out = capsys.readouterr().out
    assert "micro-batch" not in out
