"""A long log, written by the package's own writer in its own record format, is analysed in bounded memory: the
analysis holds as much for a log four times longer (benchmarks/monitor_load.py measures a 200,000-step log)."""

from __future__ import annotations

import tracemalloc

import pytest

from lightning_memopt.analysis import analyze_memory_logs
from lightning_memopt.functional.readings.memory import MemoryReading
from lightning_memopt.functional.readings.monitoring import Position, position_record
from lightning_memopt.utilities.jsonl import JsonlWriter

#: Python memory the analysis may hold at its peak: a small fraction of the logs, whatever their length.
BOUND_BYTES = 2 * 2**20


def _reading(step: int) -> MemoryReading:
    alloc = 6 * 2**30 + 64 * step  # grows 64 bytes a step
    return MemoryReading(
        time=1_700_000_000.0 + 0.03 * step,
        device="cuda:0",
        allocated_bytes=alloc,
        reserved_bytes=alloc + 2**30,
        active_bytes=alloc,
        peak_allocated_bytes=alloc + 2**20,
        peak_reserved_bytes=alloc + 2**30,
        device_total_bytes=80 * 2**30,
        device_free_bytes=70 * 2**30 - alloc,
        host_rss_bytes=4 * 2**30,
        num_alloc_retries=0,
        num_ooms=0,
    )


def _write_log(path, steps: int) -> int:
    writer = JsonlWriter(path)
    write = writer.write
    write(position_record(_reading(0), 0, "train", "phase_start", Position(0, 0, None, "run")))
    for step in range(1, steps + 1):
        assert write(position_record(_reading(step), 0, "train", "step", Position(0, step, step - 1, "run")))
    write(position_record(_reading(steps), 0, "train", "phase_end", Position(0, steps, None, "run")))
    writer.close()
    return path.stat().st_size


def _analysed(path, steps: int) -> int:
    """The analysis' peak of Python memory; checks what it found."""
    tracemalloc.start()
    try:
        summaries, text = analyze_memory_logs([path])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    (train,) = summaries
    assert train.num_readings == steps  # every step
    assert train.growth == "growing" and train.growth_bytes_per_1k_steps == pytest.approx(64_000, rel=0.01)
    assert "train" in text
    return peak


@pytest.mark.slow
def test_a_long_log_is_analysed_in_memory_that_does_not_grow_with_it(tmp_path):
    peaks, sizes = [], []
    for steps in (10_000, 40_000):
        path = tmp_path / f"{steps}" / "memory_rank0.jsonl"
        path.parent.mkdir()
        sizes.append(_write_log(path, steps))
        peaks.append(_analysed(path, steps))
    assert sizes[1] > 16 * 2**20 and sizes[1] > 3.5 * sizes[0]
    assert peaks[1] < BOUND_BYTES, f"analysis peaked at {peaks[1] / 2**20:.1f} MiB for a {sizes[1] >> 20} MiB log"
    assert peaks[1] <= peaks[0] + 16 * 2**10  # four times the log, not more memory
