"""``lightning-memopt analyze``: the table, one warning or error line on stderr, exit codes, paths refused."""

import os

import pytest

from lightning_memopt.analysis import MemoryLogError, load_memory_log
from lightning_memopt.cli import main
from tests.helpers.analysis_logs import jsonl_text, step_records, write_good_log
from tests.helpers.pipes import PipeWatchdog


@pytest.fixture
def good_log(tmp_path):
    return write_good_log(tmp_path)


def test_cli_prints_summary_and_exit_codes(good_log, tmp_path, capsys):
    assert main(["analyze", str(good_log), "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0].split()
    assert header[:3] == ["rank", "phase", "readings"]
    assert any(line.split()[:2] == ["0", "train"] for line in out.splitlines())
    assert "plot:" in out and (tmp_path / "p.png").exists()

    assert main(["analyze", str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such file" in err and "Traceback" not in err

    bad = tmp_path / "bad.jsonl"
    bad.write_text("hello\n")
    assert main(["analyze", str(bad)]) == 2
    assert "line 1 is not JSON" in capsys.readouterr().err


@pytest.mark.slow
def test_console_script_runs_as_a_module(good_log):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "lightning_memopt.cli", "analyze", str(good_log)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "train" in proc.stdout


@pytest.mark.slow
def test_analyze_starts_without_importing_torch_or_lightning(good_log):
    import subprocess
    import sys

    code = (
        "import sys; from lightning_memopt.cli import main; code = main(['analyze', sys.argv[1]]);"
        " heavy = sorted(m for m in ('torch', 'lightning', 'pytorch_lightning') if m in sys.modules);"
        " print('HEAVY', heavy); sys.exit(code)"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(good_log)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout


def test_cli_prints_one_warning_line_and_the_summary(tmp_path, capsys):
    path = tmp_path / "memory_rank0.jsonl"
    path.write_text(
        jsonl_text(
            [
                *step_records(3),
                '{"time": 9, "rank": "zero", "phase": "train", "event": "step"}',
                '{"time": 1, "rank": 0, "allocated_bytes": NaN}',
                *step_records(2, t0=10),
                "[]",
            ]
        )
    )
    assert main(["analyze", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith(f"lightning-memopt analyze: warning: {path}: skipped 3 of 8 records (lines 4, 5, 8)")
    assert captured.out.splitlines()[0].split()[:3] == ["rank", "phase", "readings"]
    assert any(line.split()[:3] == ["0", "train", "5"] for line in captured.out.splitlines())


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("", "holds no memory records"),
        ("\n\n", "holds no memory records"),
        ("hello\n", "line 1 is not JSON"),
        ('{"time": NaN, "rank": 0, "phase": "train", "event": "step"}\n', "line 1 holds NaN"),
        ('[{"time": 1}]\n{"a": 1}\n', "line 1 is not a memory record"),
    ],
)
def test_cli_nothing_usable_exits_2_with_one_line(tmp_path, capsys, content, words):
    path = tmp_path / "memory_rank0.jsonl"
    path.write_text(content)
    assert main(["analyze", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lightning-memopt analyze: error: ") and str(path) in err
    assert words in err and "Traceback" not in err


def test_an_unusable_file_among_good_ones_is_left_out_with_a_warning(good_log, tmp_path, capsys):
    junk = tmp_path / "memory_rank1.jsonl"
    junk.write_text("rank,phase\n0,train\n")
    assert main(["analyze", str(good_log), str(junk)]) == 0
    captured = capsys.readouterr()
    assert captured.err == (
        f"lightning-memopt analyze: warning: {junk}: holds no usable memory records (line 1 is not JSON); left it out\n"
    )
    assert "train" in captured.out
    both_bad = tmp_path / "memory_rank2.jsonl"
    both_bad.write_text("")
    assert main(["analyze", str(junk), str(both_bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(junk) in err and str(both_bad) in err


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_cli_refuses_a_named_pipe_without_opening_it(good_log, tmp_path, capsys):
    fifo = tmp_path / "memory_rank1.jsonl"
    os.mkfifo(fifo)
    watchdog = PipeWatchdog(fifo)
    try:
        code = main(["analyze", str(good_log), str(fifo)])
    finally:
        watchdog.stop()
    assert not watchdog.fired, "the named pipe was opened"
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert f"{fifo}: is a named pipe, not a regular file" in err
    with pytest.raises(MemoryLogError, match="named pipe"):
        load_memory_log(fifo)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda tmp: tmp / "missing.jsonl", "no such file"),
        (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty", "no memory_rank*.jsonl in this directory"),
        (lambda tmp: tmp / "missing" / "memory_rank0.jsonl", "no such file"),
        (lambda tmp: tmp / "missing" / "memory_rank*.jsonl", "matches no file"),
        pytest.param(
            lambda tmp: "/dev/null",
            "is a character device",
            marks=pytest.mark.skipif(not os.path.exists("/dev/null"), reason="needs /dev/null"),
        ),
    ],
)
def test_cli_refuses_paths_that_are_not_regular_files(good_log, tmp_path, capsys, make, words):
    path = make(tmp_path)
    assert main(["analyze", str(good_log), str(path), "--plot", str(tmp_path / "out" / "p.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path}: {words}" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # refused before anything was created


@pytest.mark.parametrize(
    ("plot", "words"),
    [
        ("timeline.xyz", "matplotlib cannot write '.xyz' files; end the name with one of"),
        ("a_file.txt/timeline.png", "a_file.txt is a file, not a directory"),
        ("a_file.txt/deeper/timeline.png", "a_file.txt is a file, not a directory"),
        (".", "is a directory; name a file in it"),
    ],
)
def test_cli_refuses_a_bad_plot_path_before_reading_the_logs(tmp_path, capsys, monkeypatch, plot, words):
    import lightning_memopt.analysis.memory_log as memory_log

    (tmp_path / "a_file.txt").write_text("x")
    log = tmp_path / "memory_rank0.jsonl"
    log.write_text(jsonl_text(step_records(3)))
    monkeypatch.setattr(
        memory_log, "iter_memory_lines", lambda path: pytest.fail("read a log before checking the plot path")
    )
    target = tmp_path / plot
    assert main(["analyze", str(log), "--plot", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(target) in err and words in err and "Traceback" not in err


def test_cli_plot_directory_that_cannot_be_created(tmp_path, capsys, monkeypatch):
    from pathlib import Path

    def refuse(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    log = tmp_path / "memory_rank0.jsonl"
    log.write_text(jsonl_text(step_records(3)))
    monkeypatch.setattr(Path, "mkdir", refuse)
    target = tmp_path / "locked" / "p.png"
    assert main(["analyze", str(log), "--plot", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(target) in err and "cannot create the directory" in err
    assert "Permission denied" in err and "Traceback" not in err
