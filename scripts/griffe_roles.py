"""Griffe extension for the documentation site: the package's docstrings, rewritten at build time for the API pages.

The docstrings are written for ``help()`` and an editor as much as for the site, so they keep Sphinx roles and
repository paths; mkdocstrings would print those as text. When the package is loaded, every docstring of it gets:

* Sphinx roles (``:func:`~lightning_memopt.plan_memory```, ``:meth:`from_plan```, ``:class:`~.counter.LiveBytes```)
  as autorefs cross-references: a link where the object has a place on an API page, code where it is internal or
  outside the package. A target found nowhere (a typo) is logged as a warning, which fails ``mkdocs build --strict``.
* ``docs/<page>.md`` as a link to that guide, titled with its heading (a missing guide is a warning too).
* A blank line between a sentence ending with ``:`` and the bullet list under it, which Markdown needs.

In the docstrings the site shows, a code span that is exactly a public name (````MemoryAudit````) becomes a link too,
and a pointer into a private module's source ("(see ``callbacks/_states.py``)") is dropped; any other mention of a
private module's file is a warning.

"Bases:" names no internal class: one the package root does not export is replaced by its own bases, a private
stand-in that is no class (``_Base = object``) is dropped, and an internal stand-in for an outside class
(``utilities.namespaces.Callback``) becomes the outside class configured for it in ``external_bases`` (mkdocs.yml).
An internal base whose own bases are computed (``class Callback(*classes(...))``) and that has no entry there is a
warning.
"""

from __future__ import annotations

import builtins
import importlib.util
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml
from griffe import (
    AliasResolutionError,
    Class,
    CyclicAliasError,
    Expr,
    ExprAttribute,
    ExprName,
    Extension,
    GriffeLoader,
    Module,
    NameResolutionError,
    Object,
)

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "lightning_memopt"
#: Where the guides are, seen from an API page (every one is under ``api/``).
GUIDES_FROM_API = "../"
_LOG = logging.getLogger("mkdocs.plugins.griffe_roles")

ROLE = re.compile(r":(?:py:)?(func|meth|class|attr|mod|data|exc|obj|const):`([^`]+)`")
GUIDE = re.compile(r"(?<![\w/])(?P<quote>`{0,2})docs/(?P<page>[\w-]+\.md)(?P<anchor>#[\w-]+)?(?P=quote)")
#: A code span naming a (dotted) name, with ``()`` or not, not already link text (nor a role's target).
CODE_NAME = re.compile(r"(?<![`\[:])(?P<ticks>``?)(?P<name>[A-Za-z_][\w.]*\w)(?P<call>\(\))?(?P=ticks)(?!`)")
SOURCE_POINTER = re.compile(r"\s*\(see ``[\w/]*/_\w+\.py``\)")
PRIVATE_FILE = re.compile(r"[\w/]*(?<![\w])_[a-z]\w*\.py\b")
_BULLET = re.compile(r"\s*(?:[-*+]|\d+\.) ")
_SECTION_TITLE = re.compile(r"[\w][\s\w-]*:\s*$")  # "Args:", "Note:": Google sections, which griffe parses itself
_ERRORS = (AliasResolutionError, CyclicAliasError, KeyError, NameResolutionError, ValueError)

#: How a role's target resolved: the autorefs identifier of its place on the site, "" when it has none (internal
#: or outside the package: shown as code) or None when it is found nowhere.
Lookup = Callable[[str, str], "str | None"]


def split_role(content: str) -> tuple[str, str]:
    """The text shown for a role's content and its target: ``title <target>``, ``~a.b`` (shows ``b``), ``a.b``."""
    content = " ".join(content.split())  # a role may be wrapped over lines
    explicit = re.fullmatch(r"(.+?)\s*<([^>]+)>", content)
    if explicit:
        return explicit.group(1), explicit.group(2).replace(" ", "").lstrip("~!")
    target = content.replace(" ", "").lstrip("!")
    if target.startswith("~"):
        target = target[1:]
        return target.rsplit(".", 1)[-1], target
    return target, target


def rewrite_roles(text: str, lookup: Lookup, problems: list[str]) -> str:
    """``text`` with each Sphinx role as an autorefs link, or as code; unresolved roles are added to ``problems``."""

    def replace(match: re.Match[str]) -> str:
        title, target = split_role(match.group(2))
        identifier = lookup(match.group(1), target)
        if identifier is None:
            problems.append(match.group(0))
        if identifier:
            return f"[`{title}`][{identifier}]"
        return f"`{title}`"

    return ROLE.sub(replace, text)


def rewrite_guides(text: str, titles: dict[str, str], problems: list[str]) -> str:
    """``text`` with each ``docs/<page>.md`` as a link to the guide; a page not in ``titles`` goes to ``problems``."""

    def replace(match: re.Match[str]) -> str:
        page, anchor = match.group("page"), match.group("anchor") or ""
        if page not in titles:
            problems.append(match.group(0))
            return match.group(0)
        return f"[{titles[page]}]({GUIDES_FROM_API}{page}{anchor})"

    return GUIDE.sub(replace, text)


def link_code_names(text: str, public: dict[str, str]) -> str:
    """``text`` with each code span that is exactly a documented public name (``MemoryAudit``,
    ``MemoryPreset.from_name()``) as a link to it; ``public`` maps such names to their autorefs identifiers."""

    def replace(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in public:
            return match.group(0)
        return f"[`{name}{match.group('call') or ''}`][{public[name]}]"

    return CODE_NAME.sub(replace, text)


def drop_source_pointers(text: str, problems: list[str]) -> str:
    """``text`` without "(see ``callbacks/_states.py``)": a pointer into a private module means nothing on the
    site. Any other mention of a private module's file goes to ``problems``."""
    text = SOURCE_POINTER.sub("", text)
    problems.extend(match.group(0) for match in PRIVATE_FILE.finditer(text))
    return text


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _opens_list(line: str, following: str) -> bool:
    """Whether ``line`` is a top-level sentence ending with ``:`` and ``following`` the first item of a list."""
    top_level_text = _indent(line) == 0 and line.rstrip().endswith(":") and not _BULLET.match(line)
    return top_level_text and not _SECTION_TITLE.match(line) and bool(_BULLET.match(following))


def separate_lists(text: str) -> str:
    """``text`` with a blank line before each list that follows a top-level ``...:`` line, the list dedented."""
    lines = text.split("\n")
    out: list[str] = []
    index = 0
    while index < len(lines):
        out.append(lines[index])
        index += 1
        if index < len(lines) and _opens_list(out[-1], lines[index]):
            shift = _indent(lines[index])
            out.append("")
            while index < len(lines) and lines[index].strip() and _indent(lines[index]) >= shift:
                out.append(lines[index][shift:])
                index += 1
    return "\n".join(out)


class _ConfigLoader(yaml.SafeLoader):
    """Reads mkdocs.yml, with any ``!tag`` (``!relative``, ``!!python/name:``) read as nothing."""


_ConfigLoader.add_multi_constructor("", lambda loader, suffix, node: None)


def _nav_pages(entries: Any) -> Iterator[tuple[str, str]]:
    for entry in entries if isinstance(entries, list) else []:
        for title, value in entry.items() if isinstance(entry, dict) else ():
            if isinstance(value, str):
                yield value, title
            else:
                yield from _nav_pages(value)


def guide_titles(config: Path, docs: Path) -> dict[str, str]:
    """``page.md`` -> the title mkdocs.yml's nav gives the guide (else its heading), for each guide in ``docs``."""
    nav = dict(_nav_pages(yaml.load(config.read_text(encoding="utf-8"), Loader=_ConfigLoader).get("nav")))
    titles = {}
    for path in sorted(docs.glob("*.md")):
        lines = path.read_text(encoding="utf-8").splitlines()
        heading = next((line.removeprefix("# ").strip() for line in lines if line.startswith("# ")), path.stem)
        titles[path.name] = nav.get(path.name, heading)
    return titles


def is_private(path: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in path.split("."))


def walk(obj: Object) -> Iterator[Object]:
    """``obj`` and every object defined under it (not the names it imports)."""
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from walk(member)  # type: ignore[arg-type]


def documented(collection: Any, names: list[str]) -> dict[str, str]:
    """Canonical path -> autorefs identifier, for each object the API pages render (``lightning_memopt.<name>`` and
    its public members with a docstring: mkdocs.yml's filters and mkdocstrings' default)."""
    places: dict[str, str] = {}

    def add(obj: Any, identifier: str) -> None:
        places.setdefault(obj.canonical_path, identifier)
        for member in obj.members.values():
            if not member.name.startswith("_") and not member.is_alias and member.has_docstrings:
                add(member, f"{identifier}.{member.name}")

    for name in names:
        obj = collection[f"{PACKAGE}.{name}"]
        add(getattr(obj, "final_target", obj), f"{PACKAGE}.{name}")
    return places


class Resolver:
    """Finds the object a role names, the way Sphinx would from the object whose docstring holds it."""

    def __init__(self, collection: Any, places: dict[str, str]) -> None:
        self.collection = collection
        self.places = places
        #: ``MemoryPreset.from_name`` -> its identifier, for each object the API pages show.
        self.public = {place.removeprefix(f"{PACKAGE}."): place for place in places.values()}

    def lookup(self, scope: Object, target: str) -> str | None:
        path = self.find(scope, target)
        if path is None:
            return "" if self.is_outside(scope, target) else None
        if path in self.places:
            return self.places[path]
        # A member the page does not show on its own (a field without a docstring): the class that lists it.
        return self.places.get(path.rpartition(".")[0], "")

    def find(self, scope: Object, target: str) -> str | None:
        """The canonical path of the package object ``target`` names from ``scope``, or None."""
        for candidate in self.candidates(scope, target):
            try:
                obj = self.collection[candidate]
                return obj.canonical_path
            except _ERRORS:
                continue
        return None

    def candidates(self, scope: Object, target: str) -> Iterator[str]:
        if target.startswith("."):
            module = scope.module
            yield f"{module.path}{target}"
            if module.parent is not None:
                yield f"{module.parent.path}{target}"
            return
        first, _, rest = target.partition(".")
        try:
            in_scope = scope.resolve(first)
        except NameResolutionError:
            in_scope = None
        if in_scope is not None:
            yield ".".join(filter(None, [in_scope, rest]))
        yield target
        yield f"{PACKAGE}.{target}"

    def is_outside(self, scope: Object, target: str) -> bool:
        """Whether ``target`` names something outside the package: a builtin, an installed module or an import."""
        first = target.lstrip(".").partition(".")[0]
        if target.startswith(".") or first == PACKAGE:
            return False
        if hasattr(builtins, first) or importlib.util.find_spec(first) is not None:
            return True
        try:
            return not scope.resolve(first).startswith(f"{PACKAGE}.")
        except NameResolutionError:
            return False


def on_site(obj: Object, places: dict[str, str]) -> bool:
    """Whether an API page shows ``obj``'s docstring (a merged ``__init__``'s with its class's)."""
    if obj.name == "__init__" and obj.parent is not None:
        return obj.parent.path in places
    return obj.path in places


def _load_api_pages() -> dict[str, tuple[str, list[str]]]:
    spec = importlib.util.spec_from_file_location("_mkdocs_hooks_for_griffe", ROOT / "scripts" / "mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.API_PAGES


class SiteDocstrings(Extension):
    """Rewrites the package's docstrings and bases for the site once the package is loaded (see the module)."""

    def __init__(self, external_bases: dict[str, str] | None = None) -> None:
        super().__init__()
        self.external_bases = external_bases or {}
        #: Every reference that names nothing, also in docstrings the site does not show (:func:`main` lists them).
        self.unresolved: list[str] = []

    def on_package(self, *, pkg: Module, loader: GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != PACKAGE:
            return
        names = [name for _, page_names in _load_api_pages().values() for name in page_names]
        resolver = Resolver(loader.modules_collection, documented(loader.modules_collection, names))
        titles = guide_titles(ROOT / "mkdocs.yml", ROOT / "docs")
        for obj in walk(pkg):
            shown = on_site(obj, resolver.places)
            if obj.docstring is not None:
                self.rewrite_docstring(obj, resolver, titles, shown)
            if shown and isinstance(obj, Class):
                obj.extra.setdefault("griffe_roles", {})["bases"] = self.public_bases(obj, loader)

    def rewrite_docstring(self, obj: Object, resolver: Resolver, titles: dict[str, str], shown: bool) -> None:
        """Rewrite ``obj``'s docstring; a reference that names nothing is a warning where the site shows it."""
        problems: list[str] = []
        text = rewrite_roles(obj.docstring.value, lambda _, target: resolver.lookup(obj, target), problems)
        text = rewrite_guides(text, titles, problems)
        if shown:
            public = {name: place for name, place in resolver.public.items() if place != resolver.places.get(obj.path)}
            text = drop_source_pointers(link_code_names(text, public), problems)
        obj.docstring.value = separate_lists(text)
        for problem in problems:
            message = f"{obj.relative_filepath}:{obj.docstring.lineno}: {obj.path}: {problem} names nothing"
            self.unresolved.append(message)
            if shown:
                _LOG.warning(message)

    def public_bases(self, cls: Class, loader: GriffeLoader) -> list[str | Expr]:
        """``cls``'s bases with each internal class replaced by its own bases and each internal stand-in for an
        outside class by that class (``external_bases``), each once."""
        bases: dict[str, str | Expr] = {}
        for base in cls.bases:
            path = base.canonical_path if isinstance(base, Expr) else base
            for shown in self.shown_base(cls, base, path, loader):
                bases.setdefault(shown.canonical_path if isinstance(shown, Expr) else shown, shown)
        return list(bases.values())

    def shown_base(self, cls: Class, base: str | Expr, path: str, loader: GriffeLoader) -> list[str | Expr]:
        if path in self.external_bases:
            module, _, name = self.external_bases[path].rpartition(".")
            return [ExprName(name, parent=module)]
        if not path.startswith(f"{PACKAGE}.") or self.is_public(path, loader):
            return [base]
        try:
            found = loader.modules_collection[path]
            base_class = getattr(found, "final_target", found)
        except _ERRORS:
            base_class = None
        if isinstance(base_class, Class) and all(
            isinstance(name, (str, ExprName, ExprAttribute)) for name in base_class.bases
        ):
            return self.public_bases(base_class, loader)
        if is_private(path) and not isinstance(base_class, Class):  # a stand-in (``_Base = object`` at run time)
            return []
        _LOG.warning(f"{cls.path}: base {path} is internal and its bases are computed; add it to external_bases")
        return [base]

    @staticmethod
    def is_public(path: str, loader: GriffeLoader) -> bool:
        """Whether ``path`` is a name the package root exports."""
        root = loader.modules_collection[PACKAGE]
        for name in root.exports or ():
            try:
                if root[name].canonical_path == path:
                    return True
            except _ERRORS:
                continue
        return False


def python_options(config: Path) -> dict[str, Any]:
    """The options of mkdocs.yml's mkdocstrings python handler."""
    plugins = yaml.load(config.read_text(encoding="utf-8"), Loader=_ConfigLoader)["plugins"]
    configured = [plugin for plugin in plugins if isinstance(plugin, dict)]
    mkdocstrings = next(plugin["mkdocstrings"] for plugin in configured if "mkdocstrings" in plugin)
    return mkdocstrings["handlers"]["python"]["options"]


def configured_options(config: Path) -> dict[str, Any]:
    """The options mkdocs.yml gives this extension (under the python handler's ``extensions``)."""
    for extension in python_options(config).get("extensions", []):
        if isinstance(extension, dict) and Path(next(iter(extension))).name == Path(__file__).name:
            return next(iter(extension.values())) or {}
    return {}


def main() -> int:
    """List every reference that names nothing in the package's docstrings, shown on the site or not (the build
    only fails on the shown ones): ``python scripts/griffe_roles.py``. Exit status 1 when there is one."""
    import griffe

    extension = SiteDocstrings(**configured_options(ROOT / "mkdocs.yml"))
    griffe.load(PACKAGE, search_paths=[ROOT], try_relative_path=False, extensions=griffe.load_extensions(extension))
    print(*extension.unresolved, sep="\n")
    return 1 if extension.unresolved else 0


if __name__ == "__main__":
    raise SystemExit(main())
