"""WarnOnce: one warning per kind of failure, on the rank where it happened."""

from __future__ import annotations

import warnings

from lightning_utilities.core.rank_zero import WarningCache, rank_zero_only

from lightning_memopt.utilities.warnings import WarnOnce


def _caught(fn) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught]


def test_one_warning_per_key_even_when_the_text_changes(monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 0, raising=False)
    w = WarnOnce()
    assert _caught(lambda: [w.warn("read", f"reading failed at step {i}") for i in range(3)]) == [
        "reading failed at step 0"
    ]
    # A text-keyed cache would have warned three times here.
    cache = WarningCache()
    assert len(_caught(lambda: [cache.warn(f"reading failed at step {i}") for i in range(3)])) == 3


def test_warns_on_a_rank_other_than_zero(monkeypatch):
    monkeypatch.setattr(rank_zero_only, "rank", 1, raising=False)
    assert _caught(lambda: WarnOnce().warn("read", "rank 1 failed to read")) == ["rank 1 failed to read"]
    assert _caught(lambda: WarningCache().warn("rank 1 failed to read")) == []  # rank-zero only


def test_reset_allows_the_next_run_to_warn_again():
    w = WarnOnce(every_time=True)
    assert _caught(lambda: w.warn("leak", "a leak")) == ["a leak"]
    assert _caught(lambda: w.warn("leak", "a leak")) == []
    w.reset()
    assert _caught(lambda: w.warn("leak", "a leak")) == ["a leak"]
