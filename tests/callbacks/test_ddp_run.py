"""One healthy 2-process DDP run (gloo, CPU) with MemoryMonitor and GarbageCollector, checked by several tests.

The run is ``tests/scripts/monitor_ddp_run.py``.

Starting two ranks costs most of the time (each imports torch and Lightning), so the callbacks that must be seen
under DDP share one run.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.subprocess_run import run_script_once


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    return run_script_once(tmp_path_factory, "monitor_ddp_run.py", timeout=300)


def _read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_memory_monitor_writes_one_file_per_rank_and_logs_from_rank_zero(ddp_run):
    files = sorted(p.name for p in (ddp_run / "mem").iterdir())
    assert files == ["memory_rank0.jsonl", "memory_rank1.jsonl"]
    run_ids = set()
    for rank in (0, 1):
        records = _read_jsonl(ddp_run / "mem" / f"memory_rank{rank}.jsonl")
        assert {r["rank"] for r in records} == {rank}
        assert [r["global_step"] for r in records if r["event"] == "step" and r["phase"] == "train"] == [1, 2, 3, 4]
        run_ids |= {r["run_id"] for r in records}
    assert len(run_ids) == 1  # one run: rank zero's id, broadcast in setup
    # Loggers are written from rank zero only, including the cross-rank min/max/mean every 2 steps.
    rank1 = ddp_run / "logged_rank1.jsonl"
    assert not [k for r in (_read_jsonl(rank1) if rank1.exists() else []) for k in r if k.startswith("memory/")]
    cross = [r for r in _read_jsonl(ddp_run / "logged_rank0.jsonl") if "memory/train/host_rss_bytes_max" in r]
    assert [r["step"] for r in cross] == [2, 4]
    for r in cross:
        assert r["memory/train/host_rss_bytes_min"] <= r["memory/train/host_rss_bytes_mean"]
        assert r["memory/train/host_rss_bytes_mean"] <= r["memory/train/host_rss_bytes_max"]


@pytest.mark.slow
def test_garbage_collector_collects_at_the_same_steps_on_every_rank(ddp_run):
    steps = [json.loads((ddp_run / f"gc_steps_rank{r}.json").read_text()) for r in (0, 1)]
    assert steps[0] == steps[1] == [2, 4]
