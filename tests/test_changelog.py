"""The CHANGELOG keeps Keep a Changelog's shape, and its newest release is the package's version."""

from __future__ import annotations

import datetime
import re
from pathlib import Path

from packaging.version import Version

from lightning_memopt import __version__

ROOT = Path(__file__).resolve().parents[1]
_RELEASE = re.compile(r"^## \[(?P<version>[^\]]+)\] - (?P<date>\d{4}-\d{2}-\d{2})$")
_KINDS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}


def releases(text: str) -> list[tuple[str, str]]:
    """``(version, date)`` of every dated ``## [version] - date`` heading, newest first as written."""
    found = []
    for line in text.splitlines():
        match = _RELEASE.match(line)
        if match:
            found.append((match["version"], match["date"]))
    return found


def shape_problems(text: str) -> list[str]:
    """What breaks the shape: headings other than Unreleased or a dated release, unknown kinds of change, releases
    out of order or dated in the future."""
    problems = []
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    if not headings or headings[0] != "## [Unreleased]":
        problems.append("the first section is not `## [Unreleased]`")
    problems += [f"not a release heading: {h!r}" for h in headings[1:] if not _RELEASE.match(h)]
    problems += [
        f"unknown kind of change: {line!r}"
        for line in text.splitlines()
        if line.startswith("### ") and line[4:] not in _KINDS
    ]
    dated = releases(text)
    versions = [Version(v) for v, _ in dated]
    if versions != sorted(versions, reverse=True) or len(set(versions)) != len(versions):
        problems.append(f"releases not newest first: {[str(v) for v in versions]}")
    today = datetime.date.today().isoformat()
    problems += [f"{v} is dated in the future ({d})" for v, d in dated if d > today]
    return problems


def test_the_changelog_keeps_its_shape_and_its_newest_release_is_the_version():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert shape_problems(text) == []
    assert releases(text)[0][0] == __version__


def test_the_shape_check_bites():
    good = "## [Unreleased]\n\n### Added\n\n## [0.2.0] - 2026-01-02\n\n### Fixed\n\n## [0.1.0] - 2026-01-01\n"
    assert shape_problems(good) == [] and releases(good)[0] == ("0.2.0", "2026-01-02")
    assert shape_problems(good.replace("### Fixed", "### Improvements"))
    assert shape_problems(good.replace("## [0.2.0] - 2026-01-02", "## 0.2.0"))
    assert shape_problems(good.replace("0.2.0", "0.0.9"))  # out of order
    assert shape_problems(good.replace("2026-01-02", "2999-01-02"))
    assert shape_problems(good.replace("## [Unreleased]\n", ""))
