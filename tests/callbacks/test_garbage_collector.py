import gc
from unittest import mock

import pytest

from lightning_memopt.callbacks import GarbageCollector
from lightning_memopt.callbacks import garbage_collector as gcmod
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer


def collect_calls(mocked):
    return [c.args for c in mocked.call_args_list]


def test_collects_every_n_optimizer_steps(tmp_path):
    collector = GarbageCollector(every_n_steps=3, generation=1)
    with mock.patch.object(gcmod.gc, "collect", return_value=7) as collect:
        trainer = make_trainer(
            tmp_path, callbacks=[collector], max_steps=10, limit_train_batches=10, limit_val_batches=0
        )
        trainer.fit(TinyModel())
    assert collect_calls(collect) == [(1,), (1,), (1,)]  # steps 3, 6, 9
    assert collector.calls == 3 and collector.collected == 21 and collector.seconds >= 0


def test_interval_counts_optimizer_steps_not_micro_batches(tmp_path):
    collector = GarbageCollector(every_n_steps=2)
    steps_seen = []
    with mock.patch.object(gcmod.gc, "collect", side_effect=lambda g: steps_seen.append(trainer.global_step) or 0):
        trainer = make_trainer(
            tmp_path,
            callbacks=[collector],
            max_steps=4,
            limit_train_batches=8,
            accumulate_grad_batches=2,
            limit_val_batches=0,
        )
        trainer.fit(TinyModel())
    assert steps_seen == [2, 4]


def test_disable_automatic_during_fit_and_restore(tmp_path):
    assert gc.isenabled()
    seen = []

    class Model(TinyModel):
        def training_step(self, batch, batch_idx):
            seen.append(gc.isenabled())
            return super().training_step(batch, batch_idx)

    make_trainer(tmp_path, callbacks=[GarbageCollector(disable_automatic=True)], max_steps=2, limit_val_batches=0).fit(
        Model()
    )
    assert seen == [False, False]
    assert gc.isenabled()


def test_gc_state_restored_after_a_crash(tmp_path):
    class Crash(TinyModel):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                raise RuntimeError("crash in step")
            return super().training_step(batch, batch_idx)

    frozen_before = gc.get_freeze_count()
    trainer = make_trainer(
        tmp_path, callbacks=[GarbageCollector(disable_automatic=True, freeze_after_setup=True)], max_steps=4
    )
    with pytest.raises(RuntimeError, match="crash in step"):
        trainer.fit(Crash())
    assert gc.isenabled()
    assert gc.get_freeze_count() == frozen_before


def test_a_disabled_collector_stays_disabled(tmp_path):
    gc.disable()
    try:
        make_trainer(
            tmp_path, callbacks=[GarbageCollector(disable_automatic=True)], max_steps=2, limit_val_batches=0
        ).fit(TinyModel())
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_freeze_after_setup_and_unfreeze_at_teardown(tmp_path):
    counts = []

    class Model(TinyModel):
        def training_step(self, batch, batch_idx):
            counts.append(gc.get_freeze_count())
            return super().training_step(batch, batch_idx)

    make_trainer(tmp_path, callbacks=[GarbageCollector(freeze_after_setup=True)], max_steps=1, limit_val_batches=0).fit(
        Model()
    )
    assert counts[0] > 1000  # the model, torch and Lightning objects are frozen
    assert gc.get_freeze_count() == 0


def test_time_and_counts_logged_at_fit_end(tmp_path):
    from tests.callbacks.test_memory_monitor import RecordingLogger

    logger = RecordingLogger()
    make_trainer(
        tmp_path, callbacks=[GarbageCollector(every_n_steps=2)], logger=logger, max_steps=4, limit_val_batches=0
    ).fit(TinyModel())
    logged = [m for _, m in logger.calls if "memory/gc/collect_calls" in m]
    assert len(logged) == 1 and logged[0]["memory/gc/collect_calls"] == 2.0
    assert logged[0]["memory/gc/collect_seconds"] > 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_n_steps": 0}, "`every_n_steps` must be a positive int, got 0"),
        ({"every_n_steps": None}, "`every_n_steps` must be a positive int, got None"),
        ({"generation": 3}, "`generation` must be one of 0, 1, 2, got 3"),
        ({"every_n_steps": True}, "`every_n_steps` must be a positive int, got True"),
        ({"generation": True}, r"`generation` must be a non-negative int, got True\. Use 0, 1 or 2"),
        ({"generation": False}, r"`generation` must be a non-negative int, got False\. Use 0, 1 or 2"),
        ({"generation": 1.0}, r"`generation` must be a non-negative int, got 1.0\. Use 0, 1 or 2"),
        ({"generation": -1}, r"`generation` must be a non-negative int, got -1\. Use 0, 1 or 2"),
        ({"disable_automatic": "yes"}, r"`disable_automatic` must be a bool \(True or False\), got 'yes'\."),
        ({"disable_automatic": 1}, r"`disable_automatic` must be a bool \(True or False\), got 1\."),
        ({"freeze_after_setup": "no"}, r"`freeze_after_setup` must be a bool \(True or False\), got 'no'\."),
        ({"freeze_after_setup": None}, r"`freeze_after_setup` must be a bool \(True or False\), got None\."),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GarbageCollector(**kwargs)


@pytest.mark.parametrize("end", ["normal", "crash"])
def test_objects_frozen_by_the_app_stay_frozen_and_nothing_more_is_frozen(tmp_path, end):
    counts = []

    class Model(TinyModel):
        def training_step(self, batch, batch_idx):
            counts.append(gc.get_freeze_count())
            if end == "crash" and batch_idx == 1:
                raise RuntimeError("crash in step")
            return super().training_step(batch, batch_idx)

    gc.collect()
    gc.freeze()  # what an application that forks workers may do before fit
    try:
        model = Model()
        before = gc.get_freeze_count()
        collector = GarbageCollector(freeze_after_setup=True)
        trainer = make_trainer(tmp_path, callbacks=[collector], max_steps=2, limit_val_batches=0)
        with pytest.warns(UserWarning, match=r"did not freeze: the application has already frozen \d+ objects"):
            if end == "crash":
                with pytest.raises(RuntimeError, match="crash in step"):
                    trainer.fit(model)
            else:
                trainer.fit(model)
        after = gc.get_freeze_count()
    finally:
        gc.unfreeze()
    assert before > 1000
    assert all(count <= before for count in counts)  # nothing was frozen on top of the app's objects
    assert before - 50 <= after <= before  # a few frozen objects may die by reference counting, none are unfrozen


def test_thresholds_are_never_changed(tmp_path):
    old = gc.get_threshold()
    gc.set_threshold(321, 4, 5)
    try:
        seen = []

        class Model(TinyModel):
            def training_step(self, batch, batch_idx):
                seen.append(gc.get_threshold())
                return super().training_step(batch, batch_idx)

        collector = GarbageCollector(every_n_steps=1, disable_automatic=True, freeze_after_setup=True)
        make_trainer(tmp_path, callbacks=[collector], max_steps=2, limit_val_batches=0).fit(Model())
        assert seen == [(321, 4, 5)] * 2 and gc.get_threshold() == (321, 4, 5)
    finally:
        gc.set_threshold(*old)
