import json
import os
import random
import warnings

import pytest

from lightning_memopt.analysis import (
    MemoryLogError,
    analyze_memory_logs,
    format_summary,
    load_memory_log,
    plot_memory_timeline,
    summarize_memory_log,
)
from lightning_memopt.cli import main
from tests.helpers.pipes import PipeWatchdog
from tests.helpers.plots import plotted_figure


def rec(t, phase, event, step, alloc=None, peak=None, rank=0, **extra):
    return {
        "time": t,
        "rank": rank,
        "phase": phase,
        "event": event,
        "epoch": 0,
        "global_step": step,
        "batch_idx": None,
        "device": "cuda:0",
        "allocated_bytes": alloc,
        "reserved_bytes": None if alloc is None else alloc * 2,
        "peak_allocated_bytes": peak,
        "device_total_bytes": 10_000,
        "host_rss_bytes": 50,
        **extra,
    }


def write(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


TRAIN_STEPS = range(10, 410, 10)  # 40 readings over 390 steps: enough to judge growth


@pytest.fixture
def good_log(tmp_path):
    records = [rec(0.0, "train", "phase_start", 0, 100, 100)]
    records += [rec(float(s), "train", "step", s, 100 + 3 * s, 100 + 3 * s + 50) for s in TRAIN_STEPS]
    records += [
        rec(4.5, "validate", "phase_start", 40, 200, 200),
        rec(4.6, "validate", "step", 40, 2000, 2500),
        rec(4.7, "validate", "phase_end", 40, 200, 2500, phase_peak_allocated_bytes=2500),
        rec(5.0, "train", "warning", 50, 9500, field="allocated_bytes"),
        rec(411.0, "train", "phase_end", 400, 400, 700, phase_peak_allocated_bytes=9600),
    ]
    return write(tmp_path / "memory_rank0.jsonl", records)


def test_summary_per_phase(good_log):
    summaries = {s.phase: s for s in summarize_memory_log(load_memory_log(good_log))}
    train, val = summaries["train"], summaries["validate"]
    assert train.num_readings == 40
    assert train.peak_allocated_bytes == 9600 and train.peak_global_step == 400
    assert train.growth == "growing" and train.growth_bytes_per_1k_steps == pytest.approx(3000.0)
    # the first third of the steps (the warm-up) is left out: 140-400 is fitted
    assert (train.growth_readings, train.growth_first_step, train.growth_last_step) == (27, 140, 400)
    assert train.growth_field == "allocated_bytes"
    assert train.mean_allocated_bytes == pytest.approx(sum(100 + 3 * s for s in TRAIN_STEPS) / 40)
    assert train.warnings == 1 and val.warnings == 0
    assert train.warnings_by_check == {"threshold": 1}
    assert val.peak_allocated_bytes == 2500 and val.peak_global_step == 40 and val.peak_seconds == pytest.approx(4.6)
    assert val.growth == "too short" and val.growth_bytes_per_1k_steps is None
    assert train.device_total_bytes == 10_000


def test_cpu_log_falls_back_to_host_rss(tmp_path):
    records = [
        dict(rec(float(s), "train", "step", s), host_rss_bytes=1000 + s, device="cpu") for s in range(0, 401, 10)
    ]
    s = summarize_memory_log(load_memory_log(write(tmp_path / "m.jsonl", records)))[0]
    assert s.peak_allocated_bytes is None
    assert s.peak_host_rss_bytes == 1400 and s.peak_global_step == 400
    assert s.growth_field == "host_rss_bytes" and s.growth_bytes_per_1k_steps == pytest.approx(1000.0)


def test_growth_leaves_out_the_warm_up():
    # a climb over the first quarter (data, optimizer state, cache arriving), then flat: no growth
    warm = [rec(float(s), "train", "step", s, 100 + 100 * s) for s in range(1, 101)]
    flat = [rec(float(s), "train", "step", s, 10_100) for s in range(101, 401)]
    s = summarize_memory_log(warm + flat)[0]
    assert s.growth == "flat" and s.growth_bytes_per_1k_steps is None
    # past the first third (134), at the next boundary of the step buckets the fit keeps (8 steps wide here)
    assert (s.growth_first_step, s.growth_last_step) == (136, 400)
    leak = [rec(float(s), "train", "step", s, 10_100 + 7 * (s - 100)) for s in range(101, 401)]
    s = summarize_memory_log(warm + leak)[0]
    assert s.growth == "growing" and s.growth_bytes_per_1k_steps == pytest.approx(7000.0)


# ---------------------------------------------------------------------------------------------------- growth

MiB = 1024**2


def _train_steps(values, steps, key="allocated_bytes", **extra):
    return [
        dict(rec(float(i), "train", "step", step), **{key: value}, **extra)
        for i, (step, value) in enumerate(zip(steps, values))
    ]


def _growth_cell(text, phase="train"):
    """The growth column of a phase's row in `format_summary`'s table."""
    lines = text.splitlines()
    start = lines[0].index("growth")
    end = lines[0].index("warnings")
    row = next(line for line in lines[2:] if line.split()[1] == phase)
    return row[start:end].strip()


def test_a_flat_three_step_run_is_too_short_to_tell(tmp_path):
    # three readings a few MiB apart: a line through them projects GiBs per 1,000 steps
    path = write(tmp_path / "m.jsonl", _train_steps([2048 * MiB, 2051 * MiB, 2049 * MiB], [1, 2, 3]))
    (s,), text = analyze_memory_logs([path])
    assert s.growth == "too short" and s.growth_bytes_per_1k_steps is None
    assert (s.growth_readings, s.growth_first_step, s.growth_last_step) == (3, 1, 3)
    assert _growth_cell(text) == "too short to tell (3 readings over steps 1-3)"
    assert "GiB" not in _growth_cell(text)


def test_a_noisy_flat_run_is_not_called_growth(tmp_path):
    rng = random.Random(0)
    steps = range(1000)
    values = [2048 * MiB + rng.uniform(-50, 50) * MiB for _ in steps]  # random +-50 MiB jitter, no trend
    path = write(tmp_path / "m.jsonl", _train_steps(values, steps))
    (s,), text = analyze_memory_logs([path])
    assert s.growth == "flat" and s.growth_bytes_per_1k_steps is None
    assert (s.growth_first_step, s.growth_last_step) == (336, 999)
    assert _growth_cell(text) == "flat over steps 336-999"


# Host RSS of the main job (`bash scripts/main.sh`, CPU, a reading every 5 steps), MiB: a climb while data and the
# first batches arrive, then plateaus a few MiB apart. Read as a line it rose by 39 MiB per 1,000 steps.
MAIN_JOB_RSS_MIB = [
    450.18,
    477.79,
    482.22,
    490.13,
    488.12,
    495.78,
    492.29,
    503.59,
    512.88,
    513.06,
    513.1,
    505.51,
    515.5,
    515.51,
    500.84,
    507.35,
    513.3,
    500.87,
    522.25,
    522.5,
    522.17,
    515.92,
    521.8,
    528.18,
    528.2,
    515.82,
    528.21,
    506.58,
    506.62,
    521.14,
    517.46,
    511.45,
    517.84,
    517.84,
    519.73,
    525.23,
    519.73,
    520.23,
    526.01,
    511.88,
    520.55,
    520.55,
    519.42,
    523.76,
    511.93,
    511.93,
    521.32,
    521.32,
    511.95,
    519.95,
    520.95,
    521.21,
    511.96,
    521.34,
    520.71,
    532.35,
    511.99,
    531.88,
    518.75,
    531.63,
]


def test_host_rss_that_moves_between_plateaus_is_flat(tmp_path):
    steps = range(5, 305, 5)
    records = _train_steps(
        [round(v * MiB) for v in MAIN_JOB_RSS_MIB], steps, key="host_rss_bytes", device="cpu", allocated_bytes=None
    )
    (s,), text = analyze_memory_logs([write(tmp_path / "m.jsonl", records)])
    assert s.growth_field == "host_rss_bytes"
    assert s.growth == "flat" and s.growth_bytes_per_1k_steps is None
    assert _growth_cell(text) == "flat over steps 105-300 (RSS)"
    # Memory that sits on one level for a few readings, then another (+-10 MiB around 500 MiB). The readings
    # scatter little about a line (0.5 MiB on a level), so judged by that scatter alone the fall from the last
    # plateaus would count as shrinking; the means of blocks of readings stray far more than that scatter allows.
    rng = random.Random(10)
    level, values = 0.0, []
    for _ in steps:
        if rng.random() < 0.2:
            level = rng.uniform(-10, 10)
        values.append(round((500 + level + rng.uniform(-0.5, 0.5)) * MiB))
    records = _train_steps(values, steps, key="host_rss_bytes", device="cpu", allocated_bytes=None)
    (s,) = summarize_memory_log(records)
    assert s.growth == "flat"


def test_a_steady_leak_is_reported_with_its_rate_and_span(tmp_path):
    steps = range(0, 401, 10)  # 1 MiB per step, read every 10 steps
    path = write(tmp_path / "m.jsonl", _train_steps([1024 * MiB + s * MiB for s in steps], steps))
    (s,), text = analyze_memory_logs([path])
    assert s.growth == "growing" and s.growth_bytes_per_1k_steps == pytest.approx(1000 * MiB)
    assert (s.growth_readings, s.growth_first_step, s.growth_last_step) == (27, 140, 400)
    assert _growth_cell(text) == "+260.00 MiB over steps 140-400"

    rng = random.Random(1)  # the same leak read at every step, under +-50 MiB of jitter
    steps = range(401)
    values = [1024 * MiB + s * MiB + rng.uniform(-50, 50) * MiB for s in steps]
    (s,) = summarize_memory_log(_train_steps(values, steps))
    assert s.growth == "growing" and s.growth_bytes_per_1k_steps == pytest.approx(1000 * MiB, rel=0.05)

    # a reading every 10 steps over 150 steps is enough; a steady fall is reported as one
    steps = range(0, 151, 10)
    (s,) = summarize_memory_log(_train_steps([4096 * MiB - 20 * s * 1024 for s in steps], steps))
    assert s.growth == "shrinking" and s.growth_bytes_per_1k_steps == pytest.approx(-20_000 * 1024)
    assert (s.growth_readings, s.growth_first_step, s.growth_last_step) == (11, 50, 150)


def test_growth_fit_matches_a_reference_whatever_the_order():
    # a full least-squares fit over the readings in the steps the summary names, as the reference
    rng = random.Random(7)
    steps = list(range(3, 20_000, 3))
    values = [5 * 1024**3 + 40 * s + rng.gauss(0, 64 * 1024) for s in steps]
    records = _train_steps(values, steps)
    (s,) = summarize_memory_log(records)
    rng.shuffle(records)
    (shuffled,) = summarize_memory_log(records)
    assert s.growth == shuffled.growth == "growing"
    # the first third is left out, cut at a boundary of the (at most 64) step buckets
    assert 20_000 / 3 <= s.growth_first_step < 20_000 / 3 + 20_000 / 32 and s.growth_last_step == steps[-1]
    window = [(x, y) for x, y in zip(steps, values) if s.growth_first_step <= x <= s.growth_last_step]
    mx = sum(x for x, _ in window) / len(window)
    my = sum(y for _, y in window) / len(window)
    slope = sum((x - mx) * (y - my) for x, y in window) / sum((x - mx) ** 2 for x, _ in window)
    assert s.growth_readings == shuffled.growth_readings == len(window)
    assert s.growth_bytes_per_1k_steps == pytest.approx(1000 * slope, rel=1e-9)
    assert shuffled.growth_bytes_per_1k_steps == pytest.approx(1000 * slope, rel=1e-9)
    assert s.growth_bytes_per_1k_steps == pytest.approx(40_000, rel=0.01)


def test_too_few_readings_in_the_fitted_steps_are_too_short(tmp_path):
    # 300 steps but a reading every 40: 5 readings after the warm-up
    steps = range(0, 301, 40)
    (s,) = summarize_memory_log(_train_steps([1024 * MiB + s * MiB for s in steps], steps))
    assert s.growth == "too short" and (s.growth_readings, s.growth_first_step, s.growth_last_step) == (8, 0, 280)
    # one validation pass after another at the same step: readings over no steps at all
    (s,) = summarize_memory_log([dict(r, phase="validate") for r in _train_steps([MiB] * 30, [500] * 30)])
    assert s.growth == "too short"
    assert _growth_cell(format_summary([s]), "validate") == "too short to tell (30 readings, all at step 500)"


def test_truncated_last_line_is_skipped_with_a_warning(tmp_path):
    path = write(
        tmp_path / "m.jsonl",
        [rec(1.0, "train", "step", 1, 10), rec(2.0, "train", "step", 2, 20)],
        tail='{"time": 3.0, "rank": 0, "pha',
    )
    with pytest.warns(UserWarning, match="line 3 is truncated"):
        records = load_memory_log(path)
    assert [r["global_step"] for r in records] == [1, 2]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("", "holds no memory records"),
        ("not json at all\n", "line 1 is not JSON"),
        ('{"a": 1}\n', "line 1 is not a memory record"),
        ("[1, 2]\n", "line 1 is not a memory record"),
        (
            '{"time": 1, "rank": 0, "phase": "train", "event": "step"}\ngarbage\n{"time": 1, "rank": 0, "phase": "t", '
            '"event": "s"}\n',
            "line 2 is not JSON",
        ),
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

    proc = subprocess.run(
        [sys.executable, "-m", "lightning_memopt.cli", "analyze", str(good_log)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "train" in proc.stdout


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


# ---------------------------------------------------------------------------------------------------- bad records


def _lines(records):
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def _steps(n, rank=0, t0=0.0, every=1, **extra):
    return [rec(t0 + s, "train", "step", every * s, 1000 + 10 * s, rank=rank, **extra) for s in range(1, n + 1)]


BAD_RECORDS = [
    pytest.param('{"time": 9, "rank": "zero", "phase": "train", "event": "step"}', "`rank` is 'zero'", id="rank-str"),
    pytest.param('{"time": 9, "rank": null, "phase": "train", "event": "step"}', "`rank` is None", id="rank-null"),
    pytest.param('{"time": 9, "rank": -1, "phase": "train", "event": "step"}', "`rank` is -1", id="rank-negative"),
    pytest.param(
        '{"time": 9, "rank": 0, "phase": "train", "event": "step", "allocated_bytes": "12"}',
        "`allocated_bytes` is '12'",
        id="bytes-str",
    ),
    pytest.param(
        '{"time": 9, "rank": 0, "phase": "train", "event": "step", "allocated_bytes": NaN}', "holds NaN", id="nan"
    ),
    pytest.param('{"time": Infinity, "rank": 0, "phase": "train", "event": "step"}', "holds Infinity", id="inf"),
    pytest.param('{"time": 1e999, "rank": 0, "phase": "train", "event": "step"}', "`time` is inf", id="overflow"),
    pytest.param('{"time": "x", "rank": 0, "phase": "train", "event": "step"}', "`time` is 'x'", id="time-str"),
    pytest.param('{"time": 9, "rank": 0, "phase": 3, "event": "step"}', "`phase` is 3", id="phase-int"),
    pytest.param(
        '{"time": 9, "rank": 0, "phase": "train", "event": "step", "global_step": "7"}',
        "`global_step` is '7'",
        id="step-str",
    ),
    pytest.param(
        '{"time": 9, "rank": 0, "phase": "train", "event": "step", "global_step": 1' + "0" * 400 + "}",
        "`global_step` is 1000",
        id="step-huge",
    ),
    pytest.param(
        '{"time": 9, "rank": 0, "phase": "train", "event": "step", "run_id": 5}', "`run_id` is 5", id="run-id-int"
    ),
    pytest.param("[1, 2, 3]", "a JSON value that is an array, not an object", id="list"),
    pytest.param("42", "a JSON value that is a number, not an object", id="number"),
    pytest.param('{"time": 9, "rank": 0, "pha', "is not JSON", id="torn"),
    pytest.param("\x00\x01garbage", "is not JSON", id="binary"),
    pytest.param('{"pad": "' + "x" * 2**20 + '"}', "is longer than 1 MiB", id="overlong"),
]


@pytest.mark.parametrize(("bad", "reason"), BAD_RECORDS)
def test_bad_records_are_skipped_with_one_warning_naming_the_lines(tmp_path, bad, reason):
    good = _steps(24, every=10)  # +10 bytes every 10 steps, over 230 steps
    content = _lines([*good[:3], bad, *good[3:8], bad, bad, *good[8:]])
    path = tmp_path / "memory_rank0.jsonl"
    path.write_text(content)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summaries, _ = analyze_memory_logs([path])
    messages = [str(w.message) for w in caught if str(path) in str(w.message)]
    assert len(messages) == 1, messages
    assert f"{path}: skipped 3 of 27 records (lines 4, 10, 11): line 4 " in messages[0]
    assert reason in messages[0]
    (train,) = summaries
    assert train.num_readings == 24 and train.peak_allocated_bytes == 1240
    assert train.growth == "growing" and train.growth_bytes_per_1k_steps == pytest.approx(1000.0)


def test_cli_prints_one_warning_line_and_the_summary(tmp_path, capsys):
    path = tmp_path / "memory_rank0.jsonl"
    path.write_text(
        _lines(
            [
                *_steps(3),
                '{"time": 9, "rank": "zero", "phase": "train", "event": "step"}',
                '{"time": 1, "rank": 0, "allocated_bytes": NaN}',
                *_steps(2, t0=10),
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


def test_many_bad_lines_are_listed_briefly(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(_lines([*_steps(2), *["oops"] * 25, '{"time": 9, "rank": "zero", "phase": "t", "event": "s"}']))
    with pytest.warns(UserWarning) as caught:
        analyze_memory_logs([path])
    (message,) = [str(w.message) for w in caught]
    assert "skipped 26 of 28 records (lines 3, 4, 5, 6, 7, 8, 9, 10, 11, 12 and 16 more)" in message
    assert "line 3 is not JSON; line 28 `rank` is 'zero'" in message


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


def test_summarize_skips_records_of_the_wrong_type():
    records = [*_steps(4), {"time": 5.0, "rank": "zero", "phase": "train", "event": "step"}, [1], None]
    with pytest.warns(UserWarning, match=r"skipped 3 of 7 records \(index 4, 5, 6\): record 4 `rank` is 'zero'"):
        (summary,) = summarize_memory_log(records)
    assert summary.num_readings == 4


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"time": 1, "rank": "zero", "phase": "train", "event": "step"}\n', "line 1 `rank` is 'zero', not an int"),
        (
            '{"time": 1, "rank": 0, "phase": "train", "event": "step", "allocated_bytes": "12"}\n',
            "line 1 `allocated_bytes` is '12'",
        ),
        ('{"time": NaN, "rank": 0, "phase": "train", "event": "step"}\n', "line 1 holds NaN"),
    ],
)
def test_load_memory_log_names_the_line_of_a_wrong_type(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(MemoryLogError, match=match):
        load_memory_log(path)


# ---------------------------------------------------------------------------------------------------- paths


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
        (lambda tmp: tmp, "is a directory"),
        (lambda tmp: tmp / "missing" / "memory_rank0.jsonl", "no such file"),
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
    log.write_text(_lines(_steps(3)))
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
    log.write_text(_lines(_steps(3)))
    monkeypatch.setattr(Path, "mkdir", refuse)
    target = tmp_path / "locked" / "p.png"
    assert main(["analyze", str(log), "--plot", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(target) in err and "cannot create the directory" in err
    assert "Permission denied" in err and "Traceback" not in err


def test_plot_formats_follow_the_extension(tmp_path):
    log = tmp_path / "memory_rank0.jsonl"
    log.write_text(_lines(_steps(3)))
    analyze_memory_logs([log], plot=tmp_path / "t.svg")
    assert (tmp_path / "t.svg").read_text().lstrip().startswith("<?xml")
    analyze_memory_logs([log], plot=tmp_path / "no_extension")
    assert (tmp_path / "no_extension").read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------------------------------------------- findings

DUPLICATES_MESSAGE = (
    "MemoryAudit [rank 0] (first step): 30 tensors on cpu (869.08 KiB = 889936 bytes, dtypes float32) are not owned"
    " by the model or optimizer but have the shapes of its parameters: 1.00x the parameters' elements. Held at"
    " ema_model. Likely cause: a copy of the model (deepcopy, EMA). Largest: (256, 256) float32 256.00 KiB."
)
LEAK_MESSAGE = (
    "MemoryAudit [rank 0]: Live tensor memory on cpu grows by 1.00 MiB per optimizer step (1048576 bytes/step, 99.00"
    " MiB over steps 200-300), first seen at step 210. No attribute of the LightningModule holds tensors with autograd"
    " history. Usual causes: tensors with autograd history kept in a list or attribute."
)


def audit_records(run_id="r1", t0=0.0):
    """A CPU run as MemoryMonitor and MemoryAudit write it: host RSS only, an audit, a duplicate and a leak finding."""

    def cpu(t, event, step, **extra):
        return dict(
            rec(t0 + t, "train", event, step),
            device="cpu",
            allocated_bytes=None,
            reserved_bytes=None,
            device_total_bytes=None,
            host_rss_bytes=500 * MiB + step * 1024,
            run_id=run_id,
            **extra,
        )

    records = [cpu(0.0, "phase_start", 0), cpu(0.5, "audit", 0, audit="fit_start", footprint={"parameters": {}})]
    records += [cpu(float(s), "step", s) for s in range(10, 410, 10)]
    records += [
        cpu(
            1.5,
            "warning",
            1,
            check="duplicates",
            message=DUPLICATES_MESSAGE,
            duplicate_bytes=889936,
            num_duplicate_tensors=30,
        ),
        cpu(
            300.5,
            "warning",
            300,
            check="leak",
            message=LEAK_MESSAGE,
            bytes_per_step=1048576.0,
            first_step=210,
            samples=[[200, 1], [300, 2]],
            grad_fn_holders=[],
        ),
        cpu(401.0, "phase_end", 400),
    ]
    return sorted(records, key=lambda r: r["time"])


def test_audit_findings_are_listed_with_their_text(tmp_path):
    path = write(tmp_path / "memory_rank0.jsonl", audit_records())
    (s,), text = analyze_memory_logs([path])
    assert s.warnings == 2 and s.warnings_by_check == {"duplicates": 1, "leak": 1}
    assert [(f.check, f.global_step, f.seconds, f.message) for f in s.findings] == [
        ("duplicates", 1, 1.5, DUPLICATES_MESSAGE),
        ("leak", 300, 300.5, LEAK_MESSAGE),
    ]
    lines = text.splitlines()
    header = lines[0]
    row = lines[2]
    assert row[header.index("warnings") : header.index("peak at")].strip() == "1 duplicates, 1 leak"
    findings = lines[lines.index("warnings in the logs:") + 1 :]
    assert findings == [
        f"  rank 0, train, step 1, 1.5 s: duplicates: {DUPLICATES_MESSAGE}",
        f"  rank 0, train, step 300, 300.5 s: leak: {LEAK_MESSAGE}",
    ]


def test_many_warnings_are_counted_and_the_first_few_listed():
    records = [rec(float(s), "train", "step", s, 1000) for s in range(1, 4)]
    records += [
        rec(10.0 + i, "train", "warning", 3, 900, field="allocated_bytes", message=f"above {i}") for i in range(8)
    ]
    (s,) = summarize_memory_log(records)
    assert s.warnings == 8 and s.warnings_by_check == {"threshold": 8}
    assert [f.message for f in s.findings] == [f"above {i}" for i in range(5)]
    text = format_summary([s])
    assert "  rank 0, train, step 3, 13.0 s: threshold: above 4" in text
    assert text.endswith("  rank 0, train: 3 more threshold warnings (not listed)")


def test_plot_labels_audit_findings_with_their_text(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    path = write(tmp_path / "memory_rank0.jsonl", audit_records())
    fig = plotted_figure(monkeypatch, [path], tmp_path / "p.png")
    try:
        (ax,) = fig.axes
        notes = {a.get_text().replace("\n", " "): a.xy for a in ax.texts}
        leak = next(text for text in notes if text.startswith("leak: "))
        duplicates = next(text for text in notes if text.startswith("duplicates: "))
        assert leak.startswith("leak: Live tensor memory on cpu grows by 1.00 MiB per optimizer step")
        assert duplicates.startswith("duplicates: 30 tensors on cpu (869.08 KiB")
        assert "MemoryAudit [rank 0]" not in leak + duplicates  # the panel names the rank
        assert notes[leak][0] == pytest.approx(300.5) and notes[duplicates][0] == pytest.approx(1.5)
        labels = [line.get_label() for line in ax.lines]
        assert "leak warning" in labels and "duplicates warning" in labels
        # nothing drawn as a threshold warning, and no mark at 0 for findings that have no device figure
        assert not [c for c in ax.collections if c.get_label() == "threshold warning"]
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "leak warning" in legend and "threshold warning" not in legend
    finally:
        plt.close(fig)


def test_plot_marks_threshold_warnings_at_their_figure(good_log, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    fig = plotted_figure(monkeypatch, [good_log], tmp_path / "p.png")
    try:
        (ax,) = fig.axes
        (marks,) = [c for c in ax.collections if c.get_label() == "threshold warning"]
        # the warning's allocated bytes (9500) on the MiB axis, at its time (5 s)
        assert marks.get_offsets().tolist() == [[5.0, pytest.approx(9500 / 1024**2)]]
        assert not ax.texts
    finally:
        plt.close(fig)


# ---------------------------------------------------------------------------------------------------- runs


def test_records_of_different_runs_are_separate_rows_and_panels(tmp_path, capsys):
    first = [dict(r, run_id="ab12") for r in _steps(4, t0=100.0)]
    # the second run starts later, its memory is higher and its peak comes 2 s after its own start
    second = [dict(r, run_id="cd34", allocated_bytes=5000 + 10 * r["global_step"]) for r in _steps(2, t0=500.0)]
    path = tmp_path / "memory_rank0.jsonl"
    path.write_text(_lines([*first, *second]))
    summaries, text = analyze_memory_logs([path], plot=tmp_path / "p.png")
    assert [(s.run_id, s.rank, s.phase, s.num_readings) for s in summaries] == [
        ("ab12", 0, "train", 4),
        ("cd34", 0, "train", 2),
    ]
    assert summaries[0].peak_allocated_bytes == 1040 and summaries[0].peak_seconds == pytest.approx(3.0)
    assert summaries[1].peak_allocated_bytes == 5020 and summaries[1].peak_seconds == pytest.approx(1.0)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["rank", "run", "phase", "readings"]
    assert lines[2].split()[:4] == ["0", "ab12", "train", "4"] and lines[3].split()[:4] == ["0", "cd34", "train", "2"]
    assert (tmp_path / "p.png").stat().st_size > 10_000

    assert main(["analyze", str(path)]) == 0
    assert "cd34" in capsys.readouterr().out


def test_one_run_id_keeps_the_single_run_table(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(_lines([dict(r, run_id="ab12") for r in _steps(3)]))
    (summary,), text = analyze_memory_logs([path])
    assert summary.run_id == "ab12" and text.splitlines()[0].split()[:3] == ["rank", "phase", "readings"]
    assert "ab12" not in text


def test_records_without_run_id_and_with_one_are_two_runs(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(_lines([*_steps(2), *[dict(r, run_id="new") for r in _steps(2, t0=50.0)]]))
    summaries, text = analyze_memory_logs([path])
    assert [s.run_id for s in summaries] == [None, "new"]
    assert [line.split()[1] for line in text.splitlines()[2:4]] == ["-", "new"]


def test_plot_memory_timeline_keeps_its_signature(good_log, tmp_path):
    records = load_memory_log(good_log)
    written = plot_memory_timeline({"memory_rank0.jsonl": records}, tmp_path / "direct.png")
    assert written == tmp_path / "direct.png" and written.read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------------------------------------------- memory


def _write_big_log(path, lines):
    MiB = 1024**2
    with open(path, "w") as f:
        for s in range(lines):
            f.write(
                json.dumps(
                    {
                        "time": 1_700_000_000.0 + 0.05 * s,
                        "rank": 0,
                        "phase": "train",
                        "event": "step",
                        "epoch": s // 5000,
                        "global_step": s,
                        "batch_idx": s % 5000,
                        "device": "cuda:0",
                        "allocated_bytes": 6 * 1024**3 + 4 * s,
                        "reserved_bytes": 8 * 1024**3 + s,
                        "active_bytes": 6 * 1024**3,
                        "peak_allocated_bytes": 7 * 1024**3 + s,
                        "peak_reserved_bytes": 9 * 1024**3,
                        "device_total_bytes": 85_029_158_912,
                        "device_free_bytes": 60_000_000_000,
                        "host_rss_bytes": 4 * 1024**3 + s % MiB,
                        "num_alloc_retries": 0,
                        "num_ooms": 0,
                    }
                )
                + "\n"
            )
    return path


def test_analysis_keeps_a_fraction_of_the_log_in_memory(tmp_path):
    import tracemalloc

    path = _write_big_log(tmp_path / "memory_rank0.jsonl", 3000)
    size = path.stat().st_size
    tracemalloc.start()
    try:
        summaries, _ = analyze_memory_logs([path])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert summaries[0].num_readings == 3000
    # the records themselves (a list of dicts) would take several times the file's size
    assert peak < 0.5 * size, f"peak {peak} bytes for a {size}-byte log"


RSS_SCRIPT = """
import json, sys
from lightning_memopt.cli import main


def peak_rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


with open("/proc/self/clear_refs", "w") as f:  # reset the peak: what importing torch took does not count
    f.write("5")
base = peak_rss()
code = main(["analyze", *sys.argv[1:]])
print(json.dumps({"code": code, "base": base, "peak": peak_rss()}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's resettable peak RSS")
def test_peak_rss_of_analyze_grows_less_than_twice_the_logs(tmp_path):
    from tests.helpers.subprocess_run import run_script

    logs = [_write_big_log(tmp_path / f"memory_rank{r}.jsonl", 15_000) for r in (0, 1)]
    size = sum(p.stat().st_size for p in logs)
    proc = run_script(RSS_SCRIPT, tmp_path, args=tuple(map(str, logs)), timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["code"] == 0
    growth = result["peak"] - result["base"]
    assert growth < 2 * size, f"RSS grew {growth / 2**20:.1f} MiB for {size / 2**20:.1f} MiB of logs"
