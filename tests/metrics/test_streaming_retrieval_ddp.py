"""StreamingRetrievalMetric is hard to misuse under DDP (2 gloo processes): the documented logging call prints no
Lightning ``sync_dist`` warning and logs the metric's own values, a run without ``sample_ids`` is warned about the
sampler's padding repeats once, and ``compute()`` on rank zero only ends in an error that says what to do."""

from __future__ import annotations

import json
import socket

import pytest

from tests.helpers.subprocess_run import SCRIPTS, run_file


@pytest.mark.slow
def test_the_documented_logging_call_is_quiet_exact_and_padding_is_warned_once(tmp_path):
    proc = run_file(SCRIPTS / "retrieval_lightning_ddp.py", tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert not [w for w in r["warnings"] if "sync_dist=True" in w], r["warnings"]
        assert len(r["computed"]) == 2
        assert r["computed"][-1] == {k: r["logged"][k] for k in r["computed"][-1]}  # logged as computed
    assert ranks[0]["computed"] == ranks[1]["computed"]  # the same values on every process
    padding = [[w for w in r["warnings"] if "without `sample_ids`" in w] for r in ranks]
    assert len(padding[0]) == 1 and "counted twice" in padding[0][0]  # rank zero, once for both epochs
    assert padding[1] == []


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


@pytest.mark.slow
def test_compute_on_rank_zero_only_says_that_every_process_must_call_it(tmp_path):
    run_file(SCRIPTS / "retrieval_rank_zero.py", tmp_path, timeout=300, args=(_free_port(),))
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert result.startswith("RuntimeError: Every process must call `StreamingRetrievalMetric.compute()`"), result
    assert "not under `if trainer.is_global_zero`" in result
    assert "The first collective of compute() failed" in result  # the collective's own error is kept in the text
