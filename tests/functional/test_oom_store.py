"""functional.oom.store: every report under a name of its own, the documented names on the newest."""

import errno
import json
import os

from lightning_memopt.functional.oom import store
from lightning_memopt.functional.oom.store import newest_reports, reserve_report, save_report

T0 = 1_735_732_800.0  # 2025-01-01T12:00:00Z


def _save(directory, rank, when_time, snapshot=False, tag=""):
    slot = reserve_report(directory, rank, when_time)
    try:
        if snapshot:
            slot.paths["pickle"].write_bytes(b"snapshot " + tag.encode())
        report = {"format": "lightning-memopt/oom-report/1", "when": {"time": when_time, "rank": rank}, "tag": tag}
        assert save_report(slot, report, lambda r: f"# {r['tag']}\n") == []
    finally:
        slot.release()
    return slot.paths


def _tag(path):
    return json.loads(path.read_text())["tag"]


def test_the_documented_names_follow_the_newest_failure_not_the_last_writer(tmp_path):
    _save(tmp_path, 0, T0 + 10, snapshot=True, tag="newest")
    older = _save(tmp_path, 0, T0, tag="older")  # written last, failed first
    assert _tag(tmp_path / "oom_report_rank0.json") == "newest"
    assert (tmp_path / "oom_report_rank0.md").read_text() == "# newest\n"
    assert (tmp_path / "oom_snapshot_rank0.pickle").read_bytes() == b"snapshot newest"
    assert _tag(older["json"]) == "older" and older["json"].name.startswith("oom_report_rank0-20250101T120000.0")
    # a newer report without a snapshot: the documented snapshot name no longer points at an older one
    _save(tmp_path, 0, T0 + 20, tag="third")
    assert _tag(tmp_path / "oom_report_rank0.json") == "third"
    assert not (tmp_path / "oom_snapshot_rank0.pickle").exists()
    assert len(list(tmp_path.glob("oom_snapshot_rank0-*.pickle"))) == 1  # the kept snapshot stays


def test_newest_reports_gives_the_newest_of_each_rank(tmp_path):
    for rank, moment, tag in [(1, T0 + 5, "r1 new"), (0, T0 + 1, "r0 old"), (0, T0 + 3, "r0 new"), (1, T0, "r1 old")]:
        _save(tmp_path, rank, moment, tag=tag)
    assert [_tag(p) for p in newest_reports(tmp_path)] == ["r0 new", "r1 new"]
    # an older version's report at the documented name only (a plain file) counts by its modification time
    other = tmp_path / "other"
    other.mkdir()
    (other / "oom_report_rank2.json").write_text(json.dumps({"tag": "plain"}))
    assert [_tag(p) for p in newest_reports(other)] == ["plain"]


def test_without_hard_links_copies_are_used_and_no_report_is_kept_twice(tmp_path, monkeypatch):
    def refuse(source, target):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(store.os, "link", refuse)
    for i in range(3):
        _save(tmp_path, 0, T0 + i, tag=f"report {i}")
    assert _tag(tmp_path / "oom_report_rank0.json") == "report 2"
    assert os.stat(tmp_path / "oom_report_rank0.json").st_nlink == 1  # a copy
    kept = sorted(tmp_path.glob("oom_report_rank0-*.json"))
    assert [_tag(p) for p in kept] == ["report 0", "report 1", "report 2"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_a_taken_name_moves_on_to_the_next(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "_COUNTER", iter([0, 0, 1]))
    monkeypatch.setattr(store.os, "getpid", lambda: 42)
    first = reserve_report(tmp_path, 0, T0)
    second = reserve_report(tmp_path, 0, T0)  # same time, process and counter: the claim file refuses it
    assert first.paths["json"].name == "oom_report_rank0-20250101T120000.000000Z-42-0.json"
    assert second.paths["json"].name == "oom_report_rank0-20250101T120000.000000Z-42-1.json"
    first.release()
    second.release()
    assert list(tmp_path.iterdir()) == []


def test_a_directory_where_no_claim_can_be_made_still_gets_a_name_and_the_write_reports_the_failure(
    tmp_path, monkeypatch
):
    real_open = store.os.open

    def full_disk(path, flags, mode=0o777):
        if str(path).endswith(".claim"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, flags, mode)

    monkeypatch.setattr(store.os, "open", full_disk)
    slot = reserve_report(tmp_path, 0, T0)
    assert slot.paths["json"].name.startswith("oom_report_rank0-20250101T120000.000000Z-")
    assert save_report(slot, {"when": {"time": T0}, "tag": "x"}, lambda r: "# x\n") == []
    slot.release()
    assert _tag(tmp_path / "oom_report_rank0.json") == "x"
