"""WarnOnce: one warning per kind of failure, on the rank where it happened."""

from __future__ import annotations

import os
import warnings

import pytest
from lightning_utilities.core.rank_zero import WarningCache, rank_zero_only

from lightning_memopt.utilities.warnings import WarnOnce, warn_every_time


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


def _warn_from_a_hook(tmp_path, ignore_ours: bool = False) -> list[warnings.WarningMessage]:
    """A fit whose ``GradientCheckpointing`` finds nothing to wrap: a ``WarnOnce`` warning raised in ``setup``."""
    from lightning_memopt.callbacks import GradientCheckpointing
    from tests.helpers.models import TinyModel
    from tests.helpers.trainer import make_trainer

    trainer = make_trainer(tmp_path, callbacks=[GradientCheckpointing(checkpoint_modules=["NoSuchLayer"])], max_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if ignore_ours:  # what a user writes to silence the package
            warnings.filterwarnings("ignore", module="lightning_memopt")
        trainer.fit(TinyModel())
    return [w for w in caught if "found no submodule" in str(w.message)]


def test_a_hook_warning_points_at_the_package_module_that_raised_it(tmp_path):
    (caught,) = _warn_from_a_hook(tmp_path)
    assert caught.filename.endswith(os.path.join("lightning_memopt", "callbacks", "gradient_checkpointing.py"))


def test_filtering_by_the_package_module_silences_a_hook_warning(tmp_path):
    assert _warn_from_a_hook(tmp_path, ignore_ours=True) == []


def _raise_here(how: str) -> None:
    if how == "once":
        WarnOnce().warn("key", "from the caller's line")
    else:
        warn_every_time("from the caller's line")


@pytest.mark.parametrize("how", ["once", "every_time"])
def test_both_helpers_name_the_calling_module_and_line(how):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _raise_here(how)
    (w,) = caught
    assert (w.filename, w.lineno) == (__file__, _raise_here.__code__.co_firstlineno + (2 if how == "once" else 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", module="tests.utilities.test_warnings")
        _raise_here(how)
    assert caught == []  # the calling module is what `module=` matches
