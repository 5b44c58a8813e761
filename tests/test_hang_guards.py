"""Hang guards in the tests stay far from normal run times, so a loaded CI machine never fails a clean run.

A time bound is there to turn a hang (or a regression to hours) into a failure, not to measure speed: a 2-process
run that took 61 s against a 60 s bound failed a clean CI run. The floors, over every file under ``tests/``
(scripts and helpers included):

* ``timeout=N`` of a call that starts processes (``subprocess.run``/``Popen``/``communicate``/..., ``run_file``,
  ``run_script``, ``run_script_once``): at least ``PROCESS_FLOOR_S``, and ``MULTI_PROCESS_FLOOR_S`` when the script
  it runs starts several processes (DDP, FSDP, ``mp.start_processes``). A fresh interpreter that imports torch and
  Lightning takes 5-20 s on 2 shared cores, a 2-process fit 10-40 s (measured for 0.2); the floors are 6x and 7x
  the slow ends. The ``timeout`` defaults of the helpers: ``MULTI_PROCESS_FLOOR_S`` (multi-process runs use them).
* A process group's ``timeout=timedelta(...)``: at least ``PROCESS_FLOOR_S`` (a rank waits there for the others'
  start-up). A line saying ``not a hang guard`` (or with that comment above it) is left out: a time-out that is
  the behaviour under test.
* An elapsed time measured in the test (``time.perf_counter() - start``, or a name assigned from it, or an
  ``elapsed``/``seconds`` value unpacked from a fixture) compared with ``<``: at least the floor of the processes
  the function or its fixture starts, else ``IN_PROCESS_FLOOR_S`` (in-process bounds guard against work that
  grew from milliseconds to seconds: 0.25 s is over 100x the calls timed that way).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
SCRIPTS = TESTS / "scripts"

PROCESS_FLOOR_S = 120.0
MULTI_PROCESS_FLOOR_S = 300.0
IN_PROCESS_FLOOR_S = 0.25

#: Calls that start processes (by the called name's last part).
_LAUNCHERS = {"run", "Popen", "communicate", "check_output", "check_call", "call", "run_file", "run_script"}
_LAUNCHERS_ONCE = {"run_script_once"}
_TIMERS = {"perf_counter", "monotonic", "time"}
_ELAPSED_WORDS = ("elapsed", "seconds", "took", "duration", "wall")
_MULTI = re.compile(
    r"devices\s*=\s*[2-9]|nprocs\s*=|world_size\s*=\s*[2-9]|NUM_NODES|DDPStrategy|ModelParallelStrategy"
    r"|strategy\s*=\s*[\"']ddp|init_process_group|--(?:num_)?devices\W+[2-9]"
)
_EXEMPT = "not a hang guard"

#: Violations in files owned elsewhere, reported for a fix: (path, source line). Each must still be found (remove
#: it once fixed), so the list only shrinks.
KNOWN: set[tuple[str, str]] = set()


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return ""


def _number(node: ast.AST) -> float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return float(node.value)
    return None


def _runs_several_processes(call: ast.Call, source: str) -> bool:
    """Whether the call runs a ``tests/scripts`` file (``SCRIPTS / "x.py"`` or ``"x.py"``) that starts several."""
    for arg in [*call.args, *(k.value for k in call.keywords)]:
        for node in ast.walk(arg):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.endswith(".py"):
                script = SCRIPTS / node.value
                if script.is_file() and _MULTI.search(script.read_text()):
                    return True
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _MULTI.search(node.value):
                return True
    return False


def _launch_floor(call: ast.Call, source: str) -> float | None:
    """The timeout floor of a call that starts processes, ``None`` for other calls."""
    name = _name(call.func)
    if name not in _LAUNCHERS | _LAUNCHERS_ONCE:
        return None
    if _runs_several_processes(call, source):
        return MULTI_PROCESS_FLOOR_S
    return PROCESS_FLOOR_S


def _timer_difference(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Sub)
        and isinstance(node.left, ast.Call)
        and _name(node.left.func) in _TIMERS
    )


class _Module:
    """One test file: its violations as ``(line, source line, what)``."""

    def __init__(self, path: Path) -> None:
        self.source = path.read_text()
        self.lines = self.source.splitlines()
        self.tree = ast.parse(self.source)
        self.functions = {f.name: f for f in ast.walk(self.tree) if isinstance(f, ast.FunctionDef)}
        self.found: list[tuple[int, str, str]] = []

    def _say(self, node: ast.AST, what: str) -> None:
        line = self.lines[node.lineno - 1].strip()  # type: ignore[attr-defined]
        if _EXEMPT not in self.lines[node.lineno - 2] + line:  # type: ignore[attr-defined]
            self.found.append((node.lineno, line, what))  # type: ignore[attr-defined]

    def function_floor(self, function: ast.FunctionDef, seen: frozenset[str] = frozenset()) -> float:
        """The floor for times measured in ``function``: the processes it or its fixtures start."""
        floors = [IN_PROCESS_FLOOR_S]
        for node in ast.walk(function):
            if isinstance(node, ast.Call):
                floors.append(_launch_floor(node, self.source) or IN_PROCESS_FLOOR_S)
        for arg in function.args.args:
            fixture = self.functions.get(arg.arg)
            if fixture is not None and arg.arg not in seen:
                floors.append(self.function_floor(fixture, seen | {function.name}))
        return max(floors)

    def check(self) -> list[tuple[int, str, str]]:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call):
                self._check_timeouts(node)
            if isinstance(node, ast.FunctionDef):
                self._check_defaults(node)
                self._check_elapsed(node)
        return sorted(self.found)

    def _check_timeouts(self, call: ast.Call) -> None:
        for keyword in call.keywords:
            if keyword.arg != "timeout":
                continue
            value = _number(keyword.value)
            floor = _launch_floor(call, self.source)
            if value is not None and floor is not None and value < floor:
                self._say(call, f"timeout={value:g} s of a process, below the floor of {floor:g} s")
            if isinstance(keyword.value, ast.Call) and _name(keyword.value.func) == "timedelta":
                seconds = _timedelta_seconds(keyword.value)
                if seconds is not None and seconds < PROCESS_FLOOR_S:
                    self._say(call, f"a process group time-out of {seconds:g} s, below {PROCESS_FLOOR_S:g} s")

    def _check_defaults(self, function: ast.FunctionDef) -> None:
        if not function.name.startswith("run"):
            return
        args = function.args.args[len(function.args.args) - len(function.args.defaults) :]
        for arg, default in zip(args, function.args.defaults):
            value = _number(default)
            if arg.arg == "timeout" and value is not None and value < MULTI_PROCESS_FLOOR_S:
                self._say(default, f"a helper's default timeout of {value:g} s, below {MULTI_PROCESS_FLOOR_S:g} s")

    def _check_elapsed(self, function: ast.FunctionDef) -> None:
        timed = self._elapsed_names(function)
        floor: float | None = None
        for node in ast.walk(function):
            if not isinstance(node, ast.Compare) or len(node.ops) != 1:
                continue
            left, right, op = node.left, node.comparators[0], node.ops[0]
            if isinstance(op, (ast.Gt, ast.GtE)):
                left, right = right, left
            elif not isinstance(op, (ast.Lt, ast.LtE)):
                continue
            value = _number(right)
            if value is None or not (_timer_difference(left) or _name(left) in timed):
                continue
            floor = floor if floor is not None else self.function_floor(function)
            if value < floor:
                self._say(node, f"an elapsed time bound of {value:g} s, below the floor of {floor:g} s here")

    def _elapsed_names(self, function: ast.FunctionDef) -> set[str]:
        """Names holding a time measured here, or unpacked from a fixture (``directory, elapsed = run``)."""
        fixtures = {a.arg for a in function.args.args if a.arg in self.functions}
        names = set()
        for node in ast.walk(function):
            if not isinstance(node, ast.Assign):
                continue
            targets = [t for target in node.targets for t in ast.walk(target) if isinstance(t, ast.Name)]
            if _timer_difference(node.value):
                names.update(t.id for t in targets)
            elif isinstance(node.value, ast.Name) and node.value.id in fixtures:
                names.update(t.id for t in targets if any(w in t.id for w in _ELAPSED_WORDS))
        return names


def _timedelta_seconds(call: ast.Call) -> float | None:
    units = {"seconds": 1.0, "minutes": 60.0, "hours": 3600.0}
    total = 0.0
    for keyword in call.keywords:
        value = _number(keyword.value)
        if keyword.arg not in units or value is None:
            return None
        total += value * units[keyword.arg]
    return total if call.keywords else None


def violations(path: Path) -> list[tuple[int, str, str]]:
    """``(line, source line, what)`` for each hang guard in ``path`` below its floor."""
    return _Module(path).check()


def _all() -> dict[tuple[str, str], str]:
    found = {}
    for path in sorted(TESTS.rglob("*.py")):
        for line, text, what in violations(path):
            found[(path.relative_to(ROOT).as_posix(), text)] = f"{path.relative_to(ROOT)}:{line}: {what}: {text}"
    return found


def test_every_hang_guard_is_far_from_normal_run_times():
    found = _all()
    new = [message for key, message in found.items() if key not in KNOWN]
    assert not new, "widen these bounds (see this file's docstring for the floors):\n" + "\n".join(new)


def test_every_known_violation_is_still_there():
    gone = KNOWN - set(_all())
    assert not gone, f"fixed: remove them from KNOWN: {sorted(gone)}"


BAD = """
import subprocess, time
from datetime import timedelta
from tests.helpers.subprocess_run import SCRIPTS, run_file

def run_it(code, timeout: float = 60):
    pass

def test_ddp(tmp_path):
    start = time.monotonic()
    result = run_file(SCRIPTS / "oom_ddp_failure.py", tmp_path, timeout=90)
    elapsed = time.monotonic() - start
    assert elapsed < 60

def test_fast():
    start = time.perf_counter()
    assert time.perf_counter() - start < 0.1

def test_subprocess():
    subprocess.run(["python", "-c", "pass"], timeout=30)
    strategy = DDPStrategy(timeout=timedelta(seconds=60))

@pytest.fixture
def launched(tmp_path):
    start = time.monotonic()
    run_file(SCRIPTS / "fsdp2_callbacks.py", tmp_path, timeout=600)
    return tmp_path, time.monotonic() - start

def test_from_fixture(launched):
    directory, elapsed = launched
    assert 60 > elapsed
"""


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        (BAD, [6, 11, 13, 17, 20, 21, 31]),
        (BAD.replace("timeout=90", "timeout=420").replace("elapsed < 60", "elapsed < 300"), [6, 17, 20, 21, 31]),
        ("import time\n\ndef test_ok():\n    t = time.perf_counter()\n    assert time.perf_counter() - t < 1\n", []),
        ("from datetime import timedelta\nx = f(timeout=timedelta(seconds=4))  # not a hang guard: tested\n", []),
        ("# not a hang guard: tested\nx = f(timeout=timedelta(seconds=4))\ny = f(timeout=timedelta(seconds=4))\n", [3]),
    ],
    ids=["bad", "widened", "in-process", "exempt", "exempt-above"],
)
def test_the_check_finds_bounds_below_their_floors(tmp_path, snippet, expected):
    path = tmp_path / "test_snippet.py"
    path.write_text(snippet)
    assert [line for line, _, _ in violations(path)] == expected
