"""Two-process DDP (gloo, CPU): an out-of-memory error on one rank ends the run, it never hangs it.

Every exported callback runs at its defaults. Rank 1 alone raises ``torch.OutOfMemoryError`` in forward or in
backward; the run must end by itself (about 15 s on 2 shared cores; the hang guard is 300 s, far below the process
group's 600 s time-out), rank 1 must write its report to the default directory, and the caller of ``trainer.fit``
on rank 1 must get the original error object.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.helpers.subprocess_run import SCRIPTS, run_file


@pytest.mark.slow
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_oom_on_one_rank_ends_the_run_with_a_report(tmp_path, where):
    start = time.monotonic()
    result = run_file(SCRIPTS / "oom_ddp_failure.py", tmp_path, timeout=420, args=(where,))
    elapsed = time.monotonic() - start
    output = result.stdout[-2000:] + result.stderr[-4000:]
    assert elapsed < 300, f"the run took {elapsed:.0f} s\n{output}"
    assert result.returncode != 0, output
    caught = json.loads((tmp_path / "caught_rank1.json").read_text())
    assert caught == {
        "type": "OutOfMemoryError",
        "is_oom": True,
        "message": f"CUDA out of memory. Tried to allocate 1.00 GiB (rank 1 only, in {where})",
    }, output
    reports = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("oom_report_rank*"))
    documented = [r for r in reports if "-" not in r.rsplit("/", 1)[1]]  # each report also has a name of its own
    assert documented == [
        "logs/lightning_logs/version_0/memopt/oom_report_rank1.json",
        "logs/lightning_logs/version_0/memopt/oom_report_rank1.md",
    ], output
    assert len(reports) == 4 and all("/memopt/oom_report_rank1" in r for r in reports), output
    reports = documented
    report = json.loads((tmp_path / reports[0]).read_text())
    assert report["when"]["rank"] == 1 and report["error"]["type"] == "torch.OutOfMemoryError"
    assert report["when"]["world_size"] == 2 and report["config"]["strategy"] == "DDPStrategy"
    assert report["config"]["effective_batch_size"] == 2 * report["config"]["micro_batch_size"]
