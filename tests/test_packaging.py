"""What a pip user gets: the sdist and the wheel built from a copy of this tree, and the wheel in a fresh venv.

The build runs without isolation (offline, seconds): ``build`` still checks that the running interpreter meets the
``[build-system]`` requirements. The fresh venv lies outside the repository and sees the dependencies through a
``.pth`` file naming the site-packages directories this interpreter imports them from; the package it imports is
the installed wheel, never this checkout.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.message import Message
from email.parser import HeaderParser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
# Top-level paths of a working tree that are not the project (virtual environments, build and run outputs).
_NOT_PROJECT = {".git", ".venv", "build", "dist", "site", "outputs", "lightning_logs", ".whl", ".gpu"}
_CACHES = ("__pycache__", "*.pyc", "*.egg-info", ".pytest_cache", ".ruff_cache", ".mypy_cache", ".hypothesis")
# Folders the sdist carries whole (MANIFEST.in): a pip user's copy of the repository.
_SDIST_DIRS = ("docs", "examples", "scripts", "tests", "benchmarks", "lightning_memopt")
# Build-log lines that name a warning but are not one: the file list, and two distutils notes about this
# environment (PYTHONDONTWRITEBYTECODE) and about a clean tree (MANIFEST.in's global-exclude found no bytecode).
_FILE_VERBS = re.compile(r"\s*(copying|adding|creating|hard linking|writing|reading|removing|making) ")
_BENIGN = re.compile(r"warning: (\w+: byte-compiling is disabled|no previously-included files matching)")


def _version_in_source() -> str:
    tree = ast.parse((ROOT / "lightning_memopt" / "__about__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("no __version__ in lightning_memopt/__about__.py")


def _ignore(directory: str, names: list[str]) -> set[str]:
    ignored = set(shutil.ignore_patterns(*_CACHES)(directory, names))
    if Path(directory) == ROOT:
        ignored |= _NOT_PROJECT & set(names)
    return ignored


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    """``(source copy, sdist, wheel, build log)``: the wheel is built from the sdist, as ``python -m build`` does."""
    base = tmp_path_factory.mktemp("packaging")
    source = base / "source"
    shutil.copytree(ROOT, source, ignore=_ignore, symlinks=True)
    out = base / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return source, sdist, wheel, log


def _sdist_names(sdist: Path) -> set[str]:
    with tarfile.open(sdist) as tar:
        return {m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile()}


def _wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return {n for n in zf.namelist() if not n.endswith("/")}


def _dist_info(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as zf:
        (path,) = [n for n in zf.namelist() if n.endswith(f".dist-info/{name}")]
        return zf.read(path).decode()


def _sdist_pkg_info(sdist: Path) -> str:
    with tarfile.open(sdist) as tar:
        top = tar.getmembers()[0].name.split("/", 1)[0]
        member = tar.extractfile(f"{top}/PKG-INFO")
        assert member is not None
        return member.read().decode()


def test_build_prints_no_warnings(dists):
    *_, log = dists
    assert [line for line in log.splitlines() if "deprecat" in line.lower()] == []
    warnings = [
        line
        for line in log.splitlines()
        if re.search("warn", line, re.IGNORECASE) and not _FILE_VERBS.match(line) and not _BENIGN.match(line)
    ]
    assert warnings == []


@pytest.mark.parametrize("which", ["wheel", "sdist"])
def test_metadata(dists, which):
    tomllib = pytest.importorskip("tomllib")
    _, sdist, wheel, _ = dists
    text = _dist_info(wheel, "METADATA") if which == "wheel" else _sdist_pkg_info(sdist)
    meta: Message = HeaderParser().parsestr(text)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    assert Version(meta["Metadata-Version"]) >= Version("2.4")  # PEP 639: License-Expression
    assert meta["Name"] == "lightning-memopt"
    assert meta["Version"] == _version_in_source()
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert meta["License"] is None
    assert not [c for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    assert meta["Requires-Python"] == project["requires-python"]
    assert meta["Description-Content-Type"] == "text/markdown"
    expected = {str(Requirement(r)) for r in project["dependencies"]}
    for extra, requirements in project["optional-dependencies"].items():
        expected |= {str(Requirement(f'{r}; extra == "{extra}"')) for r in requirements}
    assert {str(Requirement(r)) for r in meta.get_all("Requires-Dist")} == expected
    assert set(meta.get_all("Provides-Extra")) == set(project["optional-dependencies"])


def test_wheel_entry_point_and_license(dists):
    _, _, wheel, _ = dists
    entry_points = _dist_info(wheel, "entry_points.txt").split()
    assert entry_points == ["[console_scripts]", "lightning-memopt", "=", "lightning_memopt.cli:main"]
    assert _dist_info(wheel, "licenses/LICENSE") == (ROOT / "LICENSE").read_text()


def test_wheel_contents(dists):
    """Every module of the source tree, the type marker and the guides; nothing outside the package."""
    source, _, wheel, _ = dists
    names = _wheel_names(wheel)
    package = {n for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    modules = {p.relative_to(source).as_posix() for p in (source / "lightning_memopt").rglob("*.py")}
    guides = {f"lightning_memopt/docs/{p.name}" for p in (source / "docs").glob("*.md")}
    assert "lightning_memopt/docs/memory-log.md" in guides
    assert package == modules | guides | {"lightning_memopt/py.typed"}


def test_sdist_contents(dists):
    """The sdist is the repository for a pip user: every file of the project folders, no bytecode."""
    source, sdist, _, _ = dists
    names = _sdist_names(sdist)
    expected = {p.relative_to(source).as_posix() for d in _SDIST_DIRS for p in (source / d).rglob("*") if p.is_file()}
    assert {"examples/dreams/config.yaml", "docs/memory-log.md", "scripts/main.sh"} <= expected
    expected |= {"README.md", "LICENSE", "CHANGELOG.md", "pyproject.toml", "MANIFEST.in", "PKG-INFO"}
    assert expected <= names, sorted(expected - names)
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


# Paths that are named but are not files to ship: an output folder and a placeholder in a comment.
_NOT_SHIPPED = {"benchmarks/results/gpu", "examples/x/Y.py"}
_POINTER = re.compile(r"\b((?:docs|examples|benchmarks|scripts|tests)/[\w.-]+(?:/[\w.-]+)*)")
_DOTTED = re.compile(r"\b(examples(?:\.\w+)+)")


def _pointers(text: str) -> set[str]:
    paths = {p.rstrip(".") for p in _POINTER.findall(text)}
    for dotted in _DOTTED.findall(text):  # examples.dreams.module.SpectraFineTuner -> examples/dreams/module.py
        paths.add(dotted.replace(".", "/") + ".py")
    return paths


def _exists(path: str, names: set[str]) -> bool:
    return path in names or any(n.startswith(path.rstrip("/") + "/") for n in names)


def _modules_of(dotted: str, names: set[str]) -> bool:
    parts = dotted[: -len(".py")].split("/")
    return any("/".join(parts[:i]) + ".py" in names for i in range(len(parts), 1, -1))


def test_every_path_a_user_is_pointed_to_is_shipped(dists):
    """docs/<page>.md in a docstring or --help is in the wheel; examples, scripts, benchmarks in the sdist."""
    source, sdist, wheel, _ = dists
    wheel_names, sdist_names = _wheel_names(wheel), _sdist_names(sdist)
    package_text = "\n".join(p.read_text() for p in (source / "lightning_memopt").rglob("*.py"))
    in_package = _pointers(package_text)
    guides = {p for p in in_package if p.startswith("docs/")}
    assert guides, "the docstrings cite the guides"
    assert [g for g in guides if f"lightning_memopt/{g}" not in wheel_names] == []
    everything = in_package | _pointers((source / "README.md").read_text())
    missing = [p for p in everything - _NOT_SHIPPED if not _exists(p, sdist_names) and not _modules_of(p, sdist_names)]
    assert missing == []


def _dependency_dirs() -> list[str]:
    """The site-packages directories this interpreter imports the dependencies from (not this checkout)."""
    import lightning
    import psutil
    import torch
    import torchmetrics

    dirs = {str(Path(m.__file__).resolve().parents[1]) for m in (torch, lightning, torchmetrics, psutil)}
    dirs |= {p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")}
    return sorted(d for d in dirs if Path(d).is_dir() and not Path(d).resolve().is_relative_to(ROOT))


def test_wheel_in_a_fresh_venv(dists, tmp_path):
    _, _, wheel, _ = dists
    # Nothing of this checkout on the path, for pip too (it would take an egg-info here for an installed copy).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)]
    proc = subprocess.run(install, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert "Successfully installed lightning-memopt" in proc.stdout, proc.stdout + proc.stderr
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    site_packages = Path(out.stdout.strip())
    (site_packages / "_dependencies.pth").write_text("\n".join(_dependency_dirs()) + "\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def run(*args: str) -> str:
        proc = subprocess.run(args, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    cli = str(venv / "bin" / "lightning-memopt")
    assert run(cli, "--help").startswith("usage: lightning-memopt")
    for command in ("analyze", "report", "estimate"):
        assert run(cli, command, "--help").startswith(f"usage: lightning-memopt {command}")
    assert run(cli, "--version").split() == ["lightning-memopt", _version_in_source()]
    code = (
        "import importlib.metadata as m, pathlib, lightning_memopt as p; "
        "print(pathlib.Path(p.__file__).resolve()); print(p.__version__, m.version('lightning-memopt')); "
        "print(sorted(f.name for f in (pathlib.Path(p.__file__).parent / 'docs').glob('*.md')))"
    )
    where, versions, guides = run(str(python), "-c", code).splitlines()
    assert Path(where) == (site_packages / "lightning_memopt" / "__init__.py").resolve()
    assert versions.split() == [_version_in_source()] * 2
    assert guides == str(sorted(p.name for p in (ROOT / "docs").glob("*.md")))
