"""The package's shape: one-way imports between layers, no import cycles, function-level limits, broad excepts.

Layers, lowest first: ``utilities`` -> ``functional`` / ``analysis`` (Trainer-free cores) -> ``callbacks`` /
``metrics`` / ``plugins`` -> ``presets`` / ``planner`` -> the package root (``__init__``, ``cli``). A module may
import its own layer and the layers below it, never one above (lazy imports inside functions included).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_memopt"

LAYERS = {
    "__about__": 0,
    "utilities": 0,
    "functional": 1,
    "analysis": 1,
    "callbacks": 2,
    "metrics": 2,
    "data": 2,
    "plugins": 2,
    "presets": 3,
    "planner": 3,
    "__init__": 4,
    "cli": 4,
    "cli_estimate": 4,
}

#: Upward imports that are allowed, with the reason. (importer, imported)
ALLOWED_UPWARD: set[tuple[str, str]] = set()


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
    return _imports_in(module, ast.parse(path.read_text(encoding="utf-8")), path.name == "__init__.py")


def _imports_in(module: str, tree: ast.AST, is_package: bool) -> set[str]:
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


def _runtime_imports(module: str, path: Path) -> set[str]:
    """The package modules ``module`` imports when it runs (``if TYPE_CHECKING:`` blocks left out)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = [ast.Pass()]
    found = _imports_in(module, tree, path.name == "__init__.py")
    return {name for name in found if name in _MODULES and name != module}


def _import_cycles(modules: dict[str, Path]) -> list[list[str]]:
    """Strongly connected groups of more than one module in the import graph (lazy imports included)."""
    graph = {name: sorted(_runtime_imports(name, path)) for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, []):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for name in graph:
        if name not in index:
            visit(name)
    return sorted(cycles)


def test_no_import_cycles():
    assert _import_cycles(_MODULES) == []


def test_the_cycle_check_sees_a_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / "lightning_memopt" / "functional"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("def f():\n    from lightning_memopt.functional.b import g\n")
    (pkg / "b.py").write_text("from lightning_memopt.functional.a import f\n")
    fakes = {"lightning_memopt.functional.a": pkg / "a.py", "lightning_memopt.functional.b": pkg / "b.py"}
    monkeypatch.setattr(sys.modules[__name__], "_MODULES", fakes)
    assert _import_cycles(fakes) == [["lightning_memopt.functional.a", "lightning_memopt.functional.b"]]


#: Function-level limits, the defaults of the tools that define them: McCabe's complexity 10 (his own threshold,
#: ruff's default), 12 branches and 50 statements (pylint's defaults). A function past them reads as several.
FUNCTION_LIMITS = ("--select", "C901,PLR0912,PLR0915")


def _ruff_function_limits(*paths: str) -> list[str]:
    ruff = Path(sys.executable).with_name("ruff")
    command = [str(ruff) if ruff.exists() else "ruff", "check", "--no-cache", "--output-format", "concise", "-q"]
    result = subprocess.run([*command, *FUNCTION_LIMITS, *paths], cwd=ROOT, capture_output=True, text=True)
    return [line for line in result.stdout.splitlines() if line.strip()]


def test_functions_stay_small():
    """Complexity, not file length, is what a reader feels: every function of the package and the examples."""
    assert _ruff_function_limits("lightning_memopt", "examples") == []


def test_the_function_limits_bite(tmp_path):
    branches = "\n".join(f"    if x == {i}:\n        return {i}" for i in range(14))
    (tmp_path / "big.py").write_text(f"def f(x):\n{branches}\n    return -1\n")
    found = _ruff_function_limits(str(tmp_path / "big.py"))
    assert any("C901" in line for line in found) and any("PLR0912" in line for line in found)


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


#: Calls that read or convert a value rather than do work: an arm holding only these still picks a value.
_VALUE_CALLS = frozenset({
    "abs", "all", "any", "bool", "dict", "float", "frozenset", "getattr", "hasattr", "id", "int", "isinstance",
    "len", "list", "max", "min", "repr", "round", "set", "sorted", "str", "sum", "tuple", "type",
})  # fmt: skip
_WORK = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Lambda, ast.Await, ast.Yield, ast.NamedExpr)
#: Conditional expressions per 1,000 lines, at most. Lightning's callbacks, loops and trainer: 8-10; this package
#: at 0.1.0: 26, packing branches into expressions to meet the function limits above.
CONDITIONAL_EXPRESSIONS_PER_1000_LINES = 15


def _does_work(arm: ast.expr) -> bool:
    for node in ast.walk(arm):
        if isinstance(node, (*_WORK, ast.IfExp)):
            return True
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in _VALUE_CALLS):
            return True
    return False


def branching_expressions(path: Path, root: Path = ROOT) -> list[str]:
    """``a if c else b`` that is a branch in disguise: nested, spread over lines, or an arm that calls, loops or
    binds. Such a choice reads better (and counts towards the complexity limits) as an ``if`` statement."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.IfExp):
            continue
        in_test = any(isinstance(part, (ast.IfExp, ast.NamedExpr)) for part in ast.walk(node.test))
        if node.end_lineno != node.lineno or in_test or _does_work(node.body) or _does_work(node.orelse):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)[:100]}")
    return found


def _conditional_expression_density(paths: list[Path]) -> float:
    lines = expressions = 0
    for path in paths:
        text = path.read_text(encoding="utf-8")
        lines += text.count("\n")
        expressions += sum(isinstance(node, ast.IfExp) for node in ast.walk(ast.parse(text)))
    return 1000 * expressions / max(lines, 1)


def test_conditionals_branch_as_statements():
    """Where a conditional expression branches it is written as a statement, and the package uses them no more
    often than a bound near Lightning's own code."""
    paths = sorted(PACKAGE.rglob("*.py"))
    assert [line for path in paths for line in branching_expressions(path)] == []
    assert _conditional_expression_density(paths) <= CONDITIONAL_EXPRESSIONS_PER_1000_LINES


def test_the_conditional_check_bites(tmp_path):
    code = {
        "nested.py": "x = 1 if a else 2 if b else 3\n",
        "spread.py": "x = (\n    1\n    if a\n    else 2\n)\n",
        "calls.py": "x = load(path) if path else None\n",
        "loops.py": "x = [i for i in y] if y else []\n",
        "test.py": "x = 1 if (n := len(y)) else 2\n",
    }
    for name, text in code.items():
        (tmp_path / name).write_text(text)
    found = {name: len(branching_expressions(tmp_path / name, tmp_path)) for name in code}
    assert found == dict.fromkeys(code, 1)
    (tmp_path / "plain.py").write_text("x = 's' if len(y) > 1 else ''\nz = str(v) if v is not None else 'n/a'\n")
    assert branching_expressions(tmp_path / "plain.py", tmp_path) == []
    assert _conditional_expression_density([tmp_path / "plain.py"]) == 1000.0
