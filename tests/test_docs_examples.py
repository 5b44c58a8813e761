"""Every code example in the documentation runs: README.md, the site's pages (docs/) and examples/README.md.

The Python blocks of one page run in order in one namespace, in a fresh working directory, like a user pasting them
into a notebook. What a page leaves to the reader (``model``, ``dataset``, ``module``, ``batch``, ``make_batch``,
``MyModel``, ``MyDataModule``, ``devices``) is given here, small; ``Trainer`` runs two steps on the CPU. Shell
blocks that call ``lightning-memopt`` run in the same directory after the Python blocks before them; install
commands and the project's own scripts are left to tests/test_packaging.py and CI. YAML blocks must parse.
"""

from __future__ import annotations

import glob
import importlib
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from torch.utils.data import DataLoader

from lightning_memopt import cli
from lightning_memopt.utilities.namespaces import NAMESPACES
from tests.helpers.lightning import pl
from tests.helpers.models import RandomDataset, TinyModel
from tests.helpers.oom_fixtures import full_report

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")), "examples/README.md"]
_FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
#: Shell commands these tests leave to others: installing (tests/test_packaging.py) and the project's scripts (CI).
_NOT_RUN_HERE = ("pip ", "tar ", "CUDA=", "bash scripts/", ".venv/bin/python examples/")


def code_blocks(page: str) -> list[tuple[str, str, int]]:
    """``(language, code, line)`` of every fenced block of ``page``."""
    text = (ROOT / page).read_text(encoding="utf-8")
    return [(m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1) for m in _FENCE.finditer(text)]


def _doc_trainer(base: type) -> type:
    """The Trainer a page's example gets: its arguments, two steps, on the CPU, without a progress bar."""

    class DocTrainer(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("max_steps", 2)
            kwargs.setdefault("limit_val_batches", 1)
            kwargs.update(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False)
            if kwargs.get("strategy") is not None and not isinstance(kwargs["strategy"], str):
                kwargs["strategy"] = "auto"  # a DDP strategy object, as in examples/README.md: one CPU process here
            kwargs["devices"] = 1
            super().__init__(*args, **kwargs)

    return DocTrainer


class MyDataModule(pl.LightningDataModule):
    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(RandomDataset(32, 16), batch_size=self.batch_size)


class MyModel(TinyModel):
    def __init__(self, lr: float = 0.01) -> None:
        super().__init__(in_features=32)
        self.lr = lr


def _namespace() -> dict[str, Any]:
    module = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    return {
        "__name__": "__docs__",
        "pl": pl,
        "DataLoader": DataLoader,
        "model": TinyModel(),
        "dataset": RandomDataset(32, 16),
        "module": module,
        "batch": torch.randn(4, 32),
        "make_batch": lambda n: torch.randn(n, 32),
        "batch_fn": lambda n: torch.randn(n, 32),
        "MyModel": MyModel,
        "MyDataModule": MyDataModule,
        "devices": 1,
    }


def _run_shell(code: str, cwd: Path) -> None:
    """Run each ``lightning-memopt ...`` line as the console script would, in this process (globs expanded)."""
    command = code.replace("\\\n", " ")
    for line in command.splitlines():
        line = line.split("  #", 1)[0].strip()
        if not line or line.startswith("#") or line.startswith(_NOT_RUN_HERE):
            continue
        assert line.startswith("lightning-memopt "), f"a shell example this test does not know how to run: {line}"
        argv = [expanded for word in shlex.split(line)[1:] for expanded in (sorted(glob.glob(word)) or [word])]
        assert cli.main(argv) == 0, line


def _an_oom_report(cwd: Path) -> None:
    """What docs/oom-report.md reads: a report as OOMReporter writes it, where it writes it by default."""
    (cwd / "memopt").mkdir()
    (cwd / "memopt" / "oom_report_rank0.json").write_text(json.dumps(full_report()), encoding="utf-8")


#: What a LightningCLI example is run with (its Trainer class is bound before this test patches it).
_CLI_ARGS = ["--trainer.max_steps=2", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false"]

#: What a page's examples expect to find in the working directory, made before they run.
_BEFORE = {"docs/oom-report.md": _an_oom_report}


def _run_page(page: str, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = code_blocks(page)
    cwd.mkdir(exist_ok=True)
    _BEFORE.get(page, lambda cwd: None)(cwd)
    monkeypatch.chdir(cwd)
    (cwd / "examples").symlink_to(ROOT / "examples")  # shell examples name files under examples/
    for namespace in NAMESPACES:  # whichever Lightning the example imports
        module = importlib.import_module(namespace)
        monkeypatch.setattr(module, "Trainer", _doc_trainer(module.Trainer))
    monkeypatch.setattr(sys, "argv", ["docs-example", "fit", *_CLI_ARGS])
    namespace = _namespace()
    for language, code, line in blocks:
        try:
            if language == "python":
                exec(compile(code, f"{page}:{line}", "exec"), namespace)
            elif language in ("bash", "sh", "console"):
                _run_shell(code, cwd)
            elif language in ("yaml", "yml"):
                yaml.safe_load(code)
        except BaseException as err:
            raise AssertionError(f"the example at {page}:{line} fails: {err!r}") from err


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_every_example_of_the_page_runs(page, tmp_path, monkeypatch):
    _run_page(page, tmp_path / "cwd", monkeypatch)


def test_the_pages_are_found_and_have_examples():
    assert {"README.md", "docs/presets.md", "docs/estimate.md"} <= set(PAGES)
    assert sum(len(code_blocks(page)) for page in PAGES) > 20


def test_a_broken_example_fails(tmp_path, monkeypatch):
    """The runner reports the page and line of an example that raises."""
    page = tmp_path / "page.md"
    page.write_text("text\n\n```python\nraise ValueError('broken')\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError, match=r"page.md:3 fails: ValueError\('broken'\)"):
        _run_page("page.md", tmp_path / "cwd", monkeypatch)
