"""MkDocs hooks: the site's home page is README.md, its changelog CHANGELOG.md and its API reference the docstrings
of the public names listed in :data:`API_PAGES`, so each text has one source (and docs/ holds only the guides,
which the wheel carries).

Links in README.md that point into ``docs/`` are rewritten to the site's pages; a link to any other file of the
repository (an example, a script) becomes plain text naming the path, since the site does not carry it.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]

#: The API reference: page -> (title, the public names of ``lightning_memopt`` it documents, in order).
API_PAGES = {
    "api/callbacks.md": (
        "Callbacks",
        [
            "MemoryMonitor",
            "CacheCleaner",
            "GarbageCollector",
            "GradientCheckpointing",
            "AllocatorSettings",
            "OOMReporter",
            "MemoryAudit",
            "AutoMicroBatch",
        ],
    ),
    "api/precision.md": ("Precision plugin", ["MemoryPrecision"]),
    "api/presets.md": ("Presets", ["MemoryPreset", "MemoryPresetCLI"]),
    "api/planner.md": (
        "Planner",
        [
            "estimate_memory",
            "MemoryEstimate",
            "estimate_generation",
            "plan_memory",
            "MemoryPlan",
            "MemoryEstimateError",
        ],
    ),
    "api/batching.md": (
        "Batching by memory",
        ["TokenBudgetBatchSampler", "plan_token_budget", "TokenBudgetPlan", "longest_input"],
    ),
    "api/metrics.md": ("Retrieval metric", ["StreamingRetrievalMetric"]),
    "api/utilities.md": (
        "Memory readings and errors",
        ["read_memory", "MemoryReading", "to_device_and_dtype", "is_out_of_memory_error"],
    ),
}
_LINK = re.compile(r"\[([^\]]+)\]\(([^)#\s]+)(#[^)\s]*)?\)")


def _site_link(match: re.Match[str]) -> str:
    text, target, anchor = match.group(1), match.group(2), match.group(3) or ""
    if "://" in target or target.startswith("mailto:"):
        return match.group(0)
    if target.startswith("docs/"):
        return f"[{text}]({target.removeprefix('docs/')}{anchor})"
    return f"{text} (`{target}` in the repository)"


def for_site(markdown: str) -> str:
    """``markdown`` with its repository-relative links rewritten for the site."""
    return _LINK.sub(_site_link, markdown)


def api_page(title: str, names: list[str]) -> str:
    """A reference page: the title, then each name rendered from its docstring by mkdocstrings."""
    return "\n\n".join([f"# {title}", *(f"::: lightning_memopt.{name}" for name in names)]) + "\n"


def on_files(files: Files, config: dict) -> Files:
    for name, source in (("index.md", "README.md"), ("changelog.md", "CHANGELOG.md")):
        text = for_site((ROOT / source).read_text(encoding="utf-8"))
        files.append(File.generated(config, name, content=text))
    for name, (title, names) in API_PAGES.items():
        files.append(File.generated(config, name, content=api_page(title, names)))
    return files
