"""MkDocs hooks: the site's home page is README.md and its changelog CHANGELOG.md, so each text has one source.

Links in README.md that point into ``docs/`` are rewritten to the site's pages; a link to any other file of the
repository (an example, a script) becomes plain text naming the path, since the site does not carry it.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
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


def on_files(files: Files, config: dict) -> Files:
    for name, source in (("index.md", "README.md"), ("changelog.md", "CHANGELOG.md")):
        text = for_site((ROOT / source).read_text(encoding="utf-8"))
        files.append(File.generated(config, name, content=text))
    return files
