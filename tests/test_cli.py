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
        (
            {"batch": "x", "config": 3, "snapshot": [], "environment": "NCCL_DEBUG=INFO", "report_errors": "boom"},
            "`config`",
        ),
        (
            {"batch": {"tensors": [{"path": "x"}, 4]}, "config": {"versions": "2.0", "allocator": [1]}},
            "## Failing batch",
        ),
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
        (lambda tmp: tmp, "no oom_report_rank*.json in this directory"),
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
    report = _report(
        environment={"LIGHTNING_CLOUD_URL": "https://alice:hunter2@cloud.example/api?token=t0k3n"},
        config={"logger_uri": "https://example.com/x?api_key=k3y&x=1", "precision": "32-true"},
        hparams={"lr": 0.1, "wandb_api_key": "abc123", "data": {"url": "s3://u:pw@bucket/data"}},
    )
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


def _cpu_step(t, step, rss, phase="train", **extra):
    return {
        "time": t,
        "rank": 0,
        "phase": phase,
        "event": "step",
        "epoch": 0,
        "global_step": step,
        "batch_idx": 0,
        "device": "cpu",
        "allocated_bytes": None,
        "host_rss_bytes": rss,
        **extra,
    }


def test_analyze_help_explains_growth_and_warnings(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["analyze", "--help"])
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for words in (
        "leaving out the first third of the steps (warm-up)",
        "at least 4 standard errors from zero",
        "at least twice the readings' scatter",
        '"too short to tell" when fewer than 10 readings spanning 100 steps',
        '"flat over steps A-B"',
        "each is listed with its text under the table",
        "marked on the plot with a labelled line",
    ):
        assert words in out


def test_analyze_prints_growth_verdicts_and_audit_findings(tmp_path, capsys):
    MiB = 1024**2
    records = [_cpu_step(float(s), s, 400 * MiB + s * MiB) for s in range(0, 401, 10)]  # a leak: 1 MiB per step
    records += [_cpu_step(500.0 + i, 400, 300 * MiB, phase="validate") for i in range(3)]  # 3 readings: no verdict
    message = (
        "MemoryAudit [rank 0]: Live tensor memory on cpu grows by 1.00 MiB per optimizer step (1048576"
        " bytes/step, 100.00 MiB over steps 200-300), first seen at step 210. Usual causes: a list of losses."
    )
    records.append(dict(_cpu_step(300.5, 300, 700 * MiB), event="warning", check="leak", message=message))
    path = _write(tmp_path, "memory_rank0.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    assert main(["analyze", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    lines = captured.out.splitlines()
    train = next(line for line in lines if line.startswith("0     train"))
    assert "1 leak" in train
    table = lines[: lines.index("warnings in the logs:")]
    assert max(map(len, table)) <= 100  # the sizes in the table, growth and peak on a line per row under it
    words = " ".join(" ".join(table).split())  # a long growth line wraps under itself
    assert "rank 0, train: growth +260.00 MiB over steps 140-400 (RSS); peak at step" in words
    assert "rank 0, validate: growth too short to tell (3 readings, all at step 400) (RSS); peak at" in words
    assert lines[lines.index("warnings in the logs:") + 1] == f"  rank 0, train, step 300, 300.5 s: leak: {message}"


def test_analyze_keeps_the_findings_of_runs_appended_to_one_file_apart(tmp_path, capsys):
    first = [dict(_cpu_step(float(s), s, 1000), run_id="a1") for s in range(1, 4)]
    second = [dict(_cpu_step(100.0 + s, s, 2000), run_id="b2") for s in range(1, 4)]
    second.append(
        dict(
            _cpu_step(102.5, 2, 2000),
            run_id="b2",
            event="warning",
            check="duplicates",
            message="MemoryAudit [rank 0] (fit start): 3 tensors on cpu mirror the parameters.",
        )
    )
    path = _write(tmp_path, "memory_rank0.jsonl", "".join(json.dumps(r) + "\n" for r in first + second))
    assert main(["analyze", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["rank", "run", "phase"]
    assert [line.split()[:2] for line in lines[2:4]] == [["0", "a1"], ["0", "b2"]]
    start = lines[0].index("warnings")
    assert [line[start:].strip() for line in lines[2:4]] == ["0", "1 duplicates"]
    # listed under its own run, its time counted from that run's first record
    assert lines[-1] == (
        "  rank 0, run b2, train, step 2, 1.5 s: duplicates: MemoryAudit [rank 0] (fit start): 3"
        " tensors on cpu mirror the parameters."
    )


_IMPORTS_AFTER_REPORT = (
    "import sys; from lightning_memopt.cli import main; code = main(['report', sys.argv[1]]);"
    " print('HEAVY', sorted(m for m in ('torch', 'lightning', 'pytorch_lightning') if m in sys.modules));"
    " sys.exit(code)"
)


def _heavy_modules_after_report(tmp_path):
    import subprocess
    import sys

    path = _write(tmp_path, "oom_report_rank0.json", json.dumps(_report()))
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORTS_AFTER_REPORT, str(path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# Out-of-memory report")
    return proc.stdout.splitlines()[-1]


@pytest.mark.slow
def test_report_starts_without_importing_lightning(tmp_path):
    heavy = _heavy_modules_after_report(tmp_path)
    assert heavy.startswith("HEAVY [") and "lightning" not in heavy


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True, reason="lightning_memopt.functional.oom (load_report, render_markdown) imports torch at module level"
)
def test_report_starts_without_importing_torch(tmp_path):
    assert _heavy_modules_after_report(tmp_path) == "HEAVY []"


@pytest.mark.parametrize("command", [[], ["analyze"], ["report"], ["estimate"]])
@pytest.mark.parametrize("columns", ["60", "100", "240"])
def test_every_help_fits_100_columns_without_markup(command, columns, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", columns)
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: lightning-memopt")
    assert max(map(len, text.splitlines())) <= 100
    assert "``" not in text
