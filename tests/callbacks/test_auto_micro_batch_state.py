"""AutoMicroBatch's seam, names and output: the loop writes a state object the callback reads, the renamed
arguments, one line of at most 100 columns per halving, nothing printed without one, and warnings located in the
package."""

from __future__ import annotations

import inspect
import logging
import warnings
from pathlib import Path

import pytest

import lightning_memopt
from lightning_memopt.callbacks.auto_micro_batch import (
    AutoMicroBatch,
    MicroBatchSettings,
    MicroBatchState,
    halving_line,
    optimization_class,
)
from lightning_memopt.functional.micro_batch.slicing import batch_size_of, slice_batch
from tests.helpers.amb import Net, fit
from tests.helpers.lightning import pl
from tests.helpers.monitor_loggers import RecordingLogger
from tests.helpers.trainer import make_trainer

PACKAGE = Path(lightning_memopt.__file__).resolve().parent

# ------------------------------------------------------------------------------------------------ the state object


def test_the_loop_runs_without_the_callback_and_writes_only_its_state(tmp_path):
    """The loop needs no AutoMicroBatch: given settings and a state, it splits, halves and records in the state."""
    model = Net(forward_budget=4, batch_size=16)
    trainer = make_trainer(tmp_path, max_steps=2, limit_train_batches=None, limit_val_batches=0)
    epoch_loop = trainer.fit_loop.epoch_loop
    original = epoch_loop.automatic_optimization
    state = MicroBatchState()
    loop = optimization_class(pl.__name__)(trainer, original, MicroBatchSettings(min_micro_batch_size=2), state)
    epoch_loop.automatic_optimization = loop
    trainer.fit(model)
    # learned in elements: 4 samples of 6 (x: 4, y: 1, the index: 1)
    assert state == MicroBatchState(micro_batch_size=4, retries=2, elements=24)
    assert model.seen_sizes == [16, 8] + [4] * 8 and trainer.global_step == 2
    assert loop.original is original and loop.optim_progress is original.optim_progress


class _Probe(pl.Callback):
    """Reads the installed loop's state and the callback's view of it after every batch."""

    def __init__(self, callback):
        self.callback, self.seen = callback, []

    def on_train_batch_end(self, trainer, *args):
        state = trainer.fit_loop.epoch_loop.automatic_optimization.state
        self.seen.append((state.micro_batch_size, state.retries, self.callback.micro_batch_size, self.callback.retries))


def test_the_callback_reads_the_state_its_loop_writes(tmp_path):
    callback = AutoMicroBatch()
    probe = _Probe(callback)
    fit(tmp_path, Net(forward_budget=4, batch_size=16), [callback, probe], max_steps=2)
    assert probe.seen == [(4, 2, 4, 2), (4, 2, 4, 2)]
    with pytest.raises(AttributeError):
        callback.micro_batch_size = 8  # read from the state: the callback has no copy of its own to get out of step
    with pytest.raises(AttributeError):
        callback.retries = 0


def test_a_checkpoint_loaded_after_setup_reaches_the_installed_loop(tmp_path):
    """Lightning restores callbacks after ``setup`` installed the loop: the loop must start at the saved size."""
    first = AutoMicroBatch()
    trainer = fit(tmp_path, Net(forward_budget=4, batch_size=16), [first], max_steps=1)
    path = tmp_path / "one.ckpt"
    trainer.save_checkpoint(path)
    model, resumed = Net(forward_budget=4, batch_size=16), AutoMicroBatch()
    make_trainer(tmp_path, callbacks=[resumed], max_steps=2, limit_train_batches=None, limit_val_batches=0).fit(
        model, ckpt_path=path
    )
    assert model.seen_sizes == [4] * 4 and (resumed.micro_batch_size, resumed.retries) == (4, 2)


# ------------------------------------------------------------------------------------------------ the renames


def test_the_functions_are_named_split_batch_fn_and_batch_size_fn():
    params = list(inspect.signature(AutoMicroBatch).parameters)
    assert "split_batch_fn" in params and "batch_size_fn" in params
    assert "split_batch" not in params and "batch_size" not in params
    callback = AutoMicroBatch(split_batch_fn=slice_batch, batch_size_fn=batch_size_of)
    assert (callback.split_batch_fn, callback.batch_size_fn) == (slice_batch, batch_size_of)
    for old in ({"split_batch": slice_batch}, {"batch_size": batch_size_of}):  # unreleased: no alias
        with pytest.raises(TypeError, match="unexpected keyword"):
            AutoMicroBatch(**old)


@pytest.mark.parametrize("name", ["split_batch_fn", "batch_size_fn"])
def test_a_function_argument_that_is_not_callable_is_refused_by_its_new_name(name):
    with pytest.raises(ValueError, match=rf"`{name}` must be a function or None, got 3"):
        AutoMicroBatch(**{name: 3})


# ------------------------------------------------------------------------------------------------ output


def test_each_halving_prints_one_line_of_at_most_100_columns(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        fit(tmp_path, Net(forward_budget=4, batch_size=16), [AutoMicroBatch()], max_steps=1)
    printed = [m for m in caplog.messages if "AutoMicroBatch" in m]
    assert printed == [
        "AutoMicroBatch: micro-batch 16 -> 8 (out of memory; batch of 16, global step 0).",
        "AutoMicroBatch: micro-batch 8 -> 4 (out of memory; batch of 16, global step 0).",
    ]
    worst = halving_line(2**40, 2**39, "out of memory on another process", 2**41, 10**12)
    assert all(len(line) <= 100 for line in worst.splitlines()) and "1000000000000)." in worst


def test_a_fit_without_out_of_memory_prints_and_warns_nothing(tmp_path, caplog, capsys):
    with caplog.at_level(logging.DEBUG, logger="lightning_memopt"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, Net(batch_size=16), [AutoMicroBatch(micro_batch_size=8)], max_steps=2)
    ours = [w for w in caught if "AutoMicroBatch" in str(w.message)]
    assert ours == [] and [r for r in caplog.records if "AutoMicroBatch" in r.getMessage()] == []
    assert "AutoMicroBatch" not in capsys.readouterr().out


class _FailingLogger(RecordingLogger):
    """Fails on the package's metrics only (Lightning's own logging would end the fit)."""

    def log_metrics(self, metrics, step=None):
        if any(key.startswith("memory/") for key in metrics):
            raise OSError("disk full")
        super().log_metrics(metrics, step)


def test_warnings_from_hooks_are_located_in_the_package(tmp_path):
    """``filterwarnings(module="lightning_memopt...")`` must reach them: never Lightning's ``call.py``."""

    class Loader:  # a DataLoader whose batch_size says 16 while its batches hold 8 samples: the split-dim warning
        def __init__(self, loader):
            self.loader, self.batch_size = loader, 16

        def __iter__(self):
            return iter(self.loader)

        def __len__(self):
            return len(self.loader)

    model = Net(forward_budget=4, batch_size=8)
    inner = model.train_dataloader()
    model.train_dataloader = lambda: Loader(inner)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, model, [AutoMicroBatch()], max_steps=1, logger=_FailingLogger())
    ours = [w for w in caught if "AutoMicroBatch" in str(w.message)]
    texts = " | ".join(str(w.message) for w in ours)
    assert "splits batches along the first dim" in texts and "logging to _FailingLogger failed" in texts
    for w in ours:
        assert Path(w.filename).resolve().is_relative_to(PACKAGE), (w.filename, str(w.message)[:80])
