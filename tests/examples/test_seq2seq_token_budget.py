"""The seq2seq token-budget example: a planned table, batches by it, a short fit, fewer steps and less padding than
fixed batches."""

from __future__ import annotations

import math

import pytest

from examples.seq2seq_token_budget import main, synthetic_lengths


@pytest.mark.slow  # a plan and a short fit: about 8 s
def test_the_example_plans_batches_by_memory_and_trains(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny = ["--d_model", "32", "--num_heads", "2", "--d_ff", "64", "--num_layers", "1"]  # the example's own flags
    summary = main(["--samples", "300", "--buckets", "4", "--max_steps", "2", "--budget", "32MB", *tiny])
    table = summary["table"]
    assert len(table) == 4 and all(size > 8 for size in table.values())
    # a longer source or target at the same other length holds fewer samples
    for (source, target), size in table.items():
        for (other_source, other_target), other in table.items():
            if other_source >= source and other_target >= target:
                assert other <= size
    steps, padding = summary["steps_per_epoch"], summary["padding"]
    assert steps["token budget"] <= 0.5 * steps["fixed"]
    assert padding["token budget"] < padding["fixed"]
    assert math.isfinite(summary["train_loss"]) and summary["train_loss"] < math.log(1000) + 1


def test_the_lengths_are_long_tailed_and_capped():
    lengths = synthetic_lengths(4000, 512, 96)
    sources = sorted(s for s, _ in lengths)
    assert 95 <= sources[len(sources) // 2] <= 120 and sources[-1] == 512
    assert max(t for _, t in lengths) == 96
