"""The package root: every public name resolves, the public errors and helpers are there, and each has its place in
the documentation site's API reference (``API_PAGES`` in scripts/mkdocs_hooks.py)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import lightning_memopt

ROOT = Path(__file__).resolve().parents[1]


def test_every_public_name_resolves():
    for name in lightning_memopt.__all__:
        assert getattr(lightning_memopt, name) is not None, name


def test_the_public_errors_and_helpers_are_exported():
    from lightning_memopt.planner.model_step import MemoryEstimateError
    from lightning_memopt.utilities.oom import is_out_of_memory_error

    assert lightning_memopt.MemoryEstimateError is MemoryEstimateError
    assert lightning_memopt.is_out_of_memory_error is is_out_of_memory_error
    assert {"MemoryEstimateError", "is_out_of_memory_error"} <= set(lightning_memopt.__all__)


def _hooks():
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_api_reference_documents_every_public_name_once():
    hooks = _hooks()
    pages = [hooks.api_page(title, names) for title, names in hooks.API_PAGES.values()]
    documented = re.findall(r"^::: lightning_memopt\.(\w+)$", "\n".join(pages), re.MULTILINE)
    assert sorted(documented) == sorted(set(lightning_memopt.__all__) - {"__version__"})
