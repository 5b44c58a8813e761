"""``scripts/mutation_check.py`` and ``scripts/mutation_sample.py`` stay runnable and honest.

Every hand-picked mutant's snippet is in its module exactly once and its tests exist (the script itself runs the
tests on each mutant; that takes minutes, so it is not part of the suite). Only failures a mutant causes count:
a test that fails on the unmutated code too (a missing extra, a broken environment) must not kill a mutant; that
is checked on a two-file project in ``tmp_path``.
"""

import importlib.util
import sys
import textwrap

import pytest

from tests.helpers.subprocess_run import REPO_ROOT


def _load(name):
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)  # its dataclasses (and mutation_sample's import) look it up there
    spec.loader.exec_module(module)
    return sys.modules[name]


mutation_check = _load("mutation_check")
mutation_sample = _load("mutation_sample")


@pytest.mark.parametrize("mutant", mutation_check.MUTANTS, ids=lambda m: m.name)
def test_every_mutant_applies_once_and_names_existing_tests(mutant):
    source = (REPO_ROOT / mutant.path).read_text()
    assert source.count(mutant.original) == 1, mutant.name
    assert mutant.mutated != mutant.original
    for test in mutant.tests:
        assert (REPO_ROOT / test).exists(), test


def test_the_short_summary_gives_failed_tests_and_files_that_cannot_be_collected():
    output = textwrap.dedent(
        """\
        .F.E                                                                     [100%]
        =========================== short test summary info ============================
        FAILED tests/test_api.py::test_reference[mkdocs] - ModuleNotFoundError: No module named 'mkdocs'
        ERROR tests/test_io.py::test_write - fixture 'gpu' not found
        ERROR tests/test_docs.py - ModuleNotFoundError: No module named 'mkdocstrings'
        FAILED tests/test_long_name.py::test_without_a_message
        1 failed, 2 passed, 2 errors in 0.12s
        """
    )
    assert mutation_check.failed_in(output) == {
        "tests/test_api.py::test_reference[mkdocs]",
        "tests/test_io.py::test_write",
        "tests/test_docs.py",
        "tests/test_long_name.py::test_without_a_message",
    }
    assert mutation_check.failed_in("3 passed in 0.01s") == set()


PROJECT = {
    "calc.py": "def add(a, b):\n    return a + b\n",
    "test_calc.py": (
        "from calc import add\n\n\n"
        "def test_add():\n    assert add(2, 1) == 3\n\n\n"
        "def test_needs_a_missing_extra():\n    import not_installed_extra  # noqa: F401\n"
    ),
    "test_broken.py": "import not_installed_extra  # noqa: F401\n\n\ndef test_never_collected():\n    pass\n",
    "test_unrelated.py": "def test_always_fails():\n    raise AssertionError('broken environment')\n",
}


@pytest.fixture
def project(tmp_path):
    for name, text in PROJECT.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def _mutant(mutated, tests):
    return mutation_check.Mutant("m", "calc.py", "return a + b", mutated, tests)


def test_failures_on_the_unmutated_code_are_left_out_and_do_not_kill_a_mutant(project):
    tests = ("test_broken.py", "test_calc.py", "test_unrelated.py")
    base = mutation_check.baseline(tests, project)
    assert base.failing == {"test_calc.py::test_needs_a_missing_extra", "test_unrelated.py::test_always_fails"}
    assert base.broken == {"test_broken.py"}
    baselines = {}
    # a mutant that changes nothing the tests see survives, although two tests fail and a file cannot be collected
    assert mutation_check.run(_mutant("return b + a", tests), project, baselines)[0] == "survived"
    assert mutation_check.run(_mutant("return a - b", tests), project, baselines)[0] == "killed"
    assert list(baselines) == [tests]  # the unmutated run is made once per set of test files
    assert (project / "calc.py").read_text() == PROJECT["calc.py"]  # put back


def test_a_mutant_whose_tests_all_fail_unmutated_is_unjudged(project):
    for tests in (("test_unrelated.py",), ("test_broken.py",)):
        assert mutation_check.run(_mutant("return a - b", tests), project)[0] == "unjudged"


def test_a_mutant_breaking_collection_of_a_file_that_collects_unmutated_is_killed(project):
    assert mutation_check.run(_mutant("return a +", ("test_calc.py",)), project)[0] == "killed"


def test_the_random_sample_compares_with_the_unmutated_run_too(project, monkeypatch):
    monkeypatch.setattr(mutation_sample, "ROOT", project)
    monkeypatch.setattr(mutation_sample, "tests_for", lambda path: ["test_calc.py", "test_unrelated.py"])
    path = project / "calc.py"
    tree_places = mutation_sample._places(mutation_sample.ast.parse(path.read_text()))
    assert [description for _, description in tree_places] == ["Add -> Sub"]
    site = mutation_sample.Site(path, 0, 2, "Add -> Sub")
    outcome, _, tests = mutation_sample.run(site, timeout=120)
    assert outcome == "killed" and tests == ["test_calc.py", "test_unrelated.py"]
    assert path.read_text() == PROJECT["calc.py"]
    monkeypatch.setattr(mutation_sample, "tests_for", lambda path: ["test_unrelated.py"])
    assert mutation_sample.run(site, timeout=120)[0] == "unjudged"  # it used to count as killed


def test_the_random_sample_draws_from_the_paths_given(project, monkeypatch):
    monkeypatch.setattr(mutation_sample, "ROOT", project)
    (project / "pkg").mkdir()
    (project / "pkg" / "one.py").write_text("def f(a):\n    return a < 1\n")
    (project / "pkg" / "notes.txt").write_text("a < 1\n")
    sites = mutation_sample.all_sites(("pkg", "calc.py", "pkg/one.py", "README.md"))
    assert [(site.path.name, site.description) for site in sites] == [
        ("one.py", "Lt -> LtE"),
        ("one.py", "1 -> 2"),
        ("calc.py", "Add -> Sub"),
    ]
