"""The documentation site's API pages: what scripts/griffe_roles.py rewrites in the docstrings (checked on strings
and on a copy of the package with a broken docstring), then one strict build of the site, whose API pages must show
no raw Sphinx role, no ``docs/<page>.md`` as text, no internal class in "Bases:", MemoryMonitor's lists as lists,
links that lead to built files and signatures that fit; and, where Chromium is installed, nothing wider than the page
(scripts/check_api_pages.py)."""

from __future__ import annotations

import html
import importlib.util
import inspect
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_memopt

ROOT = Path(__file__).resolve().parents[1]
ROLE_TEXT = re.compile(r":(func|meth|class|attr|mod|data|exc|obj):")
GUIDE_TEXT = re.compile(r"docs/[\w-]+\.md")
PRIVATE_PATH = re.compile(r"lightning_memopt(?:\.\w+)*\._\w+|[\w/]*/_\w+\.py")


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses and griffe look it up
    spec.loader.exec_module(module)
    return module


pytest.importorskip("griffe", reason="the docs extra is not installed (bash scripts/bootstrap.sh test,docs)")
roles = _script("griffe_roles")
check_api_pages = _script("check_api_pages")
#: mkdocs.yml's line_length: ruff formats each longer signature to it (80 characters fit the column at 1280 px).
SIGNATURE_WIDTH = roles.python_options(ROOT / "mkdocs.yml")["line_length"]


# The rewrites, on strings.


def test_a_role_becomes_a_link_code_or_a_problem():
    places = {"lightning_memopt.plan_memory": "lightning_memopt.plan_memory", "torch.Tensor": ""}
    problems: list[str] = []
    text = "See :func:`~lightning_memopt.plan_memory`, :class:`torch.Tensor` and :meth:`no_such_thing`."
    out = roles.rewrite_roles(text, lambda _, target: places.get(target), problems)
    assert out == "See [`plan_memory`][lightning_memopt.plan_memory], `torch.Tensor` and `no_such_thing`."
    assert problems == [":meth:`no_such_thing`"]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("~lightning_memopt.a.\n    b.sample", ("sample", "lightning_memopt.a.b.sample")),
        ("Preset.plan <lightning_memopt.Preset.plan>", ("Preset.plan", "lightning_memopt.Preset.plan")),
        ("~.counter.LiveBytes", ("LiveBytes", ".counter.LiveBytes")),
        ("from_plan", ("from_plan", "from_plan")),
    ],
)
def test_split_role(content, expected):
    assert roles.split_role(content) == expected


def test_a_guide_reference_becomes_a_relative_link():
    problems: list[str] = []
    text = "Details: ``docs/presets.md``, ``docs/oom-report.md#the-report`` and docs/nope.md."
    out = roles.rewrite_guides(text, {"presets.md": "Presets", "oom-report.md": "OOM"}, problems)
    assert out == "Details: [Presets](../presets.md), [OOM](../oom-report.md#the-report) and docs/nope.md."
    assert problems == ["docs/nope.md"]


def test_every_guide_has_a_title():
    titles = roles.guide_titles(ROOT / "mkdocs.yml", ROOT / "docs")
    assert titles["presets.md"] == "Presets"
    assert set(titles) == {path.name for path in (ROOT / "docs").glob("*.md")}


def test_a_list_after_a_colon_gets_its_blank_line():
    text = "Logged metrics (bytes):\n    * ``a``, ``b``:\n      every step.\n    * ``c``.\nAfter.\n\nArgs:\n    - x: y"
    out = roles.separate_lists(text)
    assert out == "Logged metrics (bytes):\n\n* ``a``, ``b``:\n  every step.\n* ``c``.\nAfter.\n\nArgs:\n    - x: y"


def test_a_public_name_in_code_becomes_a_link():
    public = {"MemoryAudit": "lightning_memopt.MemoryAudit", "Preset.name": "lightning_memopt.Preset.name"}
    text = "Shared with ``MemoryAudit``, see `Preset.name()`; ``setup`` and ```MemoryAudit``` stay."
    out = roles.link_code_names(text, public)
    assert out == (
        "Shared with [`MemoryAudit`][lightning_memopt.MemoryAudit], see "
        "[`Preset.name()`][lightning_memopt.Preset.name]; ``setup`` and ```MemoryAudit``` stay."
    )


def test_a_pointer_into_a_private_module_is_dropped_and_any_other_is_a_problem():
    problems: list[str] = []
    out = roles.drop_source_pointers("It raises (see ``callbacks/_states.py``), and ``utilities/_x.py`` too.", problems)
    assert out == "It raises, and ``utilities/_x.py`` too."
    assert problems == ["utilities/_x.py"]


# The extension, on a copy of the package.


def _load(package_root: Path):
    """The package in ``package_root`` as griffe loads it with the extension (never the one in the working folder)."""
    import griffe

    bases = {"lightning_memopt.utilities.namespaces.Callback": "lightning.Callback"}
    extensions = griffe.load_extensions(roles.SiteDocstrings(external_bases=bases))
    pkg = griffe.load("lightning_memopt", search_paths=[package_root], try_relative_path=False, extensions=extensions)
    assert pkg.filepath == package_root / "lightning_memopt" / "__init__.py"
    return pkg


def test_the_extension_links_resolves_and_hides_internal_bases():
    pkg = _load(ROOT)
    monitor = pkg["callbacks.memory_monitor.MemoryMonitor"]
    assert "[The memory log](../memory-log.md)" in monitor.docstring.value
    assert "[`MemoryAudit`][lightning_memopt.MemoryAudit]" in monitor.docstring.value
    assert [base.canonical_path for base in monitor.extra["griffe_roles"]["bases"]] == ["lightning.Callback"]
    assert [base.name for base in monitor.bases] == ["RankLogCallback"]  # the real bases: inheritance needs them
    assert not ROLE_TEXT.search(pkg["planner.plan.plan_memory"].docstring.value)


def test_a_role_that_names_nothing_is_a_warning_where_the_site_shows_it(tmp_path, caplog):
    shutil.copytree(ROOT / "lightning_memopt", tmp_path / "lightning_memopt", ignore=shutil.ignore_patterns("*.pyc"))
    source = tmp_path / "lightning_memopt" / "callbacks" / "memory_monitor.py"
    text, count = re.subn(
        r'(class MemoryMonitor\(.*\):\n    """)', r"\1See :func:`plan_memroy`. ", source.read_text("utf-8")
    )
    assert count == 1
    source.write_text(text, encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="mkdocs.plugins.griffe_roles"):
        _load(tmp_path)
    messages = [record.getMessage() for record in caplog.records if "plan_memroy" in record.getMessage()]
    assert len(messages) == 1
    assert re.fullmatch(
        r".*lightning_memopt/callbacks/memory_monitor\.py:\d+: .*MemoryMonitor: :func:`plan_memroy` .*", messages[0]
    )


def test_mkdocs_yml_maps_each_internal_stand_in_to_lightning():
    options = roles.configured_options(ROOT / "mkdocs.yml")
    assert set(options["external_bases"]) == {
        "lightning_memopt.utilities.namespaces.Callback",
        "lightning_memopt.utilities.namespaces.Precision",
    }


# The built site: one strict build, every check on it.


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (bash scripts/bootstrap.sh test,docs)")
    folder = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return folder


def _pages(site: Path) -> dict[str, str]:
    return {page.parent.name: page.read_text(encoding="utf-8") for page in sorted((site / "api").glob("*/index.html"))}


def _text(markup: str) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", markup))


def _article(markup: str) -> str:
    return markup[markup.index("<article") : markup.index("</article>")]


def raw_text_problems(pages: dict[str, str]) -> list[str]:
    problems = []
    for name, markup in pages.items():
        text = _text(_article(markup))
        for pattern in (ROLE_TEXT, GUIDE_TEXT):
            problems += [f"{name}: raw {match.group(0)!r}" for match in pattern.finditer(text)]
        problems += [f"{name}: private path {match!r}" for match in PRIVATE_PATH.findall(_article(markup))]
    return problems


def bases_problems(pages: dict[str, str]) -> list[str]:
    public = {f"lightning_memopt.{name}" for name in lightning_memopt.__all__}
    problems = []
    for name, markup in pages.items():
        for bases in re.findall(r'<p class="doc doc-class-bases">(.*?)</p>', markup, re.S):
            for path in re.findall(r'title="([^"]+)"', bases) or [_text(bases)]:
                internal = path.startswith("lightning_memopt.") and path not in public
                if internal or "._" in path or _text(bases).strip().startswith(("Bases: _", "_")):
                    problems.append(f"{name}: Bases: {path}")
    return problems


def list_problems(pages: dict[str, str]) -> list[str]:
    """Each bullet of MemoryMonitor's docstring must be an item of a list in its section of the callbacks page."""
    markup = pages["callbacks"]
    section = markup[
        markup.index('id="lightning_memopt.MemoryMonitor"') : markup.index('id="lightning_memopt.CacheCleaner"')
    ]
    items = [_text(item) for item in re.findall(r"<li>(.*?)</li>", section, re.S)]
    bullets = [
        line.strip()[2:]
        for line in inspect.getdoc(lightning_memopt.MemoryMonitor).splitlines()
        if line.strip()[:2] in ("* ", "- ")
    ]
    assert bullets, "MemoryMonitor's docstring has no list any more: update this check"
    expected = [re.sub(r"``([^`]+)``", r"\1", bullet).split(",")[0] for bullet in bullets]
    missing = [first for first in expected if not any(item.startswith(first) for item in items)]
    return [f"callbacks: MemoryMonitor's list item {first!r} is not a <li>" for first in missing]


def link_problems(site: Path, pages: dict[str, str]) -> list[str]:
    """Every relative link in an API page's content leads to a built file; the guides are among them."""
    problems, guides = [], set()
    for name, markup in pages.items():
        for href in re.findall(r'<a [^>]*href="([^"#]+)[^"]*"', _article(markup)):
            if "://" in href or href.startswith("mailto:"):
                continue
            target = (site / "api" / name / href).resolve()
            if not (target / "index.html" if target.is_dir() else target).is_file():
                problems.append(f"{name}: link {href} leads to no built file")
            if target.parent == site.resolve() and (ROOT / "docs" / f"{target.name}.md").is_file():
                guides.add(target.name)
    if not guides:
        problems.append("no API page links to a guide")
    return problems


def signature_problems(pages: dict[str, str]) -> list[str]:
    problems = []
    for name, markup in pages.items():
        for signature in re.findall(r'<div class="doc-signature.*?</code>', markup, re.S):
            long_lines = [line for line in _text(signature).splitlines() if len(line) > SIGNATURE_WIDTH]
            problems += [f"{name}: signature line of {len(line)} characters: {line!r}" for line in long_lines]
    return problems


def test_the_api_pages_render_every_reference_list_and_signature(site):
    pages = _pages(site)
    assert set(pages) == {page.removeprefix("api/").removesuffix(".md") for page in roles._load_api_pages()}
    problems = [
        *raw_text_problems(pages),
        *bases_problems(pages),
        *list_problems(pages),
        *link_problems(site, pages),
        *signature_problems(pages),
    ]
    assert not problems, "\n".join(problems)


def _browser() -> str:
    browser = check_api_pages.find_browser()
    if browser is None:
        pytest.skip("no Chromium installed (the Debian package chromium): the API pages were not opened in a browser")
    return browser


# Every built API page in the browser: a step of scripts/test.sh (CI), on the site it has just built.


def test_the_browser_check_sees_a_signature_and_a_line_that_run_off(request, tmp_path):
    browser = _browser()
    site = request.getfixturevalue("site")
    copy = tmp_path / "site"
    shutil.copytree(site, copy, ignore=shutil.ignore_patterns("assets", "search"))
    for page in copy.glob("api/*/index.html"):
        if page.parent.name != "precision":
            shutil.rmtree(page.parent)
    shutil.copytree(site / "assets", copy / "assets")
    page = copy / "api" / "precision" / "index.html"
    markup = page.read_text(encoding="utf-8")
    wide = "<code>" + "x" * 300 + "</code>"
    markup = markup.replace(
        '<span class="nf">MemoryPrecision</span>', f'<span class="nf">MemoryPrecision{"_" * 100}</span>', 1
    )
    page.write_text(
        markup.replace("</article>", f'<p style="white-space: nowrap">{wide}</p></article>', 1), encoding="utf-8"
    )
    problems, _ = check_api_pages.check(copy, browser, screenshots=None)
    assert [problem.split(":")[0] for problem in problems] == ["signature", "sticks-out"], problems
