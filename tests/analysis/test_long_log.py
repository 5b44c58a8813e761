"""A 200,000-step log, written by the package's own writer in its own record format, is analysed in bounded memory."""

from __future__ import annotations

import tracemalloc

import pytest

from lightning_memopt.analysis import analyze_memory_logs
from lightning_memopt.functional.memory import MemoryReading
from lightning_memopt.functional.monitoring import Position, position_record
from lightning_memopt.utilities.jsonl import JsonlWriter

STEPS = 200_000
#: Python memory the analysis may hold at its peak: a small fraction of the ~100 MiB log, whatever its length.
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


@pytest.mark.slow
def test_a_200k_step_log_is_analysed_in_bounded_memory(tmp_path):
    path = tmp_path / "memory_rank0.jsonl"
    writer = JsonlWriter(path)
    write = writer.write
    write(position_record(_reading(0), 0, "train", "phase_start", Position(0, 0, None, "run")))
    for step in range(1, STEPS + 1):
        assert write(position_record(_reading(step), 0, "train", "step", Position(0, step, step - 1, "run")))
    write(position_record(_reading(STEPS), 0, "train", "phase_end", Position(0, STEPS, None, "run")))
    writer.close()
    size = path.stat().st_size
    assert size > 80 * 2**20

    tracemalloc.start()
    try:
        summaries, text = analyze_memory_logs([path])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < BOUND_BYTES, f"analysis peaked at {peak / 2**20:.1f} MiB of Python memory for a {size >> 20} MiB log"
    (train,) = summaries
    assert train.num_readings == STEPS  # every step
    assert train.growth == "growing" and train.growth_bytes_per_1k_steps == pytest.approx(64_000, rel=0.01)
    assert "train" in text
