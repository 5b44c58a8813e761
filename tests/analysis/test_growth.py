"""The growth verdict: warm-up left out, too short, flat, growing and shrinking, and the fit itself."""

import random
import statistics

import pytest

from lightning_memopt.analysis import analyze_memory_logs, format_summary, summarize_memory_log
from lightning_memopt.analysis.growth import Growth, StepFit
from tests.helpers.analysis_logs import MiB, rec, write


def test_growth_leaves_out_the_warm_up():
    # a climb over the first quarter (data, optimizer state, cache arriving), then flat: no growth
    warm = [rec(float(s), "train", "step", s, 100 + 100 * s) for s in range(1, 101)]
    flat = [rec(float(s), "train", "step", s, 10_100) for s in range(101, 401)]
    s = summarize_memory_log(warm + flat)[0]
    assert s.growth == "flat" and s.growth_bytes_per_1k_steps is None
    # past the first third (134), at the next boundary of the step buckets the fit keeps (8 steps wide here)
    assert (s.growth_first_step, s.growth_last_step) == (136, 400)
    leak = [rec(float(s), "train", "step", s, 10_100 + 7 * (s - 100)) for s in range(101, 401)]
    s = summarize_memory_log(warm + leak)[0]
    assert s.growth == "growing" and s.growth_bytes_per_1k_steps == pytest.approx(7000.0)


def _train_steps(values, steps, key="allocated_bytes", **extra):
    return [
        dict(rec(float(i), "train", "step", step), **{key: value}, **extra)
        for i, (step, value) in enumerate(zip(steps, values))
    ]


def _growth_cell(text, phase="train"):
    """A phase's growth in `format_summary`'s lines under the table (``  rank 0, train: growth ...; peak at ...``)."""
    line = next(line for line in text.splitlines() if line.startswith(f"  rank 0, {phase}: growth "))
    return line.split(": growth ", 1)[1].rsplit("; peak at ", 1)[0]


def test_a_flat_three_step_run_is_too_short_to_tell(tmp_path):
    # three readings a few MiB apart: a line through them projects GiBs per 1,000 steps
    path = write(tmp_path / "m.jsonl", _train_steps([2048 * MiB, 2051 * MiB, 2049 * MiB], [1, 2, 3]))
    (s,), text = analyze_memory_logs([path])
    assert s.growth == "too short" and s.growth_bytes_per_1k_steps is None
    assert (s.growth_readings, s.growth_first_step, s.growth_last_step) == (3, 1, 3)
    assert _growth_cell(text) == "too short to tell (3 readings over steps 1-3)"
    assert "GiB" not in _growth_cell(text)


def test_a_noisy_flat_run_is_not_called_growth(tmp_path):
    rng = random.Random(0)
    steps = range(1000)
    values = [2048 * MiB + rng.uniform(-50, 50) * MiB for _ in steps]  # random +-50 MiB jitter, no trend
    path = write(tmp_path / "m.jsonl", _train_steps(values, steps))
    (s,), text = analyze_memory_logs([path])
    assert s.growth == "flat" and s.growth_bytes_per_1k_steps is None
    assert (s.growth_first_step, s.growth_last_step) == (336, 999)
    assert _growth_cell(text) == "flat over steps 336-999"


# Host RSS of the main job (`bash scripts/main.sh`, CPU, a reading every 5 steps), MiB: a climb while data and the
# first batches arrive, then plateaus a few MiB apart. Read as a line it rose by 39 MiB per 1,000 steps.
MAIN_JOB_RSS_MIB = [
    450.18,
    477.79,
    482.22,
    490.13,
    488.12,
    495.78,
    492.29,
    503.59,
    512.88,
    513.06,
    513.1,
    505.51,
    515.5,
    515.51,
    500.84,
    507.35,
    513.3,
    500.87,
    522.25,
    522.5,
    522.17,
    515.92,
    521.8,
    528.18,
    528.2,
    515.82,
    528.21,
    506.58,
    506.62,
    521.14,
    517.46,
    511.45,
    517.84,
    517.84,
    519.73,
    525.23,
    519.73,
    520.23,
    526.01,
    511.88,
    520.55,
    520.55,
    519.42,
    523.76,
    511.93,
    511.93,
    521.32,
    521.32,
    511.95,
    519.95,
    520.95,
    521.21,
    511.96,
    521.34,
    520.71,
    532.35,
    511.99,
    531.88,
    518.75,
    531.63,
]


def test_host_rss_that_moves_between_plateaus_is_flat(tmp_path):
    steps = range(5, 305, 5)
    records = _train_steps(
        [round(v * MiB) for v in MAIN_JOB_RSS_MIB], steps, key="host_rss_bytes", device="cpu", allocated_bytes=None
    )
    (s,), text = analyze_memory_logs([write(tmp_path / "m.jsonl", records)])
    assert s.growth_field == "host_rss_bytes"
    assert s.growth == "flat" and s.growth_bytes_per_1k_steps is None
    assert _growth_cell(text) == "flat over steps 105-300 (RSS)"
    # Memory that sits on one level for a few readings, then another (+-10 MiB around 500 MiB). The readings
    # scatter little about a line (0.5 MiB on a level), so judged by that scatter alone the fall from the last
    # plateaus would count as shrinking; the means of blocks of readings stray far more than that scatter allows.
    rng = random.Random(10)
    level, values = 0.0, []
    for _ in steps:
        if rng.random() < 0.2:
            level = rng.uniform(-10, 10)
        values.append(round((500 + level + rng.uniform(-0.5, 0.5)) * MiB))
    records = _train_steps(values, steps, key="host_rss_bytes", device="cpu", allocated_bytes=None)
    (s,) = summarize_memory_log(records)
    assert s.growth == "flat"


def test_a_steady_leak_is_reported_with_its_rate_and_span(tmp_path):
    steps = range(0, 401, 10)  # 1 MiB per step, read every 10 steps
    path = write(tmp_path / "m.jsonl", _train_steps([1024 * MiB + s * MiB for s in steps], steps))
    (s,), text = analyze_memory_logs([path])
    assert s.growth == "growing" and s.growth_bytes_per_1k_steps == pytest.approx(1000 * MiB)
    assert (s.growth_readings, s.growth_first_step, s.growth_last_step) == (27, 140, 400)
    assert _growth_cell(text) == "+260.00 MiB over steps 140-400"

    rng = random.Random(1)  # the same leak read at every step, under +-50 MiB of jitter
    steps = range(401)
    values = [1024 * MiB + s * MiB + rng.uniform(-50, 50) * MiB for s in steps]
    (s,) = summarize_memory_log(_train_steps(values, steps))
    assert s.growth == "growing" and s.growth_bytes_per_1k_steps == pytest.approx(1000 * MiB, rel=0.05)

    # a reading every 10 steps over 150 steps is enough; a steady fall is reported as one
    steps = range(0, 151, 10)
    (s,) = summarize_memory_log(_train_steps([4096 * MiB - 20 * s * 1024 for s in steps], steps))
    assert s.growth == "shrinking" and s.growth_bytes_per_1k_steps == pytest.approx(-20_000 * 1024)
    assert (s.growth_readings, s.growth_first_step, s.growth_last_step) == (11, 50, 150)


def test_growth_fit_matches_a_reference_whatever_the_order():
    # a full least-squares fit over the readings in the steps the summary names, as the reference
    rng = random.Random(7)
    steps = list(range(3, 20_000, 3))
    values = [5 * 1024**3 + 40 * s + rng.gauss(0, 64 * 1024) for s in steps]
    records = _train_steps(values, steps)
    (s,) = summarize_memory_log(records)
    rng.shuffle(records)
    (shuffled,) = summarize_memory_log(records)
    assert s.growth == shuffled.growth == "growing"
    # the first third is left out, cut at a boundary of the (at most 64) step buckets
    assert 20_000 / 3 <= s.growth_first_step < 20_000 / 3 + 20_000 / 32 and s.growth_last_step == steps[-1]
    window = [(x, y) for x, y in zip(steps, values) if s.growth_first_step <= x <= s.growth_last_step]
    slope = statistics.linear_regression([x for x, _ in window], [y for _, y in window]).slope  # the reference
    assert s.growth_readings == shuffled.growth_readings == len(window)
    assert s.growth_bytes_per_1k_steps == pytest.approx(1000 * slope, rel=1e-9)
    assert shuffled.growth_bytes_per_1k_steps == pytest.approx(1000 * slope, rel=1e-9)
    assert s.growth_bytes_per_1k_steps == pytest.approx(40_000, rel=0.01)


def test_too_few_readings_in_the_fitted_steps_are_too_short(tmp_path):
    # 300 steps but a reading every 40: 5 readings after the warm-up
    steps = range(0, 301, 40)
    (s,) = summarize_memory_log(_train_steps([1024 * MiB + s * MiB for s in steps], steps))
    assert s.growth == "too short" and (s.growth_readings, s.growth_first_step, s.growth_last_step) == (8, 0, 280)
    # one validation pass after another at the same step: readings over no steps at all
    (s,) = summarize_memory_log([dict(r, phase="validate") for r in _train_steps([MiB] * 30, [500] * 30)])
    assert s.growth == "too short"
    assert _growth_cell(format_summary([s]), "validate") == "too short to tell (30 readings, all at step 500)"


# ---------------------------------------------------------------------------------------------------- the fit


def test_step_fit_keeps_at_most_64_buckets_and_fits_them_exactly():
    fit = StepFit()
    assert fit.growth() == Growth("too short", None, 0, None, None)
    for step in range(10_000):
        fit.add(step, 1000 + 5 * step)
    assert len(fit) <= 64 and fit.width == 256
    growth = fit.growth()
    assert growth.verdict == "growing" and growth.per_1k_steps == pytest.approx(5000.0, rel=1e-12)
    # the warm-up cut falls on the first bucket boundary at or past a third of the steps
    assert (growth.first_step, growth.last_step) == (3584, 9999) and growth.readings == 9999 - 3584 + 1


def test_step_fit_needs_four_blocks_of_readings():
    # 12 readings over 300 steps after the warm-up, but all at two steps: too short, however steep
    fit = StepFit()
    for step in [0] * 5 + [150] * 6 + [450] * 6:
        fit.add(step, 10 * step)
    assert fit.growth().verdict == "too short"


def test_ten_readings_after_the_warm_up_are_enough_nine_are_not():
    def fit_of(readings):
        fit = StepFit()
        fit.add(0, 1000)  # the warm-up third is cut away
        for i in range(readings):  # 20 steps apart: 9 readings span 160 steps, 10 span 180
            fit.add(1000 + 20 * i, 5000 + 100 * i + (7 if i % 2 else 0))
        return fit.growth()

    assert fit_of(9).verdict == "too short"
    ten = fit_of(10)
    assert ten.verdict == "growing" and (ten.readings, ten.first_step, ten.last_step) == (10, 1000, 1180)
