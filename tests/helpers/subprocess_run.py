"""Run a Python script in a fresh interpreter (used for 2-process DDP runs and peak-RSS measurements)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_script(code: str, tmp_path, timeout: float = 180, args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Write ``code`` to ``tmp_path/script.py`` and run it; the repo root is on ``PYTHONPATH``.

    DDP scripts use ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``: Lightning re-launches the
    script for rank 1, which is why the code must live in a file.
    """
    script = Path(tmp_path) / "script.py"
    script.write_text(textwrap.dedent(code))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env.pop("LOCAL_RANK", None)
    env.pop("WORLD_SIZE", None)
    env.pop("NODE_RANK", None)
    env["PYTHONWARNINGS"] = "ignore"
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
