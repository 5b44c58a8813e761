import json
import os
import warnings
from unittest import mock

import pytest
import torch

from lightning_memopt.callbacks import MemoryMonitor
from lightning_memopt.callbacks import memory_monitor as mm
from lightning_memopt.functional.readings.monitoring import STEP_FIELDS
from tests.helpers.fake_device import FakeAllocator
from tests.helpers.memory_records import RECORD_KEYS
from tests.helpers.models import TinyModel
from tests.helpers.monitor_loggers import RecordingLogger
from tests.helpers.trainer import make_trainer


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def memory_calls(logger, prefix="memory/"):
    return [(step, m) for step, m in logger.calls if any(k.startswith(prefix) for k in m)]


def test_logged_keys_and_steps_with_a_mock_logger(tmp_path):
    logger = RecordingLogger()
    trainer = make_trainer(
        tmp_path,
        callbacks=[MemoryMonitor(log_every_n_steps=2)],
        logger=logger,
        max_steps=6,
        limit_train_batches=6,
        limit_val_batches=3,
        check_val_every_n_epoch=1,
    )
    trainer.fit(TinyModel())
    calls = memory_calls(logger)
    train_steps = [step for step, m in calls if "memory/train/host_rss_bytes" in m]
    assert train_steps == [2, 4, 6]
    # On CPU only host RSS is known at a step; the device keys are not logged at all (no invented zeros).
    step_keys = {k for _, m in calls for k in m if k.startswith("memory/train/")}
    assert step_keys == {"memory/train/host_rss_bytes"}
    val = [(step, m) for step, m in calls if "memory/validate/host_rss_bytes" in m]
    assert [step for step, _ in val] == [6]  # batch 2 of 3 (log every 2 batches), at the end of epoch 0


def test_logged_keys_with_device_readings(tmp_path, monkeypatch):
    fake = FakeAllocator().install(monkeypatch, mm)
    fake.set(1000)
    logger = RecordingLogger()
    trainer = make_trainer(
        tmp_path, callbacks=[MemoryMonitor(log_every_n_steps=1)], logger=logger, max_steps=2, limit_val_batches=0
    )
    trainer.fit(TinyModel())
    calls = memory_calls(logger)
    step_metrics = [m for _, m in calls if "memory/train/allocated_bytes" in m]
    assert len(step_metrics) == 2
    assert set(step_metrics[0]) == {f"memory/train/{f}" for f in STEP_FIELDS}
    end = [m for _, m in calls if "memory/train/peak_allocated_bytes" in m]
    assert end == [{"memory/train/peak_allocated_bytes": 1000.0, "memory/train/peak_reserved_bytes": 1000.0}]


def test_jsonl_schema_in_every_phase(tmp_path):
    monitor = MemoryMonitor(log_every_n_steps=1)
    trainer = make_trainer(tmp_path, callbacks=[monitor], max_steps=3, limit_train_batches=3)
    model = TinyModel()
    trainer.fit(model)
    trainer.validate(model, verbose=False)
    trainer.test(model, verbose=False)
    trainer.predict(model)
    path = tmp_path / "memopt" / "memory_rank0.jsonl"
    assert monitor.path == path
    records = read_jsonl(path)
    for rec in records:
        assert set(rec) >= set(RECORD_KEYS)
        assert rec["rank"] == 0 and rec["device"] == "cpu"
        assert rec["allocated_bytes"] is None and rec["host_rss_bytes"] > 0
    phases = {(r["phase"], r["event"]) for r in records}
    for phase in ("train", "validate", "test", "predict"):
        assert {(phase, "phase_start"), (phase, "step"), (phase, "phase_end")} <= phases
    train_steps = [r["global_step"] for r in records if r["phase"] == "train" and r["event"] == "step"]
    assert train_steps == [1, 2, 3]


def test_peaks_are_per_phase_with_mocked_cuda_readings(tmp_path, monkeypatch):
    fake = FakeAllocator(total=100_000).install(monkeypatch, mm)

    class Model(TinyModel):
        def training_step(self, batch, batch_idx):
            fake.set(1000 + 100 * batch_idx)  # train peak: 1300 at batch 3
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):
            fake.set(5000)  # validation peak, inside fit
            super().validation_step(batch, batch_idx)
            fake.set(500)

    trainer = make_trainer(
        tmp_path,
        callbacks=[MemoryMonitor(log_every_n_steps=1)],
        max_steps=4,
        limit_train_batches=4,
        val_check_interval=2,
    )
    trainer.fit(Model())
    records = read_jsonl(tmp_path / "memopt" / "memory_rank0.jsonl")
    ends = {r["phase"]: r for r in records if r["event"] == "phase_end" and r["phase"] == "train"}
    val_ends = [r for r in records if r["event"] == "phase_end" and r["phase"] == "validate"]
    assert len(val_ends) == 2
    assert all(r["phase_peak_allocated_bytes"] == 5000 for r in val_ends)
    # The train phase's peak does not include the 5000 bytes seen while validating.
    assert ends["train"]["phase_peak_allocated_bytes"] == 1300
    assert fake.resets >= 4  # reset at every phase start and end
    # Step readings inside validation report the peak since validation started, not since fit started.
    val_steps = [r for r in records if r["event"] == "step" and r["phase"] == "validate"]
    assert all(r["peak_allocated_bytes"] == 5000 for r in val_steps)


def test_threshold_warns_once_per_crossing(tmp_path, monkeypatch, caplog):
    fake = FakeAllocator(total=1000).install(monkeypatch, mm)
    levels = [100, 950, 960, 100, 920, 100]

    class Model(TinyModel):
        def training_step(self, batch, batch_idx):
            fake.set(levels[batch_idx], reserved=levels[batch_idx])
            return super().training_step(batch, batch_idx)

    trainer = make_trainer(
        tmp_path,
        callbacks=[MemoryMonitor(log_every_n_steps=1, warn_threshold=0.9)],
        max_steps=6,
        limit_train_batches=6,
        limit_val_batches=0,
    )
    with caplog.at_level("WARNING", logger="lightning_memopt"):
        trainer.fit(Model())
    records = read_jsonl(tmp_path / "memopt" / "memory_rank0.jsonl")
    warnings_ = [r for r in records if r["event"] == "warning"]
    # Two crossings (steps 2 and 5), each for allocated and reserved: 4 records, not one per step above.
    assert [(r["global_step"], r["field"]) for r in warnings_] == [
        (2, "allocated_bytes"),
        (2, "reserved_bytes"),
        (5, "allocated_bytes"),
        (5, "reserved_bytes"),
    ]
    assert warnings_[0]["fraction"] == pytest.approx(0.95)
    assert "[rank 0]" in warnings_[0]["message"] and "warn_threshold" in warnings_[0]["message"]
    assert sum("above `warn_threshold`" in " ".join(m.split()) for m in caplog.messages) == 4  # wrapped at 100


def test_interval_defaults_to_the_trainers_log_every_n_steps(tmp_path):
    monitor = MemoryMonitor()
    trainer = make_trainer(
        tmp_path, callbacks=[monitor], max_steps=6, limit_train_batches=6, log_every_n_steps=3, limit_val_batches=0
    )
    trainer.fit(TinyModel())
    records = read_jsonl(monitor.path)
    assert [r["global_step"] for r in records if r["event"] == "step"] == [3, 6]


def test_gradient_accumulation_logs_once_per_optimizer_step(tmp_path):
    monitor = MemoryMonitor(log_every_n_steps=1)
    trainer = make_trainer(
        tmp_path,
        callbacks=[monitor],
        max_steps=3,
        limit_train_batches=6,
        accumulate_grad_batches=2,
        limit_val_batches=0,
    )
    trainer.fit(TinyModel())
    records = read_jsonl(monitor.path)
    assert [r["global_step"] for r in records if r["event"] == "step"] == [1, 2, 3]
    assert [r["batch_idx"] for r in records if r["event"] == "step"] == [1, 3, 5]


def test_no_synchronize_and_no_reading_on_steps_it_does_not_log(tmp_path, monkeypatch):
    fake = FakeAllocator().install(monkeypatch, mm)
    reads = []
    original = fake.read
    monkeypatch.setattr(fake, "read", lambda: reads.append(1) or original())
    with mock.patch.object(torch.cuda, "synchronize") as sync:
        trainer = make_trainer(
            tmp_path,
            callbacks=[MemoryMonitor(log_every_n_steps=5)],
            max_steps=10,
            limit_train_batches=10,
            limit_val_batches=0,
        )
        trainer.fit(TinyModel())
    sync.assert_not_called()
    # 2 logged steps + phase start + phase end (+1 read to fold peaks at the end).
    assert len(reads) == 4


def test_works_with_logger_false_and_fit_twice(tmp_path):
    monitor = MemoryMonitor(log_every_n_steps=1)
    model = TinyModel()
    trainer = make_trainer(tmp_path, callbacks=[monitor], logger=False, max_steps=2, limit_val_batches=0)
    trainer.fit(model)
    trainer2 = make_trainer(tmp_path, callbacks=[monitor], logger=False, max_steps=2, limit_val_batches=0)
    trainer2.fit(model)
    records = read_jsonl(monitor.path)
    # Two independent runs append to the same file.
    assert [r["global_step"] for r in records if r["event"] == "step"] == [1, 2, 1, 2]


def test_resumed_run_appends_without_duplicate_steps(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(
        tmp_path,
        callbacks=[MemoryMonitor(log_every_n_steps=1), ckpt],
        max_steps=4,
        limit_train_batches=10,
        limit_val_batches=0,
        enable_checkpointing=True,
    )
    trainer.fit(TinyModel())
    path = tmp_path / "memopt" / "memory_rank0.jsonl"
    first = read_jsonl(path)
    assert [r["global_step"] for r in first if r["event"] == "step"] == [1, 2, 3, 4]
    # Resume from step 2: steps 3 and 4 are run again but already in the file.
    resumed = make_trainer(
        tmp_path,
        callbacks=[MemoryMonitor(log_every_n_steps=1)],
        max_steps=6,
        limit_train_batches=10,
        limit_val_batches=0,
    )
    resumed.fit(TinyModel(), ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"))
    records = read_jsonl(path)
    assert records[: len(first)] == first  # nothing already written is lost or rewritten
    steps = [r["global_step"] for r in records if r["event"] == "step"]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_reading_failure_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    fake = FakeAllocator().install(monkeypatch, mm)
    fake.fail = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = make_trainer(
            tmp_path, callbacks=[MemoryMonitor(log_every_n_steps=1)], max_steps=4, limit_val_batches=0
        )
        trainer.fit(TinyModel())
    assert trainer.global_step == 4
    messages = [str(w.message) for w in caught if "reading memory failed" in str(w.message)]
    assert len(messages) == 1 and "driver went away" in messages[0]


def test_dirpath_and_default_under_log_dir(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    monitor = MemoryMonitor(log_every_n_steps=1)
    trainer = make_trainer(
        tmp_path, callbacks=[monitor], logger=CSVLogger(tmp_path / "logs"), max_steps=1, limit_val_batches=0
    )
    trainer.fit(TinyModel())
    assert monitor.path == tmp_path / "logs" / "lightning_logs" / "version_0" / "memopt" / "memory_rank0.jsonl"
    assert monitor.path.exists()
    custom = MemoryMonitor(dirpath=tmp_path / "mine" / "deeper")
    make_trainer(tmp_path, callbacks=[custom], max_steps=1, limit_val_batches=0).fit(TinyModel())
    assert (tmp_path / "mine" / "deeper" / "memory_rank0.jsonl").exists()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"log_every_n_steps": 0}, "`log_every_n_steps` must be a positive int, got 0"),
        ({"log_every_n_steps": -3}, "got -3"),
        ({"warn_threshold": 0}, "`warn_threshold` must be a fraction in \\(0, 1\\], got 0"),
        ({"warn_threshold": 1.5}, "got 1.5"),
        ({"warn_threshold": 90}, "Did you mean 0.9"),
        ({"cross_rank_every_n_train_steps": 0}, "`cross_rank_every_n_train_steps`"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MemoryMonitor(**kwargs)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_dirpath_fails_in_setup_before_training(tmp_path):  # pragma: no cover - CI runs as root
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    trainer = make_trainer(tmp_path, callbacks=[MemoryMonitor(dirpath=locked / "x")], max_steps=1)
    with pytest.raises(OSError, match="`dirpath` must be a writable directory"):
        trainer.fit(TinyModel())
    assert trainer.global_step == 0


def test_dirpath_that_is_a_file_fails_in_setup_before_training(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    model = TinyModel()
    trainer = make_trainer(tmp_path, callbacks=[MemoryMonitor(dirpath=blocker / "memory")], max_steps=1)
    with pytest.raises(OSError, match="`dirpath` must be a writable directory.*not_a_dir"):
        trainer.fit(model)
    assert trainer.global_step == 0


@pytest.mark.cuda
def test_real_cuda_fit_records_device_figures(tmp_path):
    model = TinyModel()
    monitor = MemoryMonitor(log_every_n_steps=1)
    trainer = make_trainer(tmp_path, accelerator="gpu", callbacks=[monitor], max_steps=3, limit_val_batches=1)
    trainer.fit(model)
    records = read_jsonl(monitor.path)
    steps = [r for r in records if r["event"] == "step" and r["phase"] == "train"]
    assert len(steps) == 3
    for r in steps:
        assert r["device"].startswith("cuda:")
        assert r["allocated_bytes"] > 0 and r["reserved_bytes"] >= r["allocated_bytes"]
        assert r["peak_allocated_bytes"] >= r["allocated_bytes"]
        assert r["device_total_bytes"] == torch.cuda.get_device_properties(0).total_memory


@pytest.mark.parametrize(("max_epochs", "max_steps", "last_epoch"), [(2, -1, 1), (3, 5, 1)])
def test_train_phase_end_carries_the_epoch_of_the_last_batch(tmp_path, max_epochs, max_steps, last_epoch):
    monitor = MemoryMonitor(log_every_n_steps=1)
    make_trainer(tmp_path, callbacks=[monitor], max_epochs=max_epochs, max_steps=max_steps, limit_train_batches=3).fit(
        TinyModel()
    )
    records = [json.loads(line) for line in (tmp_path / "memopt" / "memory_rank0.jsonl").read_text().splitlines()]
    end = next(r for r in records if r["phase"] == "train" and r["event"] == "phase_end")
    last_step = max(
        (r for r in records if r["phase"] == "train" and r["event"] == "step"), key=lambda r: r["global_step"]
    )
    assert end["epoch"] == last_step["epoch"] == last_epoch


# ---------------------------------------------------------------- issue 23: names, intervals, quiet CPU runs
def test_cross_rank_interval_counts_optimizer_steps_and_the_old_name_is_gone(tmp_path):
    class TwoRanks(MemoryMonitor):  # a second rank, without a process group: record when the exchange would run
        def setup(self, trainer, pl_module, stage):
            super().setup(trainer, pl_module, stage)
            self._world_size, self.exchanged = 2, []

        def _cross_rank(self, trainer):
            self.exchanged.append((trainer.global_step, trainer.fit_loop.epoch_loop.batch_progress.current.ready))

    monitor = TwoRanks(log_every_n_steps=1, cross_rank_every_n_train_steps=2)
    trainer = make_trainer(tmp_path, callbacks=[monitor], max_steps=4, limit_train_batches=8, accumulate_grad_batches=2)
    trainer.fit(TinyModel())
    assert monitor.exchanged == [(2, 4), (4, 8)]  # optimizer steps 2 and 4 (batches 4 and 8), once each
    with pytest.raises(TypeError, match="cross_rank_every_n_steps"):
        MemoryMonitor(cross_rank_every_n_steps=2)


def test_on_cpu_one_inactive_line_and_no_warning(tmp_path, caplog):
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("INFO"):
        warnings.simplefilter("always")
        make_trainer(tmp_path, callbacks=[MemoryMonitor(log_every_n_steps=1)], max_steps=2).fit(TinyModel())
    assert [str(w.message) for w in caught if "MemoryMonitor" in str(w.message)] == []
    ours = [m for m in caplog.messages if "MemoryMonitor" in m]
    assert ours == ["lightning-memopt: inactive here: MemoryMonitor (no allocator readings on cpu, host RSS only)."]
    assert (tmp_path / "memopt" / "memory_rank0.jsonl").exists()  # host RSS is still recorded


@pytest.mark.parametrize("verbose", [False, True])
def test_phase_peaks_printed_only_when_verbose(tmp_path, monkeypatch, caplog, verbose):
    FakeAllocator().install(monkeypatch, mm).set(1000)
    with caplog.at_level("INFO", logger="lightning_memopt"):
        make_trainer(
            tmp_path, callbacks=[MemoryMonitor(log_every_n_steps=1, verbose=verbose)], max_steps=2, limit_val_batches=0
        ).fit(TinyModel())
    peaks = [m for m in caplog.messages if "peak allocated" in m]
    assert len(peaks) == (1 if verbose else 0)
    ours = [r.getMessage() for r in caplog.records if r.name == "lightning_memopt"]
    assert all(len(line) <= 100 for m in ours for line in m.splitlines())


def test_warnings_from_hooks_point_at_this_package(tmp_path, monkeypatch):
    from lightning_memopt.callbacks import OOMReporter

    with warnings.catch_warnings(record=True) as caught:  # a CPU fit: nothing of ours located in Lightning's call.py
        warnings.simplefilter("always")
        callbacks = [MemoryMonitor(log_every_n_steps=1), OOMReporter(record_history=True)]
        make_trainer(tmp_path, callbacks=callbacks, max_steps=2).fit(TinyModel())
    assert [f"{w.filename}: {w.message}" for w in caught if w.filename.endswith("call.py")] == []
    fake = FakeAllocator().install(monkeypatch, mm)
    fake.fail = True  # the reading fails in on_train_start's phase bookkeeping and at every step
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, callbacks=[MemoryMonitor(log_every_n_steps=1)], max_steps=2).fit(TinyModel())
    ours = [w for w in caught if "MemoryMonitor" in str(w.message)]
    assert ours and all(f"{os.sep}lightning_memopt{os.sep}" in w.filename for w in ours), [w.filename for w in ours]


def test_threshold_warning_fits_100_columns_and_the_record_keeps_one_line(tmp_path, monkeypatch, caplog):
    fake = FakeAllocator(total=10 * 2**30).install(monkeypatch, mm)
    fake.set(int(9.5 * 2**30))
    with caplog.at_level("WARNING", logger="lightning_memopt"):
        make_trainer(tmp_path, callbacks=[MemoryMonitor(log_every_n_steps=1)], max_steps=1).fit(TinyModel())
    (printed,) = [m for m in caplog.messages if "warn_threshold" in m and "allocated memory" in m]
    assert len(printed.splitlines()) == 2 and all(len(line) <= 100 for line in printed.splitlines())
    records = read_jsonl(tmp_path / "memopt" / "memory_rank0.jsonl")
    (record,) = [r for r in records if r["event"] == "warning" and r["field"] == "allocated_bytes"]
    assert " ".join(printed.split()) == record["message"] and len(record["message"]) > 100
