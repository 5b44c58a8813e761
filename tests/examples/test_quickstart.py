import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quickstart_runs_and_prints_the_summary_and_plot(tmp_path):
    proc = subprocess.run(
        [sys.executable, "examples/quickstart.py", "--max_steps", "20", "--root", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = list(tmp_path.rglob("memory_rank0.jsonl"))
    plots = list(tmp_path.rglob("*.png"))
    assert len(logs) == 1 and len(plots) == 1
    assert str(plots[0]) in proc.stdout and "train" in proc.stdout
