"""benchmarks/callback_overhead.py --quick: every configuration fits and the audit's parts are timed where they live."""

import json

import pytest

from tests.helpers.subprocess_run import REPO_ROOT, run_file


@pytest.mark.slow
def test_benchmark_quick_mode_runs(tmp_path):
    out = tmp_path / "overhead.json"
    proc = run_file(
        REPO_ROOT / "benchmarks" / "callback_overhead.py", tmp_path, timeout=300, args=("--quick", "--out", str(out))
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    configs = {fit["config"] for fit in report["fits"]}
    assert {
        "none",
        "all four",
        "MemoryMonitor",
        "CacheCleaner",
        "GarbageCollector",
        "OOMReporter",
        "MemoryAudit",
    } <= configs
    assert report["summary"]["total_ratio_wall"] > 0
    (audit,) = [fit["hooks"]["MemoryAudit"] for fit in report["fits"] if fit["config"] == "MemoryAudit"]
    # the callback's two one-off audits and its Trainer-free session's interval samples were all seen
    assert len(audit["audits_s"]) == 2 and audit["holder_samples_s"]
