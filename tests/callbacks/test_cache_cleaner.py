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


def test_every_n_train_steps_and_phase_ends(tmp_path, fake_device):
    cleaner = CacheCleaner(every_n_train_steps=3)
    trainer = make_trainer(
        tmp_path, callbacks=[cleaner], max_epochs=2, max_steps=-1, limit_train_batches=7, limit_val_batches=2
    )
    trainer.fit(TinyModel())
    # per epoch: batches 3 and 6 (2 calls) + validation end + train epoch end = 4; two epochs = 8
    assert fake_device.call_count == 8
    assert cleaner.calls == 8 and cleaner.seconds >= 0.0


def test_validation_interval_and_no_phase_end(tmp_path, fake_device):
    cleaner = CacheCleaner(every_n_train_steps=None, every_n_val_batches=2, on_phase_end=False)
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
    make_trainer(tmp_path, callbacks=[CacheCleaner(every_n_train_steps=1)], max_steps=1, limit_val_batches=0).fit(
        TinyModel()
    )
    assert {str(c.args[0]) for c in fake_device.call_args_list} == {"cpu"}


def test_cpu_is_named_in_the_one_inactive_line_then_does_nothing(tmp_path, caplog):
    cleaner = CacheCleaner(every_n_train_steps=1, verbose=True)
    with mock.patch.object(cc, "empty_device_cache") as empty, caplog.at_level(logging.INFO):
        trainer = make_trainer(tmp_path, callbacks=[cleaner], max_steps=4)
        trainer.fit(TinyModel())
        trainer.validate(TinyModel(), verbose=False)
    empty.assert_not_called()
    assert cleaner.calls == 0
    ours = [m for m in caplog.messages if "CacheCleaner" in m]
    assert ours == ["lightning-memopt: inactive here: CacheCleaner (no cache on cpu)."]


def _batches_emptied_after(tmp_path, cleaner, **kwargs):
    """The ``batch_idx`` of each training batch after which ``cleaner`` emptied the cache."""
    seen = []

    class Model(TinyModel):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            seen.append((batch_idx, cleaner.calls))

    defaults = {"max_steps": -1, "limit_train_batches": 16, "limit_val_batches": 0}
    start = cleaner.calls
    make_trainer(tmp_path, callbacks=[cleaner], **{**defaults, **kwargs}).fit(Model())
    # the module's hook runs after the callbacks': a call counted at batch i happened after batch i
    return [i for (i, calls), (_, before) in zip(seen, [(None, start), *seen]) if calls > before]


def test_every_n_train_steps_counts_optimizer_steps_with_gradient_accumulation(tmp_path, fake_device):
    cleaner = CacheCleaner(every_n_train_steps=2, on_phase_end=False)
    emptied = _batches_emptied_after(tmp_path, cleaner, max_epochs=1, accumulate_grad_batches=4)
    assert emptied == [7, 15]  # optimizer steps 2 and 4: after every 2nd step, i.e. every 8th batch
    assert cleaner.calls == 2


def test_every_n_train_steps_continues_across_epochs_and_starts_again_with_a_new_trainer(tmp_path, fake_device):
    cleaner = CacheCleaner(every_n_train_steps=3, on_phase_end=False)
    assert _batches_emptied_after(tmp_path, cleaner, max_epochs=1, limit_train_batches=5) == [2]  # step 3
    # a new Trainer: step 3 is due again; global_step goes on over the epoch boundary (steps 3, 6 | 9, 12)
    assert _batches_emptied_after(tmp_path, cleaner, max_epochs=2, limit_train_batches=7) == [2, 5, 1, 4]


def test_totals_are_printed_only_when_verbose(tmp_path, fake_device, caplog):
    with caplog.at_level(logging.INFO):
        for verbose in (False, True):
            cleaner = CacheCleaner(every_n_train_steps=2, verbose=verbose)
            make_trainer(tmp_path, callbacks=[cleaner], max_steps=4, limit_val_batches=0).fit(TinyModel())
    said = [m for m in caplog.messages if m.startswith("CacheCleaner:")]
    assert len(said) == 1 and said[0].startswith("CacheCleaner: 3 empty_cache() calls took")


def test_the_totals_are_the_callbacks_own_attributes():
    cleaner = CacheCleaner()
    assert {"calls": 0, "seconds": 0.0}.items() <= vars(cleaner).items()  # no forwarding property in between


def test_time_is_logged_at_fit_end(tmp_path, fake_device):
    logger = RecordingLogger()
    cleaner = CacheCleaner(every_n_train_steps=2)
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
    trainer = make_trainer(tmp_path, callbacks=[CacheCleaner(every_n_train_steps=1)], max_steps=3, limit_val_batches=0)
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
        ({"every_n_train_steps": 0}, "`every_n_train_steps` must be a positive int, got 0"),
        ({"every_n_val_batches": -1}, "`every_n_val_batches` must be a positive int, got -1"),
        ({"every_n_train_steps": 2.5}, "got 2.5"),
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

    cleaner = CacheCleaner(every_n_train_steps=1, on_phase_end=False)
    make_trainer(tmp_path, accelerator="gpu", callbacks=[cleaner], max_steps=2, limit_val_batches=0).fit(Model())
    assert cleaner.calls == 2
    # what stays reserved is what is still allocated (cuBLAS's workspace: 64 MiB on a Hopper card), not the freed block
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() < 64 * 2**20
