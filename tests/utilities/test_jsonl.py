"""JsonlWriter: whole lines only, never raises, warns once, notices a file that is no longer at its path."""

from __future__ import annotations

import errno
import json
import os
import pickle
import warnings
from types import SimpleNamespace

import pytest

from lightning_memopt.utilities import jsonl
from lightning_memopt.utilities.jsonl import JsonlWriter


def _record(step: int) -> dict:
    return {"time": float(step), "rank": 0, "phase": "train", "event": "step", "global_step": step}


def test_a_torn_last_line_is_left_alone_and_the_next_record_starts_a_fresh_line(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"a": 1}\n{"time": 3, "ra')
    writer = JsonlWriter(path)
    assert writer.write(_record(4)) and writer.write(_record(5))
    writer.close()
    lines = path.read_text().split("\n")
    assert lines[:2] == ['{"a": 1}', '{"time": 3, "ra']
    assert [json.loads(line)["global_step"] for line in lines[2:] if line] == [4, 5]


def test_a_file_that_ends_with_a_newline_gets_no_blank_line(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"a": 1}\n')
    writer = JsonlWriter(path)
    writer.write(_record(1))
    writer.close()
    assert path.read_text().count("\n\n") == 0 and len(path.read_text().splitlines()) == 2


def test_a_write_cut_short_by_a_full_disk_leaves_whole_lines_and_warns_once(tmp_path, monkeypatch):
    path = tmp_path / "log.jsonl"
    writer = JsonlWriter(path, owner="Tester")
    assert writer.write(_record(1))
    real_write = os.write

    def half_then_full(fd, data):
        if len(data) > 10:
            return real_write(fd, bytes(data[: len(data) // 2]))  # a short write: half the line reaches the file
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(jsonl, "os", SimpleNamespace(**{**vars(os), "write": half_then_full}))
    with pytest.warns(UserWarning, match=r"Tester: records from train step 2 on are not stored: .*No space left"):
        assert writer.write(_record(2)) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert writer.write(_record(3)) is False
    assert writer.stopped and writer.stopped_at == 2
    monkeypatch.undo()
    assert [json.loads(line)["global_step"] for line in path.read_text().splitlines()] == [1]
    assert path.read_text().endswith("\n")


def test_a_record_that_is_not_json_is_skipped_with_one_warning(tmp_path):
    path = tmp_path / "log.jsonl"
    writer = JsonlWriter(path, owner="Tester")
    with pytest.warns(UserWarning, match="Tester: a record could not be written as JSON"):
        assert writer.write({"value": float("nan")}) is False
    assert writer.write(_record(1)) and not writer.stopped
    writer.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [_record(1)]


@pytest.mark.parametrize("change", ["delete", "replace-directory"])
def test_a_file_no_longer_at_its_path_is_not_written_silently(tmp_path, change):
    directory = tmp_path / "memory"
    path = directory / "log.jsonl"
    writer = JsonlWriter(path, owner="Tester")
    writer.write(_record(1))
    if change == "delete":
        path.unlink()
    else:
        path.unlink()
        directory.rmdir()
        directory.write_text("now a file")
    with pytest.warns(UserWarning, match="Tester: records from train step 2 on are not stored: .*no longer exists"):
        assert writer.write(_record(2)) is False
    assert not path.exists()


def test_never_raises_where_the_directory_cannot_be_made(tmp_path):
    (tmp_path / "file").write_text("x")
    writer = JsonlWriter(tmp_path / "file" / "log.jsonl")
    with pytest.warns(UserWarning, match="records from train step 1 on are not stored"):
        assert writer.write(_record(1)) is False
    writer.close()
    writer.close()  # closing twice is fine


def test_pickling_drops_the_open_file_and_the_copy_writes_on(tmp_path):
    path = tmp_path / "log.jsonl"
    writer = JsonlWriter(path)
    writer.write(_record(1))
    copy = pickle.loads(pickle.dumps(writer))
    writer.close()
    assert copy.write(_record(2))
    copy.close()
    assert [json.loads(line)["global_step"] for line in path.read_text().splitlines()] == [1, 2]


def test_writers_of_one_path_share_one_open_file_until_the_last_closes(tmp_path):
    path = tmp_path / "memory_rank0.jsonl"
    monitor, audit = JsonlWriter(path, owner="MemoryMonitor"), JsonlWriter(tmp_path / "." / "memory_rank0.jsonl")
    assert monitor.write(_record(1)) and audit.write({"event": "audit"}) and monitor.write(_record(2))
    assert monitor._file is audit._file and monitor._file.users == 2  # one descriptor for the path
    fd = monitor._file.fd
    monitor.close()
    os.fstat(fd)  # still open: the audit writes on
    assert audit.write(_record(3))
    audit.close()
    with pytest.raises(OSError):
        os.fstat(fd)  # the last writer closed it
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r.get("global_step", r.get("event")) for r in lines] == [1, "audit", 2, 3]


def test_each_writer_of_a_shared_file_warns_with_its_own_name(tmp_path, monkeypatch):
    path = tmp_path / "log.jsonl"
    first, second = JsonlWriter(path, owner="First"), JsonlWriter(path, owner="Second")
    assert first.write(_record(1)) and second.write(_record(1))

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(jsonl, "os", SimpleNamespace(**{**vars(os), "write": full}))
    with pytest.warns(UserWarning) as caught:
        assert first.write(_record(2)) is False and second.write(_record(3)) is False
    messages = [str(w.message) for w in caught]
    assert [m.split(":")[0] for m in messages] == ["First", "Second"]
    assert "train step 2" in messages[0] and "train step 3" in messages[1]
    monkeypatch.undo()
    first.close()
    second.close()


# ------------------------------------------------------------------------------------------------ planted links
def _plant_link(tmp_path):
    """``(log path, target)``: the log path is a symbolic link to a file outside the log's folder."""
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "victim.txt"
    target.write_text("precious\n")
    folder = tmp_path / "memory"
    folder.mkdir()
    path = folder / "memory_rank0.jsonl"
    path.symlink_to(target)
    return path, target


@pytest.mark.parametrize("race", [False, True], ids=["planted-before-open", "planted-after-the-check"])
def test_a_planted_symlink_is_never_followed_and_warns_once_with_the_fix(tmp_path, monkeypatch, race):
    path, target = _plant_link(tmp_path)
    if race:  # the link appears between the check and the open: O_NOFOLLOW refuses it
        monkeypatch.setattr(jsonl, "check_regular_file", lambda name, path: None)
    writer = JsonlWriter(path, owner="Tester")
    with pytest.warns(UserWarning) as caught:
        assert writer.write(_record(1)) is False
    (message,) = [str(w.message) for w in caught]
    assert message.startswith("Tester: records from train step 1 on are not stored")
    assert str(path) in message and "symbolic link" in message and "Remove the link" in message, message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning, then silence
        assert writer.write(_record(2)) is False
    writer.close()
    assert target.read_text() == "precious\n"  # the target is unchanged
    assert path.is_symlink()


def test_a_hard_link_to_another_file_is_not_appended_to(tmp_path):
    target = tmp_path / "victim.txt"
    target.write_text("precious\n")
    path = tmp_path / "memory_rank0.jsonl"
    os.link(target, path)
    writer = JsonlWriter(path, owner="Tester")
    with pytest.warns(UserWarning, match="hard link"):
        assert writer.write(_record(1)) is False
    writer.close()
    assert target.read_text() == "precious\n"


def test_a_rank_log_writer_is_kept_for_its_own_path_and_replaced_for_another(tmp_path):
    """Fitting twice into one directory appends through the writer already open; another directory gets a new writer
    and the old one lets go of its file."""
    trainer = SimpleNamespace(default_root_dir=str(tmp_path))
    first = jsonl.rank_log_writer(trainer, tmp_path / "a", 0, None, "MemoryMonitor")
    assert first.write(_record(1))
    assert jsonl.rank_log_writer(trainer, tmp_path / "a", 0, first, "MemoryMonitor") is first
    assert first._file is not None  # still open: the second fit appends to it
    other = jsonl.rank_log_writer(trainer, tmp_path / "b", 0, first, "MemoryMonitor")
    assert other is not first and other.path == tmp_path / "b" / "memory_rank0.jsonl"
    assert first._file is None  # let go
