"""The node in memory logs and OOM reports, and ``analyze`` over the logs of several nodes (hand-written records).

The real 2-node x 2-process job is in ``test_two_nodes.py``.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch

from lightning_memopt import MemoryMonitor, OOMReporter
from lightning_memopt.analysis import MemoryLogError, analyze_memory_logs, iter_memory_records, summarize_memory_log
from lightning_memopt.analysis.ranks import RankSources, compare_ranks, rank_ranges
from lightning_memopt.analysis.records import record_problem
from lightning_memopt.cli import main
from lightning_memopt.utilities.trainer import host_name
from tests.helpers.analysis_logs import jsonl_text, rec
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer

RUN = "ab12cd34ef56"


def _node_log(directory, rank, node_rank, host, peak, t0=0.0, run=RUN, steps=3):
    """A rank's log as a node writes it: ``steps`` train steps, the last reaching ``peak`` allocated bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    records = [
        dict(rec(t0 + s, "train", "step", s, peak - steps + s, rank=rank), node_rank=node_rank, host=host, run_id=run)
        for s in range(1, steps + 1)
    ]
    path = directory / f"memory_rank{rank}.jsonl"
    path.write_text(jsonl_text(records))
    return path


@pytest.fixture
def two_nodes(tmp_path):
    """Node 0 (gpu-a) runs ranks 0-1, node 1 (gpu-b) ranks 2-3; rank 2 peaks highest."""
    peaks = {0: 1000, 1: 1100, 2: 1500, 3: 1200}
    for rank, peak in peaks.items():
        node = rank // 2
        _node_log(tmp_path / f"node{node}" / "memopt", rank, node, f"gpu-{'ab'[node]}", peak)
    return tmp_path / "node0" / "memopt", tmp_path / "node1" / "memopt"


# ------------------------------------------------------------------------------------------------ reading


def test_records_without_node_fields_are_read_and_bad_ones_skipped():
    old = rec(1.0, "train", "step", 1, 100)
    assert "node_rank" not in old and record_problem(old) is None
    assert record_problem(dict(old, node_rank=1, host="gpu-b")) is None
    assert record_problem(dict(old, node_rank=None, host=None)) is None
    assert record_problem(dict(old, node_rank=-1)) == "`node_rank` is -1, not an int >= 0"
    assert record_problem(dict(old, node_rank="1")) == "`node_rank` is '1', not an int >= 0"
    assert record_problem(dict(old, node_rank=True)) == "`node_rank` is True, not an int >= 0"
    assert record_problem(dict(old, host=7)) == "`host` is 7, not a string"


def test_old_logs_have_no_node_column_but_are_compared_across_ranks(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(jsonl_text([rec(1.0, "train", "step", 1, 100, rank=0), rec(1.0, "train", "step", 1, 300, rank=1)]))
    summaries, text = analyze_memory_logs([path])
    assert [(s.rank, s.node_rank, s.host) for s in summaries] == [(0, None, None), (1, None, None)]
    assert text.splitlines()[0].split()[:2] == ["rank", "phase"] and "nodes:" not in text
    assert "train, 2 ranks: peak 300 B on rank 1; lowest 100 B on rank 0; 3.00x, imbalanced" in text


# ------------------------------------------------------------------------------------------------ merging


def test_analyze_merges_the_directories_of_two_nodes(two_nodes):
    summaries, text = analyze_memory_logs(list(two_nodes))
    assert [(s.rank, s.node_rank, s.host, s.peak_allocated_bytes) for s in summaries] == [
        (0, 0, "gpu-a", 1000),
        (1, 0, "gpu-a", 1100),
        (2, 1, "gpu-b", 1500),
        (3, 1, "gpu-b", 1200),
    ]
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["rank", "node", "phase"]
    assert [line.split()[:2] for line in lines[2:6]] == [["0", "0"], ["1", "0"], ["2", "1"], ["3", "1"]]
    assert "nodes: 0 gpu-a (ranks 0-1); 1 gpu-b (ranks 2-3)" in lines
    assert "  rank 2 (node 1), train: growth" in text
    across = " ".join(text.split("across ranks:\n")[1].split())
    assert across == (
        "train, 4 ranks: peak 1.46 KiB on rank 2 (node 1, gpu-b); lowest 1000 B on rank 0 (node 0, gpu-a);"
        " 1.50x, imbalanced; highest per node: 1.07 KiB on rank 1 (node 0, gpu-a), 1.46 KiB on rank 2 (node 1,"
        " gpu-b)"
    )
    assert max(len(line) for line in lines[6:]) <= 100


def test_paths_are_directories_files_or_patterns_each_file_read_once(two_nodes, tmp_path, capsys):
    node0, node1 = two_nodes
    base, _ = analyze_memory_logs([node0, node1])
    os.link(node1 / "memory_rank2.jsonl", tmp_path / "hard_link.jsonl")
    (tmp_path / "soft_link.jsonl").symlink_to(node1 / "memory_rank3.jsonl")
    for paths in (
        [str(tmp_path / "node*" / "memopt" / "memory_rank*.jsonl")],
        [node0, node1, tmp_path / "hard_link.jsonl", tmp_path / "soft_link.jsonl"],
        [node0 / "memory_rank0.jsonl", node0, node1, node1 / "memory_rank3.jsonl"],
        [node0, node1, tmp_path / "node1" / ".." / "node1" / "memopt"],
    ):
        assert analyze_memory_logs(paths)[0] == base  # nothing counted twice
    assert main(["analyze", str(tmp_path / "node?" / "memopt")]) == 0
    assert "nodes: 0 gpu-a (ranks 0-1); 1 gpu-b (ranks 2-3)" in capsys.readouterr().out
    with pytest.raises(MemoryLogError, match=r"nodes/\*: matches no file"):
        analyze_memory_logs([tmp_path / "nodes" / "*"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(MemoryLogError, match="empty: no memory_rank\\*.jsonl in this directory; pass the directory"):
        analyze_memory_logs([node0, tmp_path / "empty"])


def test_a_directory_lists_its_logs_by_rank(tmp_path):
    for rank in (10, 2, 1):
        _node_log(tmp_path, rank, 0, "gpu-a", 100 + rank)
    summaries, _ = analyze_memory_logs([tmp_path])
    assert [s.rank for s in summaries] == [1, 2, 10]


# ------------------------------------------------------------------------------------------------ clashes


def test_one_rank_in_two_logs_over_the_same_time_is_refused(two_nodes, tmp_path):
    node0, node1 = two_nodes
    _node_log(tmp_path / "other", 2, 1, "gpu-c", 900, t0=1.5)  # another job resumed from the same checkpoint
    with pytest.raises(MemoryLogError) as caught:
        analyze_memory_logs([node0, node1, tmp_path / "other"])
    message = str(caught.value)
    assert message.startswith(
        f"rank 2 of run {RUN} is in {node1 / 'memory_rank2.jsonl'} (host gpu-b, node 1) and"
        f" {tmp_path / 'other' / 'memory_rank2.jsonl'} (host gpu-c, node 1) over the same time."
    )
    assert "two jobs that share a run id (resumed from one checkpoint) or one log passed twice (a copy)" in message


def test_a_rank_resumed_later_on_another_host_is_one_row(two_nodes, tmp_path):
    node0, node1 = two_nodes
    _node_log(tmp_path / "resumed", 2, 1, "gpu-c", 1700, t0=100.0)
    summaries, text = analyze_memory_logs([node0, node1, tmp_path / "resumed"])
    (rank2,) = [s for s in summaries if s.rank == 2]
    assert (rank2.host, rank2.node_rank, rank2.num_readings, rank2.peak_allocated_bytes) == ("gpu-b, gpu-c", 1, 6, 1700)
    assert "1 gpu-b, gpu-c (rank 2)" in text


def test_two_runs_that_share_ranks_are_kept_apart(two_nodes, tmp_path):
    node0, node1 = two_nodes
    _node_log(tmp_path / "run2", 2, 1, "gpu-b", 800, run="second")  # same rank, same time, another run
    summaries, text = analyze_memory_logs([node0, node1, tmp_path / "run2"])
    assert [(s.run_id, s.rank) for s in summaries][-1] == ("second", 2)
    assert text.splitlines()[0].split()[:3] == ["rank", "node", "run"]


def test_rank_sources_overlap_rule():
    sources = RankSources()
    a = {"rank": 0, "run_id": "r", "host": "h", "node_rank": 0}
    for t in (1.0, 3.0):
        sources.add({**a, "time": t}, "x.jsonl")
    sources.add({**a, "time": 3.5}, "y.jsonl")  # after x: a resume
    sources.add({**a, "time": 9.0, "host": "g"}, "x.jsonl")  # one file, two hosts: after x's span on h
    assert sources.clashes() == [] and sources.error() is None
    sources.add({**a, "time": 3.0, "rank": 1}, "z.jsonl")  # another rank: no clash
    sources.add({**a, "time": 2.0, "host": "g"}, "x.jsonl")  # host g's span in x now covers 2-9: overlaps
    assert sources.clashes() == [
        "rank 0 of run r is in x.jsonl (host h, node 0) and x.jsonl (host g, node 0) over the same time"
    ]
    many = RankSources()
    for rank in range(5):
        for source in ("p", "q"):
            many.add({"rank": rank, "time": 1.0}, source)
    assert many.error().count("over the same time") == 3 and "; and 2 more." in many.error()
    assert "the records without a run_id" in many.error()


# ------------------------------------------------------------------------------------------------ comparing


def test_compare_ranks_rules():
    def step(rank, alloc, rss=50, phase="train"):
        return rec(1.0, phase, "step", 1, alloc, rank=rank) | {"host_rss_bytes": rss}

    tie = compare_ranks(summarize_memory_log([step(0, 10), step(1, 30), step(2, 30)]))[0]
    assert (tie.highest.rank, tie.lowest.rank, tie.ratio, tie.imbalanced, tie.node_peaks) == (1, 0, 3.0, True, ())
    zero = compare_ranks(summarize_memory_log([step(0, 0), step(1, 5)]))[0]
    assert (zero.ratio, zero.imbalanced) == (None, True)
    balanced = compare_ranks(summarize_memory_log([step(0, 100), step(1, 109)]))[0]
    assert (round(balanced.ratio, 2), balanced.imbalanced) == (1.09, False)
    # a rank without device figures: the host's are compared
    mixed = compare_ranks(summarize_memory_log([step(0, 100, rss=7), step(1, None, rss=9)]))[0]
    assert (mixed.field, mixed.highest.rank, mixed.highest.bytes) == ("peak_host_rss_bytes", 1, 9)
    # one rank per phase, or no figure every rank has: nothing to compare
    assert compare_ranks(summarize_memory_log([step(0, 1), step(1, 2, phase="validate")])) == []
    assert compare_ranks(summarize_memory_log([step(0, 1, rss=None), step(1, None, rss=3)])) == []
    assert rank_ranges([0]) == "0" and rank_ranges([]) == "" and rank_ranges([5, 3, 4, 4, 9]) == "3-5, 9"


# ------------------------------------------------------------------------------------------------ writing


def test_monitor_records_and_oom_report_carry_node_and_host(tmp_path, monkeypatch, request):
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu-node-7")
    host_name.cache_clear()  # looked up once per process: again, on this "machine"
    request.addfinalizer(host_name.cache_clear)

    class FailsAtStep2(TinyModel):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
            return super().training_step(batch, batch_idx)

    callbacks = [MemoryMonitor(dirpath=tmp_path / "memopt"), OOMReporter(dirpath=tmp_path / "memopt", max_listed=0)]
    trainer = make_trainer(tmp_path, callbacks=callbacks)
    with pytest.raises(torch.OutOfMemoryError):
        trainer.fit(FailsAtStep2())
    records = list(iter_memory_records(tmp_path / "memopt" / "memory_rank0.jsonl"))
    assert records and all((r["node_rank"], r["host"]) == (0, "gpu-node-7") for r in records)
    assert all(list(r)[-3:] == ["node_rank", "host", "run_id"] for r in records)
    when = json.loads((tmp_path / "memopt" / "oom_report_rank0.json").read_text())["when"]
    assert (when["node_rank"], when["local_rank"], when["host"]) == (0, 0, "gpu-node-7")
    assert "| node / host | 0 / gpu-node-7 |" in (tmp_path / "memopt" / "oom_report_rank0.md").read_text()


def test_plot_panels_name_the_node_of_each_rank(two_nodes, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from tests.helpers.plots import plotted_figure

    fig = plotted_figure(monkeypatch, list(two_nodes), tmp_path / "p.png")
    try:
        titles = [ax.get_title(loc="left").split(" (cuda")[0] for ax in fig.axes]
    finally:
        plt.close(fig)
    assert titles == [
        "rank 0 (node 0, gpu-a)",
        "rank 1 (node 0, gpu-a)",
        "rank 2 (node 1, gpu-b)",
        "rank 3 (node 1, gpu-b)",
    ]
