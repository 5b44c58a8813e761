import logging
import time
from unittest import mock

import pytest

from lightning_memopt.callbacks import CacheCleaner
from lightning_memopt.callbacks import cache_cleaner as cc
from tests.helpers.models import TinyModel
from tests.helpers.monitor_loggers import RecordingLogger
from tests.helpers.trainer import make_trainer


@pytest.fixture
def fake_device(monkeypatch):
    """Pretend the trainer's device has a cache; count empty_cache calls."""
    empty = mock.Mock(return_value=True)
    monkeypatch.setattr(cc, "supports_device_memory", lambda device: True)
    monkeypatch.setattr(cc, "empty_device_cache", empty)
    return empty


def test_every_n_train_batches_and_phase_ends(tmp_path, fake_device):
    cleaner = CacheCleaner(every_n_train_batches=3)
    trainer = make_trainer(
        tmp_path, callbacks=[cleaner], max_epochs=2, max_steps=-1, limit_train_batches=7, limit_val_batches=2
    )
    trainer.fit(TinyModel())
    # per epoch: batches 3 and 6 (2 calls) + validation end + train epoch end = 4; two epochs = 8
    assert fake_device.call_count == 8
    assert cleaner.calls == 8 and cleaner.seconds >= 0.0


def test_validation_interval_and_no_phase_end(tmp_path, fake_device):
    cleaner = CacheCleaner(every_n_train_batches=None, every_n_val_batches=2, on_phase_end=False)
    trainer = make_trainer(tmp_path, callbacks=[cleaner], max_steps=4, limit_train_batches=4, limit_val_batches=5)
    trainer.fit(TinyModel())
    assert fake_device.call_count == 2  # validation batches 2 and 4
    trainer.test(TinyModel(), verbose=False)
    assert fake_device.call_count == 2


def test_test_and_predict_phase_ends(tmp_path, fake_device):
    cleaner = CacheCleaner()
    trainer = make_trainer(tmp_path, callbacks=[cleaner])
    trainer.test(TinyModel(), verbose=False)
    trainer.predict(TinyModel())
    assert fake_device.call_count == 2


def test_called_with_the_trainers_device(tmp_path, fake_device):
    make_trainer(tmp_path, callbacks=[CacheCleaner(every_n_train_batches=1)], max_steps=1, limit_val_batches=0).fit(
        TinyModel()
    )
    assert {str(c.args[0]) for c in fake_device.call_args_list} == {"cpu"}


def test_cpu_logs_one_info_then_does_nothing(tmp_path, caplog):
    cleaner = CacheCleaner(every_n_train_batches=1)
    with mock.patch.object(cc, "empty_device_cache") as empty, caplog.at_level(logging.INFO):
        trainer = make_trainer(tmp_path, callbacks=[cleaner], max_steps=4)
        trainer.fit(TinyModel())
        trainer.validate(TinyModel(), verbose=False)
    empty.assert_not_called()
    assert cleaner.calls == 0
    assert sum("no allocator cache to empty" in m for m in caplog.messages) == 1


def test_time_is_logged_at_fit_end(tmp_path, fake_device):
    logger = RecordingLogger()
    cleaner = CacheCleaner(every_n_train_batches=2)
    start = time.perf_counter()
    make_trainer(tmp_path, callbacks=[cleaner], logger=logger, max_steps=4, limit_val_batches=0).fit(TinyModel())
    elapsed = time.perf_counter() - start
    logged = [m for _, m in logger.calls if "memory/cache_cleaner/empty_cache_calls" in m]
    assert len(logged) == 1 and logged[0]["memory/cache_cleaner/empty_cache_calls"] == 3.0
    seconds = logged[0]["memory/cache_cleaner/empty_cache_seconds"]
    assert seconds == cleaner.seconds and 0 <= seconds <= elapsed  # the calls' own time, within the fit's


def test_failure_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(cc, "supports_device_memory", lambda device: True)
    monkeypatch.setattr(cc, "empty_device_cache", mock.Mock(side_effect=RuntimeError("boom")))
    trainer = make_trainer(
        tmp_path, callbacks=[CacheCleaner(every_n_train_batches=1)], max_steps=3, limit_val_batches=0
    )
    with pytest.warns(UserWarning, match="emptying the cache failed") as record:
        trainer.fit(TinyModel())
    assert trainer.global_step == 3
    assert sum("emptying the cache failed" in str(w.message) for w in record) == 1


def test_state_dict_round_trip():
    cleaner = CacheCleaner()
    cleaner.calls, cleaner.seconds = 5, 0.25
    other = CacheCleaner()
    other.load_state_dict(cleaner.state_dict())
    assert (other.calls, other.seconds) == (5, 0.25)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_n_train_batches": 0}, "`every_n_train_batches` must be a positive int, got 0"),
        ({"every_n_val_batches": -1}, "`every_n_val_batches` must be a positive int, got -1"),
        ({"every_n_train_batches": 2.5}, "got 2.5"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CacheCleaner(**kwargs)


@pytest.mark.cuda
def test_real_cuda_cache_is_emptied(tmp_path):
    import torch

    class Model(TinyModel):
        def training_step(self, batch, batch_idx):
            torch.empty(64 * 2**20, dtype=torch.uint8, device=self.device)  # freed at once, stays cached
            return super().training_step(batch, batch_idx)

    cleaner = CacheCleaner(every_n_train_batches=1, on_phase_end=False)
    make_trainer(tmp_path, accelerator="gpu", callbacks=[cleaner], max_steps=2, limit_val_batches=0).fit(Model())
    assert cleaner.calls == 2
    # what stays reserved is what is still allocated (cuBLAS's workspace: 64 MiB on a Hopper card), not the freed block
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() < 64 * 2**20
