import copy
import gc
import logging
import warnings
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch

from lightning_memopt.callbacks import GarbageCollector, MemoryAudit
from lightning_memopt.callbacks import garbage_collector as gcmod
from tests.helpers.models import RandomDataset, TinyModel
from tests.helpers.monitor_loggers import RecordingLogger
from tests.helpers.trainer import make_trainer

# gc.freeze() by the package and by the application is part of what these tests check: from an unfrozen process
pytestmark = pytest.mark.usefixtures("unfrozen_gc")


def collect_calls(mocked):
    return [c.args for c in mocked.call_args_list]


def test_collects_every_n_optimizer_steps(tmp_path):
    collector = GarbageCollector(every_n_train_steps=3, generation=1)
    with mock.patch.object(gcmod.gc, "collect", return_value=7) as collect:
        trainer = make_trainer(
            tmp_path, callbacks=[collector], max_steps=10, limit_train_batches=10, limit_val_batches=0
        )
        trainer.fit(TinyModel())
    assert collect_calls(collect) == [(1,), (1,), (1,)]  # steps 3, 6, 9
    assert collector.calls == 3 and collector.collected == 21 and collector.seconds >= 0


def test_interval_counts_optimizer_steps_not_micro_batches(tmp_path):
    collector = GarbageCollector(every_n_train_steps=2)
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


def test_every_n_train_steps_with_accumulate_grad_batches_4_collects_after_every_8th_batch(tmp_path):
    collector = GarbageCollector(every_n_train_steps=2)
    batches = []

    class Model(TinyModel):
        def on_train_batch_end(self, outputs, batch, batch_idx):  # runs after the callbacks' hook
            batches.append(collector.calls)

    trainer = make_trainer(
        tmp_path, callbacks=[collector], max_steps=4, limit_train_batches=16, accumulate_grad_batches=4
    )
    trainer.fit(Model())
    assert [i for i, calls in enumerate(batches) if calls > (batches[i - 1] if i else 0)] == [7, 15]


def test_a_new_trainer_counts_its_steps_from_the_start(tmp_path):
    collector = GarbageCollector(every_n_train_steps=2)
    steps_seen = []
    with mock.patch.object(gcmod.gc, "collect", side_effect=lambda g: steps_seen.append(trainer.global_step) or 0):
        for max_steps in (3, 4):  # the first fit collects at step 2 last; the second fit's step 2 is due again
            trainer = make_trainer(tmp_path, callbacks=[collector], max_steps=max_steps, limit_val_batches=0)
            trainer.fit(TinyModel())
    assert steps_seen == [2, 2, 4]


def test_the_summary_is_printed_only_when_verbose(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        for verbose in (False, True):
            collector = GarbageCollector(every_n_train_steps=2, verbose=verbose)
            make_trainer(tmp_path, callbacks=[collector], max_steps=4, limit_val_batches=0).fit(TinyModel())
    said = [m for m in caplog.messages if "GarbageCollector" in m]
    assert len(said) == 1 and said[0].startswith("GarbageCollector: 2 collections took")
    assert len(said[0]) <= 100


def test_the_totals_are_the_callbacks_own_attributes():
    collector = GarbageCollector()
    assert {"calls": 0, "seconds": 0.0, "collected": 0}.items() <= vars(collector).items()


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
    logger = RecordingLogger()
    make_trainer(
        tmp_path, callbacks=[GarbageCollector(every_n_train_steps=2)], logger=logger, max_steps=4, limit_val_batches=0
    ).fit(TinyModel())
    logged = [m for _, m in logger.calls if "memory/gc/collect_calls" in m]
    assert len(logged) == 1 and logged[0]["memory/gc/collect_calls"] == 2.0
    assert logged[0]["memory/gc/collect_seconds"] > 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every_n_train_steps": 0}, "`every_n_train_steps` must be a positive int, got 0"),
        ({"every_n_train_steps": None}, "`every_n_train_steps` must be a positive int, got None"),
        ({"generation": 3}, "`generation` must be one of 0, 1, 2, got 3"),
        ({"every_n_train_steps": True}, "`every_n_train_steps` must be a positive int, got True"),
        ({"generation": True}, r"`generation` must be a non-negative int, got True\. Use 0, 1 or 2"),
        ({"generation": False}, r"`generation` must be a non-negative int, got False\. Use 0, 1 or 2"),
        ({"generation": 1.0}, r"`generation` must be a non-negative int, got 1.0\. Use 0, 1 or 2"),
        ({"generation": -1}, r"`generation` must be a non-negative int, got -1\. Use 0, 1 or 2"),
        ({"disable_automatic": "yes"}, r"`disable_automatic` must be a bool \(True or False\), got 'yes'\."),
        ({"disable_automatic": 1}, r"`disable_automatic` must be a bool \(True or False\), got 1\."),
        ({"freeze_after_setup": "no"}, r"`freeze_after_setup` must be a bool \(True or False\), got 'no'\."),
        ({"freeze_after_setup": None}, r"`freeze_after_setup` must be a bool \(True or False\), got None\."),
        (
            {"full_every_n_train_steps": 0},
            r"`full_every_n_train_steps` must be a positive int, got 0\. Pass None to never",
        ),
        ({"full_every_n_train_steps": True}, r"`full_every_n_train_steps` must be a positive int, got True\."),
        ({"full_every_n_train_steps": 2.0}, r"`full_every_n_train_steps` must be a positive int, got 2.0\."),
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
    # frozen objects may die by reference counting (other threads' too: a test runner's), none are unfrozen (-> ~0)
    assert before * 0.99 <= after <= before


def test_thresholds_are_never_changed(tmp_path):
    old = gc.get_threshold()
    gc.set_threshold(321, 4, 5)
    try:
        seen = []

        class Model(TinyModel):
            def training_step(self, batch, batch_idx):
                seen.append(gc.get_threshold())
                return super().training_step(batch, batch_idx)

        collector = GarbageCollector(every_n_train_steps=1, disable_automatic=True, freeze_after_setup=True)
        make_trainer(tmp_path, callbacks=[collector], max_steps=2, limit_val_batches=0).fit(Model())
        assert seen == [(321, 4, 5)] * 2 and gc.get_threshold() == (321, 4, 5)
    finally:
        gc.set_threshold(*old)


class CollectionRecorder(pl.Callback):
    """Records every collection Python runs during training (``gc.callbacks``), and the collector's state."""

    def __init__(self):
        self.generations = []
        self.enabled = []
        self.frozen = []
        self._training = False

    def _on_gc(self, phase, info):
        if phase == "start" and self._training:
            self.generations.append(info["generation"])

    def on_train_start(self, trainer, pl_module):
        self._training = True
        gc.callbacks.append(self._on_gc)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.enabled.append(gc.isenabled())
        self.frozen.append(gc.get_freeze_count())

    def on_train_end(self, trainer, pl_module):
        self._training = False
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def on_exception(self, trainer, pl_module, exception):
        self.on_train_end(trainer, pl_module)


def test_defaults_collect_the_young_generations_with_the_automatic_collector_off(tmp_path):
    # A full collection scans every tracked object (hundreds of milliseconds at a million objects): the defaults
    # never run one. They switch the automatic collector off and collect generation 1 on the interval.
    assert gc.isenabled() and gc.get_freeze_count() == 0
    collector = GarbageCollector()
    recorder = CollectionRecorder()
    trainer = make_trainer(
        tmp_path, callbacks=[collector, recorder], max_steps=50, limit_train_batches=16, limit_val_batches=0
    )
    trainer.fit(TinyModel())
    assert recorder.generations == [1, 1]  # steps 25 and 50: no automatic collection, no full one
    assert collector.calls == 2
    assert recorder.enabled == [False] * 50  # off for the whole of training
    assert recorder.frozen == [0] * 50  # nothing frozen: MemoryAudit and OOMReporter still see every tensor
    assert gc.isenabled() and gc.get_freeze_count() == 0 and gcmod._enable_in_forked_child is None
    assert (collector.every_n_train_steps, collector.generation, collector.disable_automatic) == (25, 1, True)
    assert (collector.freeze_after_setup, collector.full_every_n_train_steps) == (False, None)


def test_full_collections_only_where_asked(tmp_path):
    collector = GarbageCollector(every_n_train_steps=4, full_every_n_train_steps=6)
    steps_seen = []

    def collect(generation):
        steps_seen.append((trainer.global_step, generation))
        return 0

    with mock.patch.object(gcmod.gc, "collect", side_effect=collect):
        trainer = make_trainer(
            tmp_path, callbacks=[collector], max_steps=12, limit_train_batches=12, limit_val_batches=0
        )
        trainer.fit(TinyModel())
    assert steps_seen == [(4, 1), (6, 2), (8, 1), (12, 2)]  # a full one in place of the regular one at 12
    assert collector.calls == 4


def test_full_collection_interval_with_generation_2_collects_once_per_step(tmp_path):
    collector = GarbageCollector(every_n_train_steps=2, generation=2, full_every_n_train_steps=3)
    with mock.patch.object(gcmod.gc, "collect", return_value=0) as collect:
        trainer = make_trainer(tmp_path, callbacks=[collector], max_steps=6, limit_train_batches=6, limit_val_batches=0)
        trainer.fit(TinyModel())
    assert collect_calls(collect) == [(2,), (2,), (2,), (2,)]  # steps 2, 3, 4 and 6: never twice in one step


class GcStateDataset(RandomDataset):
    """Each sample carries whether the automatic collector is on where it was loaded (a worker process)."""

    def __getitem__(self, idx):
        return torch.cat([super().__getitem__(idx)[:-1], torch.tensor([float(gc.isenabled())])])


@pytest.mark.skipif(not hasattr(__import__("os"), "register_at_fork"), reason="needs fork")
def test_forked_dataloader_workers_get_the_automatic_collector_back(tmp_path):
    seen_in_workers = []
    seen_in_main = []

    class Model(TinyModel):
        def train_dataloader(self):
            context = torch.multiprocessing.get_context("fork")
            return torch.utils.data.DataLoader(
                GcStateDataset(self.in_features, 8), batch_size=4, num_workers=1, multiprocessing_context=context
            )

        def training_step(self, batch, batch_idx):
            seen_in_workers.extend(batch[:, -1].tolist())
            seen_in_main.append(gc.isenabled())
            return super().training_step(batch, batch_idx)

    collector = GarbageCollector(every_n_train_steps=1)
    make_trainer(tmp_path, callbacks=[collector], max_steps=4, limit_val_batches=0).fit(Model())
    assert seen_in_main == [False] * 4
    # Lightning starts the first epoch's workers before `on_train_start`; the second epoch's are forked while
    # the collector is off in the main process, and get it back on in the child.
    assert seen_in_workers == [1.0] * 16
    assert gc.isenabled() and gcmod._enable_in_forked_child is None


def test_forked_children_keep_the_collector_off_when_the_application_had_it_off(tmp_path):
    gc.disable()
    try:
        collector = GarbageCollector()
        make_trainer(tmp_path, callbacks=[collector], max_steps=1, limit_val_batches=0).fit(TinyModel())
        trainer = make_trainer(tmp_path, callbacks=[collector], max_steps=1, limit_val_batches=0)
        states = []

        class Model(TinyModel):
            def training_step(self, batch, batch_idx):
                states.append(gcmod._enable_in_forked_child)
                return super().training_step(batch, batch_idx)

        trainer.fit(Model())
        assert states == [False] and not gc.isenabled()
    finally:
        gc.enable()


def test_the_default_collector_hides_no_tensor_from_memory_audit(tmp_path):
    # Frozen objects are invisible to `gc.get_objects()`: freezing by default would hide a copy of the weights
    # made before fit from MemoryAudit's walk. The default does not freeze, so the copy is reported.
    model = TinyModel(in_features=256)
    stray = copy.deepcopy(model.layer)  # noqa: F841 - kept alive on purpose
    audit = MemoryAudit(detect_leaks=False, check_grad_tracking=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        make_trainer(tmp_path, callbacks=[GarbageCollector(), audit], max_steps=1, limit_val_batches=0).fit(model)
    assert any("not owned by the model or optimizer" in str(w.message) for w in seen)
    assert audit.last_audit["duplicates"]["num_tensors"] >= 2  # weight and bias
