import json

import pytest

from lightning_memopt.analysis import (
    MemoryLogError,
    analyze_memory_logs,
    load_memory_log,
    summarize_memory_log,
)
from lightning_memopt.cli import main


def rec(t, phase, event, step, alloc=None, peak=None, rank=0, **extra):
    return {"time": t, "rank": rank, "phase": phase, "event": event, "epoch": 0, "global_step": step,
            "batch_idx": None, "device": "cuda:0", "allocated_bytes": alloc, "reserved_bytes": None if alloc is None
            else alloc * 2, "peak_allocated_bytes": peak, "device_total_bytes": 10_000, "host_rss_bytes": 50,
            **extra}


def write(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


@pytest.fixture
def good_log(tmp_path):
    records = [rec(0.0, "train", "phase_start", 0, 100, 100)]
    records += [rec(float(s), "train", "step", s, 100 + 3 * s, 100 + 3 * s + 50) for s in range(10, 110, 10)]
    records += [rec(4.5, "validate", "phase_start", 40, 200, 200), rec(4.6, "validate", "step", 40, 2000, 2500),
                rec(4.7, "validate", "phase_end", 40, 200, 2500, phase_peak_allocated_bytes=2500),
                rec(5.0, "train", "warning", 50, 9500, field="allocated_bytes"),
                rec(11.0, "train", "phase_end", 100, 400, 700, phase_peak_allocated_bytes=9600)]
    return write(tmp_path / "memory_rank0.jsonl", records)


def test_summary_per_phase(good_log):
    summaries = {s.phase: s for s in summarize_memory_log(load_memory_log(good_log))}
    train, val = summaries["train"], summaries["validate"]
    assert train.num_readings == 10
    assert train.peak_allocated_bytes == 9600 and train.peak_global_step == 100
    assert train.growth_bytes_per_1k_steps == pytest.approx(3000.0)
    assert train.growth_field == "allocated_bytes"
    assert train.mean_allocated_bytes == pytest.approx(sum(100 + 3 * s for s in range(10, 110, 10)) / 10)
    assert train.warnings == 1 and val.warnings == 0
    assert val.peak_allocated_bytes == 2500 and val.peak_global_step == 40 and val.peak_seconds == pytest.approx(4.6)
    assert train.device_total_bytes == 10_000


def test_cpu_log_falls_back_to_host_rss(tmp_path):
    records = [dict(rec(float(s), "train", "step", s), host_rss_bytes=1000 + s, device="cpu") for s in (1, 2, 3)]
    s = summarize_memory_log(load_memory_log(write(tmp_path / "m.jsonl", records)))[0]
    assert s.peak_allocated_bytes is None
    assert s.peak_host_rss_bytes == 1003 and s.peak_global_step == 3
    assert s.growth_field == "host_rss_bytes" and s.growth_bytes_per_1k_steps == pytest.approx(1000.0)


def test_growth_leaves_out_the_warm_up():
    # a climb over the first steps (data, optimizer state, cache arriving), then flat: no growth
    warm = [rec(float(s), "train", "step", s, 100 + 100 * s) for s in range(1, 6)]
    flat = [rec(float(s), "train", "step", s, 600) for s in range(6, 16)]
    s = summarize_memory_log(warm + flat)[0]
    assert s.growth_bytes_per_1k_steps == pytest.approx(0.0)
    leak = [rec(float(s), "train", "step", s, 600 + 7 * s) for s in range(6, 16)]
    s = summarize_memory_log(warm + leak)[0]
    assert s.growth_bytes_per_1k_steps == pytest.approx(7000.0)


def test_truncated_last_line_is_skipped_with_a_warning(tmp_path):
    path = write(tmp_path / "m.jsonl", [rec(1.0, "train", "step", 1, 10), rec(2.0, "train", "step", 2, 20)],
                 tail='{"time": 3.0, "rank": 0, "pha')
    with pytest.warns(UserWarning, match="line 3 is truncated"):
        records = load_memory_log(path)
    assert [r["global_step"] for r in records] == [1, 2]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("", "holds no memory records"),
        ("not json at all\n", "line 1 is not JSON"),
        ('{"a": 1}\n', "line 1 is not a memory record"),
        ('[1, 2]\n', "line 1 is not a memory record"),
        ('{"time": 1, "rank": 0, "phase": "train", "event": "step"}\ngarbage\n{"time": 1, "rank": 0, "phase": "t", '
         '"event": "s"}\n', "line 2 is not JSON"),
    ],
)
def test_bad_files_raise_one_clear_error(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(MemoryLogError, match=match):
        load_memory_log(path)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(MemoryLogError, match="no such file"):
        load_memory_log(tmp_path / "nope.jsonl")
    with pytest.raises(MemoryLogError, match="is a directory"):
        load_memory_log(tmp_path)


def test_plot_is_written(good_log, tmp_path):
    other = write(tmp_path / "memory_rank1.jsonl", [dict(r, rank=1) for r in load_memory_log(good_log)])
    summaries, text = analyze_memory_logs([good_log, other], plot=tmp_path / "out" / "timeline.png")
    assert {s.rank for s in summaries} == {0, 1}
    png = tmp_path / "out" / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"plot: {png}" in text


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


def test_console_script_runs_as_a_module(good_log):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "lightning_memopt.cli", "analyze", str(good_log)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "train" in proc.stdout
