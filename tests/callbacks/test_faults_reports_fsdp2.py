"""Faults (release 0.2): every rank writes its out-of-memory report when one runs out of memory inside FSDP's own
collective, under Lightning's own launcher, which kills every process within 5 s of one ending with an error.

Rank 1's reduce-scatter runs out of memory inside the collective (``tests/scripts/fsdp2_slow_report.py``); rank 0,
left waiting in that collective, takes 6 s to write its report, longer than the launcher's 5 s period: its report is
written while rank 1 still lives, and rank 1's caller still gets rank 1's own error.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.subprocess_run import SCRIPTS, run_file

SLOW_REPORT_S = 6  # longer than the period of Lightning's _ChildProcessObserver (5 s)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("slow_report")
    result = run_file(SCRIPTS / "fsdp2_slow_report.py", directory, timeout=600, args=(str(SLOW_REPORT_S),))
    return directory, result


@pytest.mark.slow
def test_both_ranks_report_and_rank_1_s_caller_gets_its_own_error(run):
    directory, result = run
    output = result.stdout[-2000:] + result.stderr[-4000:]
    assert result.returncode != 0, output  # the out-of-memory error ends the run
    caught = json.loads((directory / "caught_rank1.json").read_text())
    assert caught["type"] == "OutOfMemoryError" and caught["original"], caught  # the object the collective raised
    assert caught["message"].startswith("simulated: inside the reduce-scatter") and caught["unrecoverable"]
    reports = directory / "reports"
    names = sorted(p.name for p in reports.glob("oom_report_rank*.json") if "-" not in p.name)
    assert names == ["oom_report_rank0.json", "oom_report_rank1.json"], output
    mine, peer = (json.loads((reports / f"oom_report_rank{r}.json").read_text()) for r in (1, 0))
    assert mine["error"]["type"] == "torch.OutOfMemoryError" and mine["when"]["rank"] == 1
    assert peer["error"]["type"].endswith("PeerCollectiveOutOfMemoryError") and peer["when"]["rank"] == 0
    assert "rank 1 (" in peer["error"]["message"] and "inside the reduce-scatter" in peer["error"]["message"]
    assert peer["sharding"]["kind"] == "fsdp2" and peer["when"]["stage"] == "train"
