"""An explicit ``AutoMicroBatch(micro_batch_size=...)`` wins over the size a checkpoint learned (release 0.2, faults).

A real checkpoint, saved by a CPU fit that learned a micro-batch of 4, is restored into a fit whose callback was given
``micro_batch_size=2``: it runs and logs 2 and warns once, naming both sizes. With ``"auto"`` the checkpoint's 4 is
still taken up.
"""

from __future__ import annotations

import warnings

import pytest

from lightning_memopt.callbacks.auto_micro_batch import AutoMicroBatch
from tests.helpers.amb import Net, fit
from tests.helpers.lightning import pl
from tests.helpers.trainer import make_trainer


@pytest.fixture
def learned_4(tmp_path):
    """A checkpoint of a fit whose batches of 16 ran out of memory above 4 samples: it learned 4."""
    first = AutoMicroBatch()
    trainer = fit(tmp_path / "first", Net(forward_budget=4, batch_size=16), [first], max_steps=1)
    assert first.micro_batch_size == 4
    path = tmp_path / "learned_4.ckpt"
    trainer.save_checkpoint(path)
    return path


def _resume(tmp_path, path, callback):
    model = Net(forward_budget=4, batch_size=16)
    logger = pl.loggers.CSVLogger(str(tmp_path / "logs"), name="", version="")
    trainer = make_trainer(
        tmp_path, callbacks=[callback], max_steps=2, limit_train_batches=None, limit_val_batches=0, logger=logger
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, ckpt_path=path)
    logged = (tmp_path / "logs" / "metrics.csv").read_text()
    return model, [str(w.message) for w in caught if "AutoMicroBatch" in str(w.message)], logged


def test_an_explicit_micro_batch_size_wins_over_the_checkpoint_s_and_says_so_once(tmp_path, learned_4):
    callback = AutoMicroBatch(micro_batch_size=2)
    model, said, logged = _resume(tmp_path / "explicit", learned_4, callback)
    assert model.seen_sizes == [2] * 8  # the one step left: a batch of 16 in micro-batches of 2
    assert callback.micro_batch_size == 2 and callback.retries == 2  # the checkpoint's halvings are still counted
    assert "memory/micro_batch_size" in logged and ",2.0" in logged and ",4.0" not in logged
    about = [m for m in said if "checkpoint" in m]
    assert len(about) == 1, said
    assert "micro-batch size 4 is not used" in about[0] and "`micro_batch_size=2`" in about[0]
    assert callback.state_dict()["micro_batch_size"] == 2  # the next checkpoint holds what ran


def test_without_an_explicit_size_the_checkpoint_s_learned_size_is_taken_silently(tmp_path, learned_4):
    callback = AutoMicroBatch()
    model, said, logged = _resume(tmp_path / "auto", learned_4, callback)
    assert model.seen_sizes == [4] * 4 and callback.micro_batch_size == 4
    assert ",4.0" in logged and not [m for m in said if "checkpoint" in m], said


def test_an_explicit_size_equal_to_the_checkpoint_s_warns_nothing(tmp_path, learned_4):
    callback = AutoMicroBatch(micro_batch_size=4)
    model, said, _ = _resume(tmp_path / "equal", learned_4, callback)
    assert model.seen_sizes == [4] * 4 and not [m for m in said if "checkpoint" in m], said
