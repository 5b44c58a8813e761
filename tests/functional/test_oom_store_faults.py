"""functional.oom.store after a writer was killed mid-report: no claim file is left behind (release 0.2, faults).

A real writer process is killed with SIGKILL while it holds a claim; the next reservation in the directory removes
the claim. Claims made by hand cover the other cases: an owner of this host that ended, a claim whose report exists,
an empty one, one older than an hour, and one whose writer is still at work (kept).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from lightning_memopt.functional.oom.store import STALE_CLAIM_S, clear_stale_claims, reserve_report, save_report
from lightning_memopt.utilities.trainer import host_name
from tests.helpers.subprocess_run import REPO_ROOT

T0 = 1_735_732_800.0  # 2025-01-01T12:00:00Z

_WRITER = """
import sys, time
from pathlib import Path
from lightning_memopt.functional.oom.store import reserve_report

slot = reserve_report(Path(sys.argv[1]), 0, 1_735_732_800.0)
slot.paths["json"].with_suffix(".partial").write_text("half a report")  # writing...
print("claimed", flush=True)
time.sleep(600)  # killed here, before the report is complete and the claim released
"""


def _claims(directory):
    return sorted(name for name in os.listdir(directory) if name.endswith(".claim"))


def _save(directory, when_time):
    slot = reserve_report(directory, 0, when_time)
    try:
        report = {"format": "lightning-memopt/oom-report/1", "when": {"time": when_time, "rank": 0}}
        assert save_report(slot, report, lambda r: "# report\n") == []
    finally:
        slot.release()
    return slot


def test_a_writer_killed_mid_report_leaves_a_claim_that_the_next_reservation_removes(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    code = textwrap.dedent(_WRITER)
    with subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True) as p:
        try:
            assert p.stdout is not None and p.stdout.readline().strip() == "claimed"
            assert len(_claims(tmp_path)) == 1  # its claim, while it writes
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=300)
    assert len(_claims(tmp_path)) == 1  # killed: the claim stays, with the writer's host and process id in it
    slot = _save(tmp_path, T0 + 1)
    assert _claims(tmp_path) == []
    assert slot.paths["json"].exists()


def _claim_by_hand(directory, name, text, age_s=0.0):
    path = directory / f".oom_report_rank0-20250101T120000.000000Z-{name}.claim"
    path.write_text(text)
    if age_s:
        moment = time.time() - age_s
        os.utime(path, (moment, moment))
    return path


def _ended_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=300)
    return proc.pid


def test_claims_of_gone_or_done_writers_are_removed_and_a_working_writer_s_claim_is_kept(tmp_path):
    here = host_name()
    ended = _claim_by_hand(tmp_path, "1-0", f"{here}\n{_ended_pid()}\n")
    done = _claim_by_hand(tmp_path, "2-0", f"{here}\n{os.getpid()}\n")
    (tmp_path / f"{done.name[1 : -len('.claim')]}.json").write_text("{}")  # its report is there
    empty_old = _claim_by_hand(tmp_path, "3-0", "", age_s=120)
    other_host_old = _claim_by_hand(tmp_path, "4-0", "another-host\n4\n", age_s=STALE_CLAIM_S + 60)
    working = _claim_by_hand(tmp_path, "5-0", f"{here}\n{os.getpid()}\n")  # this process: alive, at work
    empty_new = _claim_by_hand(tmp_path, "6-0", "")  # its writer is about to write its owner into it
    other_host_new = _claim_by_hand(tmp_path, "7-0", "another-host\n4\n")
    removed = clear_stale_claims(tmp_path)
    assert sorted(removed) == sorted([ended, done, empty_old, other_host_old])
    assert _claims(tmp_path) == sorted(p.name for p in (working, empty_new, other_host_new))


def test_a_claim_names_its_owner_and_is_gone_once_the_report_is_written(tmp_path):
    slot = reserve_report(tmp_path, 0, T0)
    (claim,) = _claims(tmp_path)
    assert (tmp_path / claim).read_text().splitlines() == [host_name(), str(os.getpid())]
    slot.release()
    _save(tmp_path, T0)
    assert _claims(tmp_path) == []
