"""The one home of Lightning's private names: every name is found on the installed release, and a release that lacks
one stops AutoMicroBatch in ``setup`` with an error naming the release, the name and the supported range."""

from __future__ import annotations

import pytest

from lightning_memopt.callbacks.auto_micro_batch import AutoMicroBatch
from lightning_memopt.utilities import _lightning_private as private
from tests.helpers.amb import Net
from tests.helpers.lightning import NAMESPACE
from tests.helpers.trainer import make_trainer


def test_every_private_name_is_found_on_the_installed_lightning():
    private.check_private_api.cache_clear()
    private.check_private_api(NAMESPACE)


def test_a_release_without_one_of_the_names_stops_the_fit_in_setup_before_any_step(tmp_path, monkeypatch):
    monkeypatch.setattr(private, "PRIVATE_NAMES", (*private.PRIVATE_NAMES, "trainer.call:_gone_in_a_later_release"))
    private.check_private_api.cache_clear()
    model = Net()
    trainer = make_trainer(tmp_path, callbacks=[AutoMicroBatch()])
    try:
        with pytest.raises(RuntimeError, match=r"does not have: .*_gone_in_a_later_release.*Lightning 2\.1 to 2\.6"):
            trainer.fit(model)
    finally:
        private.check_private_api.cache_clear()
    assert model.seen_sizes == [] and trainer.global_step == 0
