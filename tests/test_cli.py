"""The ``lightning-memopt`` command line on bad input: exit code 2 and one line on stderr, never a traceback."""

import json
import os

import pytest

from lightning_memopt import cli
from lightning_memopt.cli import main
from lightning_memopt.functional.oom import REPORT_FORMAT
from tests.helpers.pipes import PipeWatchdog


def _report(**overrides):
    report = {
        "format": REPORT_FORMAT,
        "when": {"time": 0.0, "rank": 0, "world_size": 1, "stage": "train", "global_step": 3},
        "error": {"type": "torch.OutOfMemoryError", "message": "CUDA out of memory."},
        "memory": {"allocated_bytes": 1024, "reserved_bytes": 2048},
        "holders": {"device": "cuda:0", "bytes_by_category": {"parameters": 512}, "unexplained_bytes": 512},
        "suggestions": [{"rank": 1, "action": "Do X", "why": "Because Y.", "saves_bytes": 10}],
    }
    report.update(overrides)
    return report


def _one_error_line(err, name):
    assert err.count("\n") == 1, err
    assert err.startswith("lightning-memopt report: error: ") and name in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------------------- report


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"when": "x"}, "`when`"),
        ({"when": [1, 2]}, "`when`"),
        ({"error": "x"}, "`error`"),
        ({"suggestions": "x"}, "`suggestions`"),
        ({"suggestions": [1, "two", None]}, "`suggestions[0]` (expected an object, got a number): 1"),
        ({"suggestions": [{"rank": 1, "action": "Do X"}, 7]}, "Do X"),
        ({"memory": []}, "## Who holds memory"),
        ({"memory": [1, 2]}, "`memory`"),
        ({"memory": {"allocated_bytes": "lots", "summary": 5}}, "lots"),
        ({"holders": 5}, "`holders`"),
        ({"holders": {"bytes_by_category": [1], "rows": "x", "top_tensors": [3]}}, "## Who holds memory"),
        ({"batch": "x", "config": 3, "snapshot": [], "environment": "NCCL_DEBUG=INFO", "report_errors": "boom"},
         "`config`"),
        ({"batch": {"tensors": [{"path": "x"}, 4]}, "config": {"versions": "2.0", "allocator": [1]}},
         "## Failing batch"),
    ],
)
def test_report_with_fields_of_the_wrong_type_still_renders(tmp_path, capsys, overrides, expected):
    path = tmp_path / "oom_report_rank0.json"
    path.write_text(json.dumps(_report(**overrides)))
    assert main(["report", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("# Out-of-memory report")
    assert expected in captured.out
    assert "Traceback" not in captured.err


def _write(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    return path


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda tmp: _write(tmp, "list.json", "[1, 2]"), "not an out-of-memory report"),
        (lambda tmp: _write(tmp, "bad.json", "{not json"), "not valid JSON"),
        (lambda tmp: _write(tmp, "empty.json", ""), "not valid JSON"),
        (lambda tmp: _write(tmp, "str.json", '"a string"'), "not an out-of-memory report"),
        (lambda tmp: _write(tmp, "nan.json", '{"format": NaN}'), "not an out-of-memory report"),
        (lambda tmp: tmp, "is a directory"),
        (lambda tmp: tmp / "missing.json", "no such file"),
    ],
)
def test_report_that_cannot_be_read_exits_2_with_one_line(tmp_path, capsys, make, words):
    path = make(tmp_path)
    assert main(["report", str(path)]) == 2
    captured = capsys.readouterr()
    _one_error_line(captured.err, str(path))
    assert words in captured.err and captured.out == ""


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_report_refuses_a_named_pipe_without_opening_it(tmp_path, capsys):
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)  # opening it for reading would wait for a writer forever
    watchdog = PipeWatchdog(fifo)
    try:
        code = main(["report", str(fifo)])
    finally:
        watchdog.stop()
    assert not watchdog.fired, "the named pipe was opened"
    assert code == 2
    err = capsys.readouterr().err
    _one_error_line(err, str(fifo))
    assert "not a regular file" in err


def test_report_catches_any_rendering_error(tmp_path, capsys, monkeypatch):
    import lightning_memopt.functional.oom as oom

    def broken(report):
        raise KeyError("boom")

    monkeypatch.setattr(oom, "render_markdown", broken)
    path = _write(tmp_path, "r.json", json.dumps(_report()))
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    _one_error_line(err, str(path))
    assert "KeyError" in err


def test_report_redacts_credentials(tmp_path, capsys):
    report = _report(environment={"LIGHTNING_CLOUD_URL": "https://alice:hunter2@cloud.example/api?token=t0k3n"},
                     config={"logger_uri": "https://example.com/x?api_key=k3y&x=1", "precision": "32-true"},
                     hparams={"lr": 0.1, "wandb_api_key": "abc123", "data": {"url": "s3://u:pw@bucket/data"}})
    path = _write(tmp_path, "r.json", json.dumps(report))
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    for secret in ("hunter2", "t0k3n", "k3y", "abc123", ":pw@"):
        assert secret not in out
    assert "https://alice:<redacted>@cloud.example/api?token=<redacted>" in out
    assert "?api_key=<redacted>&x=1" in out


# ---------------------------------------------------------------------------------------------------- analyze


def test_analyze_catches_any_unexpected_error(tmp_path, capsys, monkeypatch):
    import lightning_memopt.analysis.memory_log as memory_log

    def broken(paths, plot=None):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(memory_log, "analyze_memory_logs", broken)
    log = _write(tmp_path, "memory_rank0.jsonl", '{"time": 1, "rank": 0, "phase": "train", "event": "step"}\n')
    assert main(["analyze", str(log)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lightning-memopt analyze: error: ") and str(log) in err
    assert "ZeroDivisionError" in err and "Traceback" not in err


def test_module_exports_only_main():
    assert cli.__all__ == ["main"]
