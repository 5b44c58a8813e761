"""``scripts/mutation_check.py`` stays runnable: every mutant's snippet is in its module exactly once and its tests
exist (the script itself runs the tests on each mutant; that takes half a minute, so it is not part of the suite)."""

import importlib.util
import sys

import pytest

from tests.helpers.subprocess_run import REPO_ROOT

spec = importlib.util.spec_from_file_location("mutation_check", REPO_ROOT / "scripts" / "mutation_check.py")
mutation_check = importlib.util.module_from_spec(spec)
sys.modules.setdefault("mutation_check", mutation_check)  # its dataclasses look their module up there
spec.loader.exec_module(mutation_check)


@pytest.mark.parametrize("mutant", mutation_check.MUTANTS, ids=lambda m: m.name)
def test_every_mutant_applies_once_and_names_existing_tests(mutant):
    source = (REPO_ROOT / mutant.path).read_text()
    assert source.count(mutant.original) == 1, mutant.name
    assert mutant.mutated != mutant.original
    for test in mutant.tests:
        assert (REPO_ROOT / test).exists(), test
