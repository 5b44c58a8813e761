import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The example run as a script as if matplotlib were not installed: no module and no distribution (torchmetrics and
# Lightning ask importlib.metadata for its version before they import it).
_WITHOUT_MATPLOTLIB = """\
import importlib.metadata, runpy, sys


class NoMatplotlib:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "matplotlib":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def version(name, _version=importlib.metadata.version):
    if name.lower() == "matplotlib":
        raise importlib.metadata.PackageNotFoundError(name)
    return _version(name)


sys.meta_path.insert(0, NoMatplotlib())
importlib.metadata.version = version
sys.argv = ["examples/quickstart.py", *sys.argv[1:]]
runpy.run_path("examples/quickstart.py", run_name="__main__")
"""


def _run(tmp_path, *prefix: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *prefix, "--max_steps", "20", "--root", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard: a run takes about 15 s on 2 shared cores
    )


@pytest.mark.slow
def test_quickstart_runs_and_prints_the_summary_and_plot(tmp_path):
    proc = _run(tmp_path, "examples/quickstart.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = list(tmp_path.rglob("memory_rank0.jsonl"))
    plots = list(tmp_path.rglob("*.png"))
    assert len(logs) == 1 and len(plots) == 1
    assert str(plots[0]) in proc.stdout and "train" in proc.stdout


@pytest.mark.slow
def test_quickstart_without_matplotlib_skips_the_plot_and_says_how_to_get_it(tmp_path):
    proc = _run(tmp_path, "-c", _WITHOUT_MATPLOTLIB)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(tmp_path.rglob("memory_rank0.jsonl"))) == 1 and not list(tmp_path.rglob("*.png"))
    assert "Memory summary" in proc.stdout and "train" in proc.stdout
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("timeline plot:")]
    assert skipped == ["timeline plot: skipped, matplotlib is not installed (pip install 'lightning-memopt[plot]')"]
