"""A resumed run reads its own last train step back through the one reader of the memory log format."""

from __future__ import annotations

import json

from lightning_memopt.analysis import iter_memory_records
from lightning_memopt.callbacks._memory_log import last_train_step


def _record(**fields):
    return {"time": 1.0, "rank": 0, **fields}


def test_last_train_step_counts_only_the_runs_own_train_steps(tmp_path):
    path = tmp_path / "memory_rank0.jsonl"
    lines = [
        _record(run_id="a", phase="train", event="step", global_step=3),
        _record(run_id="a", phase="validate", event="step", global_step=8),
        _record(run_id="a", phase="train", event="warning", global_step=9),
        _record(run_id="b", phase="train", event="step", global_step=7),
        _record(run_id="a", phase="train", event="step", global_step="5"),
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"run_id": "a", "phase": "tr')
    assert last_train_step(path, "a") == 3
    assert last_train_step(path, "b") == 7
    assert last_train_step(path, None) == -1
    assert last_train_step(tmp_path / "missing.jsonl", "a") == -1
    # The torn line and the record with a string step are skipped by the reader.
    assert [r["global_step"] for r in iter_memory_records(path)] == [3, 8, 9, 7]
