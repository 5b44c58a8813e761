"""The package root: every public name resolves, the public errors and helpers are there, and each has its place in
the documentation site's API reference (docs/api/)."""

from __future__ import annotations

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


def test_the_api_reference_documents_every_public_name():
    pages = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "docs" / "api").glob("*.md"))
    documented = set(re.findall(r"^::: lightning_memopt\.(\w+)$", pages, re.MULTILINE))
    assert documented == set(lightning_memopt.__all__) - {"__version__"}
