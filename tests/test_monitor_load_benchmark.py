"""benchmarks/monitor_load.py --quick: both configurations fit, the hook totals and the long-log analysis are there."""

import json

import pytest

from tests.helpers.subprocess_run import REPO_ROOT, run_file


@pytest.mark.slow
def test_benchmark_quick_mode_runs(tmp_path):
    out = tmp_path / "monitor_load.json"
    proc = run_file(
        REPO_ROOT / "benchmarks" / "monitor_load.py",
        tmp_path,
        timeout=300,
        args=("--quick", "--analyze-steps", "200", "--out", str(out)),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {fit["config"] for fit in report["fits"]} == {"none", "monitor+audit"}
    (with_callbacks,) = [fit for fit in report["fits"] if fit["config"] == "monitor+audit"]
    assert with_callbacks["log_lines"] >= with_callbacks["steps"]  # one record a step at least
    summary = report["summary"]
    assert summary["fixed_per_step_cpu_us"] > 0 and summary["fixed_per_step_us"] > 0
    assert report["analyze"]["exit_code"] == 0 and report["analyze"]["peak_rss_bytes"] > 0
