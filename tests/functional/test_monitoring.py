"""The MemoryMonitor core, driven by a fake allocator passed in: per-phase peaks, threshold crossings, records."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_memopt.functional.readings.memory import MemoryReading
from lightning_memopt.functional.readings.monitoring import (
    MonitorRecords,
    PhasePeaks,
    Position,
    ThresholdWatch,
    cross_rank_metrics,
    cross_rank_values,
    step_metrics,
)
from tests.helpers.fake_device import FakeAllocator


class _NoReading(FakeAllocator):
    def read(self):
        return None


def test_nested_phases_have_their_own_peaks_and_the_outer_one_keeps_its_own():
    fake = FakeAllocator()
    peaks = PhasePeaks(fake)
    peaks.start("train")
    fake.set(1300)
    fake.set(1000)
    peaks.start("validate")  # folds train's 1300 before the reset
    fake.set(5000)
    fake.set(500)
    reading, validate = peaks.end("validate")
    assert validate == {"peak_allocated_bytes": 5000, "peak_reserved_bytes": 5000}
    assert reading.allocated_bytes == 500 and peaks.active == ["train"]
    fake.set(1200)
    _, train = peaks.end("train")
    assert train["peak_allocated_bytes"] == 1300  # not the 5000 seen while validating
    assert fake.resets == 4 and peaks.active == []


def test_a_phase_without_readings_has_no_peaks():
    peaks = PhasePeaks(_NoReading())
    assert peaks.start("test") is None
    assert peaks.end("test") == (None, {})


def test_threshold_warns_once_per_crossing_per_field():
    watch = ThresholdWatch(0.9)
    fake = FakeAllocator(total=1000)
    seen = []
    for level in (100, 950, 960, 100, 920):
        fake.set(level, reserved=level)
        seen.append([(field, round(fraction, 2)) for field, fraction in watch.crossings(fake.read())])
    assert seen == [
        [],
        [("allocated_bytes", 0.95), ("reserved_bytes", 0.95)],
        [],
        [],
        [("allocated_bytes", 0.92), ("reserved_bytes", 0.92)],
    ]
    message = watch.message(fake.read(), "allocated_bytes", 0.92, "[rank 1] train step 5")
    assert message == (
        "[rank 1] train step 5: allocated memory is 920 B = 92% of cuda:0's 1000 B, above `warn_threshold`=0.9."
    )


def test_a_step_gives_its_record_a_warning_record_per_crossing_and_metrics():
    fake = FakeAllocator(total=1000)
    core = MonitorRecords(fake, rank=1, warn_threshold=0.5)
    fake.set(600, reserved=400)
    records, metrics, warnings = core.step("train", Position(2, 7, 13, "run"))
    assert [(r["event"], r.get("field")) for r in records] == [("step", None), ("warning", "allocated_bytes")]
    step, warning = records
    assert (step["rank"], step["epoch"], step["global_step"], step["batch_idx"], step["run_id"]) == (1, 2, 7, 13, "run")
    assert list(warning)[-5:] == ["field", "fraction", "threshold", "message", "run_id"]
    assert warning["fraction"] == 0.6 and warning["threshold"] == 0.5 and warnings == [warning["message"]]
    assert metrics["memory/train/allocated_bytes"] == 600.0 and "memory/train/peak_allocated_bytes" not in metrics
    json.dumps(records)


def test_phase_end_record_carries_the_phase_peaks_and_no_reading_writes_nothing():
    fake = FakeAllocator()
    core = MonitorRecords(fake, rank=0, warn_threshold=0.9)
    assert [r["event"] for r in core.phase_start("predict", Position(0, 0, None, None))] == ["phase_start"]
    fake.set(700)
    records, metrics, reading, peaks = core.phase_end("predict", Position(0, 0, None, None))
    assert records[0]["phase_peak_allocated_bytes"] == 700 and metrics["memory/predict/peak_reserved_bytes"] == 700.0
    assert reading is not None and peaks["peak_allocated_bytes"] == 700
    silent = MonitorRecords(_NoReading(), rank=0, warn_threshold=0.9)
    assert silent.step("train", Position(0, 1, 0, None)) == ([], {}, [])


def test_cross_rank_metrics_skip_fields_a_rank_does_not_know():
    cpu = MemoryReading(time=0.0, device="cpu", host_rss_bytes=100)
    gpu = MemoryReading(time=0.0, device="cuda:0", allocated_bytes=10, reserved_bytes=20, host_rss_bytes=300)
    gathered = torch.stack([cross_rank_values(cpu), cross_rank_values(gpu)])
    assert cross_rank_metrics(gathered) == {
        "memory/train/host_rss_bytes_min": 100.0,
        "memory/train/host_rss_bytes_max": 300.0,
        "memory/train/host_rss_bytes_mean": 200.0,
    }
    assert step_metrics("validate", cpu) == {"memory/validate/host_rss_bytes": 100.0}


@pytest.mark.parametrize("rows", [1, 3])
def test_cross_rank_metrics_of_equal_ranks(rows):
    gathered = cross_rank_values(
        MemoryReading(time=0.0, device="cuda:0", allocated_bytes=1, reserved_bytes=2, host_rss_bytes=3)
    ).repeat(rows)
    assert cross_rank_metrics(gathered)["memory/train/reserved_bytes_mean"] == 2.0
