"""`lightning-memopt report` on a large report: streamed, cut with markers, in bounded time and memory."""

import time
import tracemalloc

import pytest

from lightning_memopt.cli import main
from tests.helpers.big_report import write_big_report

SIZE = 30 * 2**20


@pytest.mark.slow
def test_a_30_mb_report_prints_in_seconds_and_bounded_memory(tmp_path, capsys):
    path = write_big_report(tmp_path / "oom_report_rank0.json", SIZE)
    assert path.stat().st_size > 0.9 * SIZE
    main(["report", str(tmp_path / "missing.json")])  # imports done before measuring
    capsys.readouterr()
    tracemalloc.start()
    try:
        start = time.perf_counter()
        code = main(["report", str(path)])
        elapsed = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    out = capsys.readouterr().out
    assert code == 0
    assert peak < 32 * 2**20, f"peak {peak / 2**20:.0f} MiB of Python memory for a {SIZE / 2**20:.0f} MiB report"
    assert elapsed < 60, f"{elapsed:.1f} s"
    assert len(out) < 4 * 2**20
    assert "more characters not shown" in out  # the allocator summary, cut
    assert "more items not shown" in out  # the vocabulary and the live tensors, cut
    assert out.count("| layer.weight |") == 1000  # the first 1000 live tensors are listed
    assert "nested deeper than" in out
