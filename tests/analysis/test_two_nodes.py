"""A simulated 2-node x 2-process job (``tests/scripts/two_nodes.py``): the node in logs and reports, and
``lightning-memopt analyze`` over both nodes' directories.

One run of the script serves every test here: four gloo processes forked after one interpreter's imports, 4.5 s on
this 2-core machine under a load of 7 (27 s when each rank was an interpreter of its own).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from lightning_memopt.analysis import iter_memory_records
from lightning_memopt.cli import main
from tests.helpers.subprocess_run import run_script_once

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not hasattr(os, "fork"), reason="the ranks are forked")]

HOSTS = {0: "sim-node-0", 1: "sim-node-1"}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = run_script_once(tmp_path_factory, "two_nodes.py", timeout=420)
    ranks = json.loads((root / "ranks.json").read_text())
    # ranks 0-2 end normally; rank 3 (node 1) ran out of memory in validate and exited with 3
    assert ranks["codes"] == [0, 0, 0, 3], "\n".join(ranks["tails"])
    return root


def _records(job):
    return {r: list(iter_memory_records(job / f"node{r // 2}" / "memopt" / f"memory_rank{r}.jsonl")) for r in range(4)}


def test_each_node_logs_its_ranks_with_node_rank_and_host(job):
    assert sorted(p.name for p in (job / "node0" / "memopt").glob("memory_rank*")) == [
        "memory_rank0.jsonl",
        "memory_rank1.jsonl",
    ]
    assert sorted(p.name for p in (job / "node1" / "memopt").glob("memory_rank*")) == [
        "memory_rank2.jsonl",
        "memory_rank3.jsonl",
    ]
    records = _records(job)
    run_ids = {r["run_id"] for recs in records.values() for r in recs}
    assert len(run_ids) == 1  # one run over both nodes: rank zero's id
    for rank, recs in records.items():
        assert recs and {(r["rank"], r["node_rank"], r["host"]) for r in recs} == {(rank, rank // 2, HOSTS[rank // 2])}
        assert list(recs[0])[-3:] == ["node_rank", "host", "run_id"]


def test_the_oom_report_names_node_and_host(job):
    report = json.loads((job / "node1" / "memopt" / "oom_report_rank3.json").read_text())
    when = report["when"]
    assert (when["rank"], when["local_rank"], when["node_rank"], when["host"], when["world_size"]) == (
        3,
        1,
        1,
        "sim-node-1",
        4,
    )
    assert when["stage"] == "validate" and report["config"]["num_nodes"] == 2
    assert "| node / host | 1 / sim-node-1 |" in (job / "node1" / "memopt" / "oom_report_rank3.md").read_text()
    assert not list((job / "node0" / "memopt").glob("oom_report*"))  # only the failing rank writes


def _expected_peak_rank(records, phase):
    """The rank whose ``phase`` records hold the highest host RSS (the lowest rank of a tie), from the records."""
    peaks = {
        rank: max(r["host_rss_bytes"] for r in recs if r["phase"] == phase and r["host_rss_bytes"] is not None)
        for rank, recs in records.items()
    }
    return max(sorted(peaks), key=lambda rank: peaks[rank])


def test_analyze_merges_both_nodes_into_one_table(job, capsys, monkeypatch):
    monkeypatch.chdir(job)
    assert main(["analyze", "node0/memopt", "node1/memopt"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["rank", "node", "phase"], out
    end = next(i for i, line in enumerate(lines) if line.startswith("device:"))
    table = [line.split() for line in lines[2:end]]
    assert [(row[0], row[1], row[2]) for row in table] == [
        ("0", "0", "train"),
        ("0", "0", "validate"),
        ("1", "0", "train"),
        ("1", "0", "validate"),
        ("2", "1", "train"),
        ("2", "1", "validate"),
        ("3", "1", "train"),
        ("3", "1", "validate"),
    ], out
    assert "nodes: 0 sim-node-0 (ranks 0-1); 1 sim-node-1 (ranks 2-3)" in out
    assert "rank 3 (node 1), validate:" in out
    peak = _expected_peak_rank(_records(job), "train")
    across = out.split("across ranks:\n", 1)[1]
    assert f"on rank {peak} (node {peak // 2}, sim-node-{peak // 2});" in across.split("\n  validate")[0], out
    assert "train, 4 ranks: peak host RSS" in " ".join(across.split())
    # the same files by a quoted glob pattern, and by file: the same table
    assert main(["analyze", "node*/memopt/memory_rank*.jsonl"]) == 0
    assert capsys.readouterr().out == out
    assert main(["analyze", "node1/memopt/memory_rank3.jsonl", "node0/memopt", "node1/memopt"]) == 0
    assert capsys.readouterr().out == out  # rank 3 named twice is read once


def test_analyze_refuses_one_rank_in_two_logs_over_the_same_time(job, capsys, monkeypatch):
    monkeypatch.chdir(job)
    shutil.copytree(job / "node1" / "memopt", job / "copy" / "memopt", ignore=shutil.ignore_patterns("oom_*"))
    assert main(["analyze", "node0/memopt", "node1/memopt", "copy/memopt"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "rank 2 of run " in err and "node1/memopt/memory_rank2.jsonl (host sim-node-1, node 1) and" in err
    assert "copy/memopt/memory_rank2.jsonl (host sim-node-1, node 1) over the same time" in err
    assert "analyse them separately" in err
