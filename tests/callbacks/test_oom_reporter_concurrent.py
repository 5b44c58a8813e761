"""OOMReporter: writers sharing one ``dirpath`` at the same instant (two jobs, both rank 0; threads) lose nothing."""

import json
import multiprocessing
import os
import re
import threading
import time

import pytest
import torch

from lightning_memopt import OOMReporter
from lightning_memopt.cli import main as cli_main
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer

WRITERS = 8


def _kept(directory, ext=".json"):
    return sorted(n for n in os.listdir(directory) if re.fullmatch(rf"oom_report_rank0-.+\{ext}", n))


def _report_at_barrier(directory, barrier, index):
    """One job: rank 0, out of memory at the moment every writer passes the barrier."""
    model = TinyModel()
    trainer = make_trainer(directory)
    reporter = OOMReporter(dirpath=directory, max_listed=0)
    reporter.setup(trainer, model, "fit")
    error = torch.OutOfMemoryError(f"CUDA out of memory. (writer {index})")
    barrier.wait(timeout=60)
    reporter.on_exception(trainer, model, error)
    if reporter.state_dict()["num_reports"] != 1:
        raise SystemExit(3)


def _check_every_report_kept(directory, count, capsys):
    kept = _kept(directory)
    reports = {name: json.loads((directory / name).read_text()) for name in kept}
    messages = sorted(r["error"]["message"] for r in reports.values())
    assert messages == sorted(f"CUDA out of memory. (writer {i})" for i in range(count)), kept
    assert len(_kept(directory, ".md")) == count
    assert not [n for n in os.listdir(directory) if n.startswith(".")], "claim or temporary files left behind"
    # the documented names are the newest report by its failure time (ties: either of them)
    latest = max(r["when"]["time"] for r in reports.values())
    newest = [name for name, r in reports.items() if r["when"]["time"] == latest]
    documented = directory / "oom_report_rank0.json"
    assert any(os.path.samefile(documented, directory / name) for name in newest), (newest, documented)
    markdown = (directory / "oom_report_rank0.md").read_text()
    assert markdown == (directory / (newest[0][:-5] + ".md")).read_text() or len(newest) > 1
    # `report DIR` prints the newest
    assert cli_main(["report", str(directory)]) == 0
    out = capsys.readouterr().out
    assert out in [(directory / (n[:-5] + ".md")).read_text() for n in newest]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="starts the writers with fork")
def test_processes_reporting_into_one_dirpath_at_the_same_instant_keep_every_report(tmp_path, capsys):
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(WRITERS)
    writers = [context.Process(target=_report_at_barrier, args=(tmp_path, barrier, i)) for i in range(WRITERS)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=120)
    assert [w.exitcode for w in writers] == [0] * WRITERS
    _check_every_report_kept(tmp_path, WRITERS, capsys)


def test_threads_reporting_into_one_dirpath_at_the_same_instant_keep_every_report(tmp_path, capsys):
    barrier = threading.Barrier(WRITERS)
    failures = []

    def run(index):
        try:
            _report_at_barrier(tmp_path, barrier, index)
        except BaseException as err:  # pragma: no cover - shown by the assertion below
            failures.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(WRITERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert failures == []
    _check_every_report_kept(tmp_path, WRITERS, capsys)


def test_a_report_from_an_older_version_is_kept_when_a_new_one_comes(tmp_path, capsys):
    old = {"format": "lightning-memopt/oom-report/1", "when": {"time": time.time() - 3600, "rank": 0}}
    (tmp_path / "oom_report_rank0.json").write_text(json.dumps(old))  # a plain file, linked from nowhere
    (tmp_path / "oom_report_rank0.md").write_text("# the old report\n")
    barrier = threading.Barrier(1)
    _report_at_barrier(tmp_path, barrier, 0)
    kept = _kept(tmp_path)
    assert len(kept) == 2
    assert sorted(json.loads((tmp_path / n).read_text())["when"]["time"] for n in kept)[0] == old["when"]["time"]
    assert "# the old report\n" in [(tmp_path / n).read_text() for n in _kept(tmp_path, ".md")]
    assert "writer 0" in json.loads((tmp_path / "oom_report_rank0.json").read_text())["error"]["message"]
