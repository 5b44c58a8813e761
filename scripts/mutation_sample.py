"""Random mutation sample of the core modules: how many machine-made one-operator mutants the fast tests miss.

``scripts/mutation_check.py`` runs hand-picked mutants, chosen by whoever wrote the tests. This script picks its
mutants at random (seeded), so its survival rate is the less flattering, more honest figure. It parses every module
of ``lightning_memopt/functional`` and ``lightning_memopt/analysis``, lists the places one operator can be swapped
(``<`` / ``<=``, ``==`` / ``!=``, ``+`` / ``-``, ``and`` / ``or``, ``not x`` -> ``x``, an integer ``n`` -> ``n + 1``,
``True`` / ``False``), draws ``--count`` of them, and for each one writes the mutated module (``ast.unparse``),
runs the fast tests (``-m "not slow"``) of the test files that use one of the module's names, and puts the file
back (also when the script is stopped). A mutant that neither those tests nor the module's doctests notice
"survives". Only failures the mutant causes count: as in ``mutation_check.py``, the same tests run once per module
on the unmutated code first, and what fails there (or cannot be collected) is left out of the mutant's run; a
mutant with nothing left to run is "unjudged". Some survivors are equivalent mutants (no behaviour changed), so
the rate is an upper bound on what the tests miss; each survivor is printed for a reader to judge.

    .venv/bin/python scripts/mutation_sample.py --count 40 --seed 0
"""

from __future__ import annotations

import argparse
import ast
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from mutation_check import Baseline, baseline, judge

ROOT = Path(__file__).resolve().parents[1]
CORE = ("lightning_memopt/functional", "lightning_memopt/analysis")

SWAPS: dict[type, type] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Add: ast.Sub,
    ast.Sub: ast.Add,
    ast.Mult: ast.FloorDiv,
    ast.FloorDiv: ast.Mult,
    ast.And: ast.Or,
    ast.Or: ast.And,
}


@dataclass(frozen=True)
class Site:
    path: Path
    index: int  # the n-th mutable place of the module, in ast.walk order
    line: int
    description: str


def _docstring_nodes(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _places(tree: ast.AST) -> list[tuple[ast.AST, str]]:
    """Each mutable place as (node, description), in ast.walk order; the same order for a copy of the tree."""
    docstrings = _docstring_nodes(tree)
    places: list[tuple[ast.AST, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in SWAPS:
            places.append((node, f"{type(node.ops[0]).__name__} -> {SWAPS[type(node.ops[0])].__name__}"))
        elif isinstance(node, (ast.BinOp, ast.AugAssign, ast.BoolOp)) and type(node.op) in SWAPS:
            places.append((node, f"{type(node.op).__name__} -> {SWAPS[type(node.op)].__name__}"))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            places.append((node, "not x -> x"))
        elif isinstance(node, ast.Constant) and id(node) not in docstrings:
            if isinstance(node.value, bool):
                places.append((node, f"{node.value} -> {not node.value}"))
            elif isinstance(node.value, int):
                places.append((node, f"{node.value} -> {node.value + 1}"))
    return places


def _mutate(node: ast.AST) -> None:
    if isinstance(node, ast.Compare):
        node.ops = [SWAPS[type(node.ops[0])]()]
    elif isinstance(node, (ast.BinOp, ast.AugAssign, ast.BoolOp)):
        node.op = SWAPS[type(node.op)]()
    elif isinstance(node, ast.Constant):
        node.value = (not node.value) if isinstance(node.value, bool) else node.value + 1


class _DropNot(ast.NodeTransformer):
    def __init__(self, target: ast.AST) -> None:
        self.target = target

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        return node.operand if node is self.target else self.generic_visit(node)


def mutated_source(site: Site) -> str:
    tree = ast.parse(site.path.read_text(encoding="utf-8"))
    node, _ = _places(tree)[site.index]
    if isinstance(node, ast.UnaryOp):
        tree = _DropNot(node).visit(tree)
    else:
        _mutate(node)
    return ast.unparse(ast.fix_missing_locations(tree))


def _modules(paths: tuple[str, ...]) -> list[Path]:
    """The modules under ``paths`` (folders or files, relative to the repository), each once, in order."""
    found: dict[Path, None] = {}
    for given in paths:
        where = ROOT / given
        if where.is_dir():
            found.update(dict.fromkeys(sorted(where.rglob("*.py"))))
        elif where.suffix == ".py":
            found[where] = None
    return list(found)


def all_sites(paths: tuple[str, ...] = CORE) -> list[Site]:
    sites = []
    for path in _modules(paths):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for index, (node, description) in enumerate(_places(tree)):
            sites.append(Site(path, index, getattr(node, "lineno", 0), description))
    return sites


def _public_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = {
        node.name
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_")
    }
    dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    names.add(dotted)
    parent = dotted.rpartition(".")[0]
    if parent not in ("", "lightning_memopt", "lightning_memopt.functional"):  # a package's modules: its tests too
        names.add(parent)
    return names


def _importers(path: Path) -> list[Path]:
    """Modules of the package that import ``path``'s module: the callbacks, metrics, presets ... built on it."""
    dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    pattern = re.compile(r"\b" + re.escape(dotted) + r"\b")
    return [p for p in sorted((ROOT / "lightning_memopt").rglob("*.py")) if p != path and pattern.search(p.read_text())]


def tests_for(path: Path) -> list[str]:
    """Test files that use one of the public names of the module or of the modules that import it (the callbacks
    built on a core), or name the module or the package it is part of."""
    names = _public_names(path)
    for importer in _importers(path):
        names |= {n for n in _public_names(importer) if not n.startswith("lightning_memopt")}
    pattern = re.compile(r"\b(" + "|".join(re.escape(n) for n in sorted(names)) + r")\b")
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if pattern.search(p.read_text(encoding="utf-8"))
    )


def run(site: Site, timeout: float, baselines: dict[Path, Baseline] | None = None) -> tuple[str, float, list[str]]:
    """'killed', 'survived', 'unjudged' or 'no tests', the seconds taken and the test files run.

    The module's tests run unmutated first (once per module: ``baselines`` caches them); what fails there is left
    out of the mutant's run, so a test broken by the environment cannot kill a mutant."""
    tests = tests_for(site.path)
    if not tests:
        return "no tests", 0.0, tests
    paths = [str(site.path.relative_to(ROOT)), *tests]  # the module's doctests too
    baselines = {} if baselines is None else baselines
    start = time.perf_counter()
    if site.path not in baselines:
        try:
            baselines[site.path] = baseline(paths, ROOT, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "unjudged", time.perf_counter() - start, tests  # unmutated too slow: nothing to compare with
    source = site.path.read_text(encoding="utf-8")
    mutated = mutated_source(site)
    try:
        site.path.write_text(mutated, encoding="utf-8")
        outcome = judge(baselines[site.path].command(paths), ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        outcome = "killed"  # a mutant that makes the tests hang is noticed
    finally:
        site.path.write_text(source, encoding="utf-8")
    return outcome, time.perf_counter() - start, tests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=40, help="mutants to draw (default 40)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the draw (default 0)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per mutant's test run")
    parser.add_argument("--list", action="store_true", help="print the drawn mutants and exit")
    parser.add_argument(
        "--paths",
        nargs="+",
        default=list(CORE),
        help="modules or folders to draw from (default: the functional and analysis cores), e.g. the modules a"
        " release changed: --paths $(git diff --name-only --diff-filter=d v0.1.0 -- 'lightning_memopt/*.py')",
    )
    args = parser.parse_args(argv)
    sites = all_sites(tuple(args.paths))
    drawn = random.Random(args.seed).sample(sites, min(args.count, len(sites)))
    print(f"{len(sites)} mutable places in {', '.join(args.paths)}; drawn {len(drawn)} (seed {args.seed})", flush=True)
    counts = {"killed": 0, "survived": 0, "unjudged": 0, "no tests": 0}
    baselines: dict[Path, Baseline] = {}
    for site in drawn:
        where = f"{site.path.relative_to(ROOT)}:{site.line} {site.description}"
        if args.list:
            print(where)
            continue
        outcome, seconds, tests = run(site, args.timeout, baselines)
        counts[outcome] += 1
        print(f"{outcome:8} {where} ({seconds:.1f} s, {len(tests)} test files)", flush=True)
    if args.list:
        return 0
    tested = counts["killed"] + counts["survived"]
    rate = counts["survived"] / max(1, tested)
    print(
        f"{counts['survived']} of {tested} mutants survived ({rate:.0%}); "
        f"{counts['no tests']} drawn in modules no test file names; "
        f"{counts['unjudged']} whose tests all fail (or time out) unmutated"
    )
    return 0


if __name__ == "__main__":
    # The original file is put back on Ctrl-C and on a kill (the finally in run()).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"stopped by signal {signum}"))
    raise SystemExit(main())
