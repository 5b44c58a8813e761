"""The package's shape: one-way imports between layers, size limits, and where broad excepts may stand.

Layers, lowest first: ``utilities`` -> ``functional`` / ``analysis`` (Trainer-free cores) -> ``callbacks`` /
``metrics`` / ``plugins`` -> ``presets`` / ``planner`` -> the package root (``__init__``, ``cli``). A module may
import its own layer and the layers below it, never one above (lazy imports inside functions included).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_memopt"

LAYERS = {
    "__about__": 0,
    "utilities": 0,
    "functional": 1,
    "analysis": 1,
    "callbacks": 2,
    "metrics": 2,
    "plugins": 2,
    "presets": 3,
    "planner": 3,
    "__init__": 4,
    "cli": 4,
    "cli_estimate": 4,
}

#: Upward imports that are allowed, with the reason. (importer, imported)
ALLOWED_UPWARD = {
    # The documented ``lightning_memopt.plugins.MemoryPreset`` / ``MemoryPresetCLI`` paths, resolved on first use.
    ("lightning_memopt.plugins", "lightning_memopt.presets"),
}

MAX_MODULE_LINES = 400
MAX_CALLBACK_LINES = 250
MAX_EXAMPLE_LINES = 250


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _layer(module: str) -> int:
    parts = module.split(".")
    key = parts[1] if len(parts) > 1 else "__init__"
    if key not in LAYERS:
        raise AssertionError(f"{module}: not in a known layer; add its top-level name to LAYERS in {__file__}")
    return LAYERS[key]


def _imports(module: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.add(target)
            # ``from lightning_memopt import callbacks`` imports a subpackage.
            found.update(f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in _MODULES)
    return {name for name in found if name == "lightning_memopt" or name.startswith("lightning_memopt.")}


_MODULES = _modules()


def _upward_imports() -> list[str]:
    problems = []
    for module, path in _MODULES.items():
        for target in sorted(_imports(module, path)):
            if target == "lightning_memopt.__about__" or target == module:
                continue
            if _layer(target) > _layer(module) and not any(
                module.startswith(a) and target.startswith(b) for a, b in ALLOWED_UPWARD
            ):
                problems.append(f"{module} (layer {_layer(module)}) imports {target} (layer {_layer(target)})")
    return problems


def test_imports_flow_one_way():
    assert _upward_imports() == []


def test_the_import_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The check itself bites: a functional module importing a callback is reported."""
    fake = tmp_path / "lightning_memopt" / "functional" / "bad.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("def f():\n    from lightning_memopt.callbacks import MemoryMonitor\n")
    monkeypatch.setattr(sys.modules[__name__], "_MODULES", {"lightning_memopt.functional.bad": fake})
    assert _upward_imports() == [
        "lightning_memopt.functional.bad (layer 1) imports lightning_memopt.callbacks (layer 2)"
    ]


def _line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


@pytest.mark.parametrize(
    ("pattern", "limit"),
    [
        ("lightning_memopt/**/*.py", MAX_MODULE_LINES),
        ("lightning_memopt/callbacks/*.py", MAX_CALLBACK_LINES),
        ("examples/**/*.py", MAX_EXAMPLE_LINES),
    ],
)
def test_files_stay_small(pattern, limit):
    too_long = {str(p.relative_to(ROOT)): _line_count(p) for p in ROOT.glob(pattern) if _line_count(p) > limit}
    assert too_long == {}, f"over {limit} lines: split along the module's own sections"


def _broad_excepts(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ExceptHandler):
            names = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
            broad = node.type is None or any(
                isinstance(n, ast.Name) and n.id in ("Exception", "BaseException") for n in names
            )
            cleans_up_and_raises = isinstance(node.body[-1], ast.Raise) and node.body[-1].exc is None
            if broad and not cleans_up_and_raises:
                lines.append(node.lineno)
    return lines


def test_functional_code_raises():
    """Broad excepts ("never stop training") belong at the callback/metric boundary, not in the cores; a handler
    that cleans up and re-raises is fine."""
    found = {
        str(p.relative_to(ROOT)): _broad_excepts(p)
        for layer in ("functional", "analysis")
        for p in (PACKAGE / layer).rglob("*.py")
        if _broad_excepts(p)
    }
    assert found == {}
