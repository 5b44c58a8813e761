"""Per (run, rank, phase) summaries: peaks, means, findings, runs, and the memory the streaming keeps."""

import json
import os

import pytest

from lightning_memopt.analysis import analyze_memory_logs, format_summary, load_memory_log, summarize_memory_log
from lightning_memopt.cli import main
from tests.helpers.analysis_logs import (
    DUPLICATES_MESSAGE,
    LEAK_MESSAGE,
    TRAIN_STEPS,
    audit_records,
    jsonl_text,
    rec,
    step_records,
    write,
    write_good_log,
)


@pytest.fixture
def good_log(tmp_path):
    return write_good_log(tmp_path)


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
    assert train.mean_reserved_bytes == pytest.approx(2 * train.mean_allocated_bytes)
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
    assert s.mean_host_rss_bytes == pytest.approx(sum(1000 + step for step in range(0, 401, 10)) / 41)


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
    assert row[header.index("warnings") :].strip() == "1 duplicates, 1 leak"
    assert all(len(line) <= 100 for line in lines[: lines.index("warnings in the logs:")])  # the table fits
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


def test_records_of_different_runs_are_separate_rows_and_panels(tmp_path, capsys):
    first = [dict(r, run_id="ab12") for r in step_records(4, t0=100.0)]
    # the second run starts later, its memory is higher and its peak comes 2 s after its own start
    second = [dict(r, run_id="cd34", allocated_bytes=5000 + 10 * r["global_step"]) for r in step_records(2, t0=500.0)]
    path = tmp_path / "memory_rank0.jsonl"
    path.write_text(jsonl_text([*first, *second]))
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
    path.write_text(jsonl_text([dict(r, run_id="ab12") for r in step_records(3)]))
    (summary,), text = analyze_memory_logs([path])
    assert summary.run_id == "ab12" and text.splitlines()[0].split()[:3] == ["rank", "phase", "readings"]
    assert "ab12" not in text


def test_records_without_run_id_and_with_one_are_two_runs(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(jsonl_text([*step_records(2), *[dict(r, run_id="new") for r in step_records(2, t0=50.0)]]))
    summaries, text = analyze_memory_logs([path])
    assert [s.run_id for s in summaries] == [None, "new"]
    assert [line.split()[1] for line in text.splitlines()[2:4]] == ["-", "new"]


def _write_big_log(path, lines, rank=0):
    MiB = 1024**2
    with open(path, "w") as f:
        for s in range(lines):
            f.write(
                json.dumps(
                    {
                        "time": 1_700_000_000.0 + 0.05 * s,
                        "rank": rank,
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

    logs = [_write_big_log(tmp_path / f"memory_rank{r}.jsonl", 15_000, rank=r) for r in (0, 1)]
    size = sum(p.stat().st_size for p in logs)
    proc = run_script(RSS_SCRIPT, tmp_path, args=tuple(map(str, logs)), timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["code"] == 0
    growth = result["peak"] - result["base"]
    assert growth < 2 * size, f"RSS grew {growth / 2**20:.1f} MiB for {size / 2**20:.1f} MiB of logs"


def test_a_warning_with_an_empty_check_falls_back_to_what_its_fields_say():
    from lightning_memopt.analysis.findings import finding_check

    assert finding_check({"check": "", "field": "allocated_bytes"}) == "threshold"
    assert finding_check({"check": "", "field": ""}) == "warning"
    assert finding_check({"check": "leak", "field": "allocated_bytes"}) == "leak"
