"""Break one line of package code at a time and check that the tests notice (hand-picked mutants).

Each mutant replaces one exact snippet of a module, runs the tests that cover it, and puts the file back. A mutant
the tests still pass on "survives": a behaviour nothing pins down. Only failures the mutant causes count: the tests
run once on the unmutated code first (the baseline, once per set of test files), and the tests that fail there
(a missing extra, a broken environment) are left out of the mutant's run, as are test files that cannot even be
collected; a mutant whose tests all fail unmutated is "unjudged". Prints one line per mutant and the survival
rate; exits 1 when any survives or is unjudged.

    .venv/bin/python scripts/mutation_check.py            # every mutant (a few minutes)
    .venv/bin/python scripts/mutation_check.py --list     # what would run
    .venv/bin/python scripts/mutation_check.py -k oom     # the mutants whose name contains "oom"
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: A mutant's bytecode is never cached: restored within the same second at the same size, the source would look
#: unchanged to the next import, which would run the mutant.
_NO_BYTECODE = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}


#: The short test summary (``-rfE``): ``FAILED <node id> - <message>``, ``ERROR <node id or file> - <message>``.
_SUMMARY = re.compile(r"^(?:FAILED|ERROR) (\S.*?)(?: - .*)?$", re.MULTILINE)
_PYTEST = (sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-m", "not slow")
#: pytest's exit code when no test was collected (all of them left out).
NO_TESTS_COLLECTED = 5


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    original: str
    mutated: str
    tests: tuple[str, ...]


MUTANTS = (
    Mutant(
        "oom-report-tensor-names-lost",
        "lightning_memopt/functional/footprint/live.py",
        "name=names.get(key),",
        "name=None,",
        ("tests/callbacks/test_oom_reporter.py",),
    ),
    Mutant(
        "cache-cleaner-seconds-inflated",
        "lightning_memopt/callbacks/cache_cleaner.py",
        "self.seconds += time.perf_counter() - start",
        "self.seconds += time.perf_counter() - start + 1e9",
        ("tests/callbacks/test_cache_cleaner.py",),
    ),
    Mutant(
        "proc-rss-without-page-size",
        "lightning_memopt/functional/readings/host_memory.py",
        "return int(os.pread(self.fd, 256, 0).split()[1]) * self.page_size",
        "return int(os.pread(self.fd, 256, 0).split()[1])",
        ("tests/functional/test_memory.py",),
    ),
    Mutant(
        "precision-alias-16-to-true",
        "lightning_memopt/functional/precision.py",
        'PRECISION_ALIASES = {"16": "16-mixed",',
        'PRECISION_ALIASES = {"16": "16-true",',
        ("tests/plugins/test_precision_names.py",),
    ),
    Mutant(
        "preset-keeps-its-own-callback",
        "lightning_memopt/presets/preset.py",
        "replaced = tuple(kind for kind in kinds if any(isinstance(c, kind) for c in yours))",
        "replaced = ()",
        ("tests/plugins/test_preset_cli.py",),
    ),
    Mutant(
        "checkpointing-use-cache-kept",
        "lightning_memopt/functional/checkpointing.py",
        "        config.use_cache = False\n",
        "        pass\n",
        ("tests/callbacks/test_gradient_checkpointing_hf.py",),
    ),
    Mutant(
        "checkpointing-old-switch-first",
        "lightning_memopt/functional/checkpointing.py",
        "    for api in SWITCH_APIS:",
        "    for api in reversed(SWITCH_APIS):",
        ("tests/callbacks/test_gradient_checkpointing_hf.py",),
    ),
    Mutant(
        "loader-pinned-copies-ignored",
        "lightning_memopt/functional/audit/loaders.py",
        "    if host is not None and pinned:\n        host += pinned\n",
        "",
        ("tests/callbacks/test_memory_audit_loaders.py",),
    ),
    Mutant(
        "namespace-of-trainer-ignored",
        "lightning_memopt/utilities/namespaces.py",
        "    return _import(_namespace_name(obj) or NAMESPACES[0])",
        "    return _import(NAMESPACES[0])",
        ("tests/test_namespaces.py",),
    ),
    Mutant(
        "analysis-growth-warm-up-kept",
        "lightning_memopt/analysis/growth.py",
        "cut = first + (last - first) * GROWTH_WARM_UP",
        "cut = first",
        ("tests/analysis/test_growth.py",),
    ),
    Mutant(
        "analysis-negative-bytes-accepted",
        "lightning_memopt/analysis/records.py",
        "return is_finite_number(value) and value >= 0",
        "return is_finite_number(value)",
        ("tests/analysis/test_records.py",),
    ),
    Mutant(
        "analysis-peak-not-the-highest",
        "lightning_memopt/analysis/summary.py",
        "if alloc is not None and (self.peak_alloc is None or alloc > self.peak_alloc):",
        "if alloc is not None:",
        ("tests/analysis/test_summary.py",),
    ),
    Mutant(
        "retrieval-caption-stored-again",
        "lightning_memopt/metrics/streaming_retrieval.py",
        "if tid in known or tid in first_rows:",
        "if tid in first_rows:",
        ("tests/metrics/test_streaming_retrieval.py",),
    ),
    Mutant(
        "retrieval-t2v-positives-not-removed",
        "lightning_memopt/functional/retrieval/kernel.py",
        "self.text_counts.index_add_(0, pair_text, above, alpha=-1)",
        "pass",
        ("tests/functional/test_retrieval.py",),
    ),
    Mutant(
        "retrieval-tie-cells-skipped",
        "lightning_memopt/functional/retrieval/kernel.py",
        "for cell_rows, cell_cols, values in tie_cells.cells(v0, v1, t0, t1):",
        "for cell_rows, cell_cols, values in ():",
        ("tests/functional/test_retrieval_ties.py",),
    ),
    Mutant(
        "oom-fragmentation-threshold",
        "lightning_memopt/functional/oom/suggestions.py",
        "cached >= max(0.1 * f.reserved_bytes",
        "cached >= max(0.5 * f.reserved_bytes",
        ("tests/functional/test_oom.py",),
    ),
    Mutant(
        "oom-markdown-pipes-unescaped",
        "lightning_memopt/functional/oom/markdown.py",
        r'return printable("n/a" if value is None else value).replace("|", "\\|")',
        r'return printable("n/a" if value is None else value)',
        ("tests/functional/test_oom.py",),
    ),
    Mutant(
        "oom-documented-names-on-the-oldest",
        "lightning_memopt/functional/oom/store.py",
        "newest = kept[-1][1]",
        "newest = kept[0][1]",
        ("tests/functional/test_oom_store.py",),
    ),
    Mutant(
        "oom-claim-without-o-excl",
        "lightning_memopt/functional/oom/store.py",
        "os.O_WRONLY | os.O_CREAT | os.O_EXCL",
        "os.O_WRONLY | os.O_CREAT",
        ("tests/functional/test_oom_store.py",),
    ),
    Mutant(
        "printable-keeps-escape",
        "lightning_memopt/utilities/formatting.py",
        "*range(0x00, 0x20),",
        "*range(0x00, 0x1B), *range(0x1C, 0x20),",
        ("tests/utilities/test_printable.py",),
    ),
    Mutant(
        "oom-report-unredacted",
        "lightning_memopt/functional/oom/report.py",
        "return cast(OOMReport, redact_secrets(report))",
        "return report",
        ("tests/functional/test_oom_report.py",),
    ),
    Mutant(
        "own-precision-ignored",
        "lightning_memopt/functional/precision.py",
        "    return own_precision_strategy(strategy) is not None",
        "    return False",
        ("tests/plugins/test_presets.py", "tests/plugins/test_precision.py"),
    ),
    Mutant(
        "preset-table-balanced-accumulates-most",
        "lightning_memopt/functional/presets.py",
        '        "target_accumulation": 2,',
        '        "target_accumulation": 8,',
        ("tests/functional/test_presets.py",),
    ),
    Mutant(
        "allocator-env-not-given-back",
        "lightning_memopt/functional/allocator.py",
        "            os.environ.pop(state.env_name, None)",
        "            pass",
        ("tests/callbacks/test_contract.py", "tests/callbacks/test_allocator_settings.py"),
    ),
    Mutant(
        "monitor-outer-peak-not-folded",
        "lightning_memopt/functional/readings/monitoring.py",
        "            self._fold(self.active[-1], self.reader.read())\n",
        "            self.reader.read()\n",
        ("tests/functional/test_monitoring.py", "tests/callbacks/test_memory_monitor.py"),
    ),
    Mutant(
        "audit-walk-budget-ignored",
        "lightning_memopt/functional/audit/leaks.py",
        "return self._walk_s <= self.max_overhead * (self.clock() - self._last_walk_end)",
        "return True",
        ("tests/functional/test_leaks.py", "tests/callbacks/test_memory_audit.py"),
    ),
    Mutant(
        "jsonl-shared-file-closed-by-first-writer",
        "lightning_memopt/utilities/jsonl.py",
        "    if shared.users > 0:\n        return\n",
        "",
        ("tests/utilities/test_jsonl.py",),
    ),
    Mutant(
        "live-tensor-grad-fn-lost",
        "lightning_memopt/functional/footprint/live.py",
        "has_grad_fn=obj.grad_fn is not None,",
        "has_grad_fn=False,",
        ("tests/functional/test_footprint.py",),
    ),
    Mutant(
        "micro-batch-grads-not-restored",
        "lightning_memopt/functional/micro_batch/retry.py",
        "                p.grad = g.clone()\n",
        "                pass\n",
        ("tests/functional/test_micro_batch_retry.py", "tests/callbacks/test_auto_micro_batch.py"),
    ),
    Mutant(
        "micro-batch-weight-ignores-accumulate",
        "lightning_memopt/functional/micro_batch/retry.py",
        "    return samples / (batch_size * accumulate)",
        "    return samples / batch_size",
        ("tests/functional/test_micro_batch_retry.py", "tests/callbacks/test_auto_micro_batch.py"),
    ),
    Mutant(
        "micro-batch-halving-by-one",
        "lightning_memopt/functional/micro_batch/retry.py",
        "max(min_size, size // 2)",
        "max(min_size, size - 1)",
        ("tests/functional/test_micro_batch_retry.py", "tests/callbacks/test_auto_micro_batch.py"),
    ),
    Mutant(
        "planning-blocks-rounded-down",
        "lightning_memopt/functional/planning/counter.py",
        "else -(-nbytes // block) * block",
        "else nbytes // block * block",
        ("tests/test_planner_core.py",),
    ),
    Mutant(
        "planning-softmax-copies-contiguous-inputs",
        "lightning_memopt/functional/planning/counter.py",
        "if isinstance(t, Tensor) and not t.is_contiguous())",
        "if isinstance(t, Tensor) and t.is_contiguous())",
        ("tests/test_planner_core.py",),
    ),
    Mutant(
        "planner-margin-of-one-or-more-accepted",
        "lightning_memopt/planner/plan.py",
        "not 0 <= margin < 1",
        "not 0 <= margin",
        ("tests/test_planner_core.py",),
    ),
    Mutant(
        "redaction-url-empty-user-password-with-slash-kept",
        "lightning_memopt/utilities/redaction.py",
        "if colon < 0 or authority_end == len(region)",
        "if colon <= 0 or authority_end == len(region)",
        ("tests/utilities/test_redaction.py",),
    ),
    Mutant(
        "redaction-16-char-token-userinfo-kept",
        "lightning_memopt/utilities/redaction.py",
        "len(user) >= 16",
        "len(user) > 16",
        ("tests/utilities/test_redaction.py",),
    ),
    Mutant(
        "redaction-name-at-the-end-crashes",
        "lightning_memopt/utilities/redaction.py",
        "    if i >= n:\n        return None\n",
        "    if i > n:\n        return None\n",
        ("tests/utilities/test_redaction.py",),
    ),
    Mutant(
        "planning-early-states-left-as-temporaries",
        "lightning_memopt/functional/planning/steps.py",
        "info[3] == counter.peak_step",
        "info[3] != counter.peak_step",
        ("tests/test_planner_core.py",),
    ),
)


def failed_in(output: str) -> set[str]:
    """The node ids (a file's path for a collection error) pytest's short summary lists as failed or in error."""
    return set(_SUMMARY.findall(output))


@dataclass(frozen=True)
class Baseline:
    """What fails on the unmutated code: those tests cannot tell whether a mutant is noticed."""

    failing: frozenset[str]  # node ids of the tests that fail (or error) unmutated
    broken: frozenset[str]  # test files (or modules) that cannot be collected unmutated

    def command(self, tests: tuple[str, ...] | list[str]) -> list[str] | None:
        """The mutant's pytest command: stop at the first failure, without what fails unmutated; ``None`` when
        nothing is left to run."""
        kept = [test for test in tests if test not in self.broken]
        if not kept:
            return None
        return [*_PYTEST, "-x", *kept, *(f"--deselect={node}" for node in sorted(self.failing))]


def baseline(tests: tuple[str, ...] | list[str], root: Path = ROOT, timeout: float | None = None) -> Baseline:
    """Run ``tests`` on the unmutated code (every test, past collection errors) and note what fails."""
    proc = subprocess.run(
        [*_PYTEST, "--continue-on-collection-errors", *tests],
        cwd=root,
        capture_output=True,
        text=True,
        env=_NO_BYTECODE,
        timeout=timeout,
    )
    found = failed_in(proc.stdout)
    broken = {node for node in found if "::" not in node}  # a collection error names the file
    return Baseline(failing=frozenset(found - broken), broken=frozenset(broken))


def judge(command: list[str] | None, root: Path = ROOT, timeout: float | None = None) -> str:
    """``"killed"``, ``"survived"`` or ``"unjudged"`` (no test left that passes unmutated) for the mutant in place."""
    if command is None:
        return "unjudged"
    proc = subprocess.run(command, cwd=root, capture_output=True, text=True, env=_NO_BYTECODE, timeout=timeout)
    if proc.returncode == NO_TESTS_COLLECTED:
        return "unjudged"
    return "survived" if proc.returncode == 0 else "killed"


def run(
    mutant: Mutant, root: Path = ROOT, baselines: dict[tuple[str, ...], Baseline] | None = None
) -> tuple[str, float]:
    """Apply ``mutant``, run its tests (less what fails unmutated), restore the file; returns (outcome, seconds).

    ``baselines`` caches the unmutated runs by test files across mutants."""
    path = root / mutant.path
    source = path.read_text()
    if source.count(mutant.original) != 1:
        raise SystemExit(f"{mutant.name}: the snippet to mutate is not found exactly once in {mutant.path}")
    baselines = {} if baselines is None else baselines
    start = time.perf_counter()
    if mutant.tests not in baselines:
        baselines[mutant.tests] = baseline(mutant.tests, root)
    command = baselines[mutant.tests].command(mutant.tests)
    try:
        path.write_text(source.replace(mutant.original, mutant.mutated))
        outcome = judge(command, root)
    finally:
        path.write_text(source)
    return outcome, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only the mutants whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if args.k in m.name]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.path}: {m.original.strip()!r} -> {m.mutated.strip()!r}")
        return 0
    survivors, unjudged = [], []
    baselines: dict[tuple[str, ...], Baseline] = {}
    for m in chosen:
        outcome, seconds = run(m, baselines=baselines)
        print(f"{outcome.upper() if outcome != 'killed' else outcome:8} {m.name} ({seconds:.1f} s)", flush=True)
        if outcome == "survived":
            survivors.append(m.name)
        elif outcome == "unjudged":
            unjudged.append(m.name)
    print(f"{len(survivors)} of {len(chosen)} mutants survived ({len(survivors) / max(1, len(chosen)):.0%})")
    if unjudged:
        print(f"{len(unjudged)} unjudged: every test of theirs fails on the unmutated code ({', '.join(unjudged)})")
    return 1 if survivors or unjudged else 0


if __name__ == "__main__":
    # The mutated file is put back on Ctrl-C and on a kill (the finally in run()).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"stopped by signal {signum}"))
    raise SystemExit(main())
