"""Run a Python script in a fresh interpreter (used for 2-process DDP runs and peak-RSS measurements)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


SCRIPTS = REPO_ROOT / "tests" / "scripts"


def run_script(code: str, tmp_path, timeout: float = 300, args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Write ``code`` to ``tmp_path/script.py`` and run it; the repo root is on ``PYTHONPATH``.

    DDP scripts use ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``: Lightning re-launches the
    script for rank 1, which is why the code must live in a file.
    """
    script = Path(tmp_path) / "script.py"
    script.write_text(textwrap.dedent(code))
    return run_file(script, tmp_path, timeout=timeout, args=args)


def run_file(script, tmp_path, timeout: float = 300, args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run the file ``script`` (e.g. ``SCRIPTS / "ddp_oom.py"``) in ``tmp_path``; the repo root is on ``PYTHONPATH``.

    Worker scripts under ``tests/scripts/`` keep their work under ``if __name__ == "__main__":`` (pytest imports
    them for doctests) and take what differs between tests as command-line ``args``.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env.pop("LOCAL_RANK", None)
    env.pop("WORLD_SIZE", None)
    env.pop("NODE_RANK", None)
    env["PYTHONWARNINGS"] = "ignore"
    # A session of its own: on a time-out the whole process group goes, including DDP ranks the script started.
    with subprocess.Popen(
        [sys.executable, str(script), *args],
        cwd=str(tmp_path),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            raise subprocess.TimeoutExpired(proc.args, timeout, output=stdout, stderr=stderr) from None
        finally:
            # Ranks that outlive the script (an orphaned rank 1) must not outlive the test.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run_script_once(tmp_path_factory, name: str, timeout: float = 300) -> Path:
    """Run ``SCRIPTS / name`` in a fresh directory and fail on a non-zero exit; the directory.

    For a module-scoped fixture: one multi-process run whose files several tests read.
    """
    directory = tmp_path_factory.mktemp(Path(name).stem)
    proc = run_file(SCRIPTS / name, directory, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return directory
