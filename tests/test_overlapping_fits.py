"""Two Trainers fitting at once in two threads share the process-wide settings their parts borrow.

The fits are made to overlap in one fixed order with events set and awaited inside callbacks:

    A: setup, switches gc off ........ waits for B ... ends (teardown, or on_exception after a crash)
    B:            waits for A's start, setup, starts ...... waits for A's end ... ends last

Before the counting, B saved the state A had set ("gc off") and gave it back at its end, so automatic collection
stayed off for the rest of the process; A's end gave back "gc on" while B was still training.
"""

from __future__ import annotations

import gc
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_memopt import AllocatorSettings, GarbageCollector, MemoryPrecision
from lightning_memopt.callbacks import garbage_collector
from lightning_memopt.functional import allocator
from lightning_memopt.functional.allocator import ALLOC_CONF_ENV
from tests.helpers.lightning import pl
from tests.helpers.models import TinyModel
from tests.helpers.trainer import make_trainer

# gc.freeze() by the package and by the application is part of what these tests check: from an unfrozen process
pytestmark = pytest.mark.usefixtures("unfrozen_gc")

_WAIT_S = 60


def _wait(event: threading.Event) -> None:
    if not event.wait(_WAIT_S):
        raise TimeoutError("the other fit never got there")


class Gate(pl.Callback):
    """Runs ``steps[hook]()`` in that hook: awaits or sets an event, or records what the process looks like."""

    def __init__(self, **steps: Callable[[], None]) -> None:
        self.steps = steps

    def _run(self, hook: str) -> None:
        if hook in self.steps:
            self.steps[hook]()

    def setup(self, trainer, pl_module, stage):
        self._run("setup")

    def on_train_start(self, trainer, pl_module):
        self._run("on_train_start")

    def teardown(self, trainer, pl_module, stage):
        self._run("teardown")

    def on_exception(self, trainer, pl_module, exception):
        self._run("on_exception")


def process_state() -> dict[str, Any]:
    """Everything the parts below borrow from the process."""
    return {
        "gc_enabled": gc.isenabled(),
        "gc_threshold": gc.get_threshold(),
        "gc_frozen": gc.get_freeze_count() > 0,
        "forked_child_gc": garbage_collector._enable_in_forked_child,
        "env": os.environ.get(ALLOC_CONF_ENV),
        "new_env": os.environ.get("PYTORCH_ALLOC_CONF"),
        "matmul": torch.get_float32_matmul_precision(),
    }


def _model(wait: threading.Event, crash: bool) -> pl.LightningModule:
    """A model that waits for ``wait`` at its second batch (the overlap) and then raises if ``crash``."""

    class Model(TinyModel):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                _wait(wait)
                if crash:
                    raise RuntimeError("crash in training_step")
            return super().training_step(batch, batch_idx)

    return Model()


def _parts(conf: str, precision: str, freeze: bool) -> tuple[list[pl.Callback], list[Any]]:
    # the freeze's full collection costs ~0.8 s in a test process: one test row freezes
    callbacks = [GarbageCollector(every_n_train_steps=1, freeze_after_setup=freeze), AllocatorSettings(conf)]
    return callbacks, [MemoryPrecision("32-true", float32_matmul_precision=precision)]


def overlapping_fits(
    tmp_path, crash: str = "none", b_conf: str = "expandable_segments:True", b_precision="high", freeze=False
):
    """Fit A and B in two threads in the order of the module docstring. Returns what B saw after A ended."""
    a_started, b_started, a_done = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, Any] = {}
    errors: dict[str, BaseException] = {}

    a_callbacks, a_plugins = _parts("expandable_segments:True", "high", freeze)
    a_gate = Gate(on_train_start=a_started.set, teardown=a_done.set, on_exception=a_done.set)
    a = make_trainer(tmp_path / "a", max_steps=3, callbacks=[*a_callbacks, a_gate], plugins=a_plugins)
    b_callbacks, b_plugins = _parts(b_conf, b_precision, freeze)
    b_first = Gate(setup=lambda: _wait(a_started))  # before B's parts: B borrows while A holds
    b_last = Gate(on_train_start=b_started.set)
    b = make_trainer(tmp_path / "b", max_steps=3, callbacks=[b_first, *b_callbacks, b_last], plugins=b_plugins)
    a_model = _model(b_started, crash == "first")

    class BModel(TinyModel):
        def training_step(self, batch, batch_idx):
            if batch_idx == 1:
                _wait(a_done)
                seen.update(process_state())  # A has ended; B still trains
                if crash == "last":
                    raise RuntimeError("crash in training_step")
            return super().training_step(batch, batch_idx)

    def run(name: str, trainer: pl.Trainer, model: pl.LightningModule) -> None:
        try:
            trainer.fit(model)
        except BaseException as err:
            errors[name] = err
            a_started.set(), b_started.set(), a_done.set()  # never leave the other thread waiting

    threads = [
        threading.Thread(target=run, args=("first", a, a_model)),
        threading.Thread(target=run, args=("last", b, BModel())),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(2 * _WAIT_S)
    assert not any(thread.is_alive() for thread in threads)
    expected = set() if crash == "none" else {crash}
    assert set(errors) == expected, errors
    for err in errors.values():
        assert str(err) == "crash in training_step"
    return seen


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.setattr(allocator, "_cuda_initialized", lambda: False)  # the environment route, even on a GPU host
    monkeypatch.delenv(ALLOC_CONF_ENV, raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    enabled, threshold, matmul = gc.isenabled(), gc.get_threshold(), torch.get_float32_matmul_precision()
    gc.set_threshold(700, 9, 11)  # not Python's default: what was there before is given back, not a default
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.enable() if enabled else gc.disable()
        torch.set_float32_matmul_precision(matmul)


@pytest.mark.parametrize("crash", ["none", "first", "last"])
def test_overlapping_fits_give_back_the_state_from_before_either_started(tmp_path, crash):
    before = process_state()
    assert before["gc_enabled"] and before["env"] is None and not before["gc_frozen"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        seen = overlapping_fits(tmp_path, crash, freeze=crash == "none")
    after = process_state()
    assert after == before, {k: (before[k], after[k]) for k in before if before[k] != after[k]}
    # A has ended, B still holds everything: A's end gave nothing back under B
    assert seen["gc_enabled"] is False and seen["gc_frozen"] is (crash == "none") and seen["forked_child_gc"] is True
    assert seen["env"] == "expandable_segments:True" and seen["matmul"] == "high"


def test_an_overlapping_run_asking_for_other_values_runs_with_the_first_ones_and_is_told(tmp_path):
    before = process_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen = overlapping_fits(tmp_path, b_conf="max_split_size_mb:128", b_precision="medium")
    assert seen["env"] == "expandable_segments:True" and seen["matmul"] == "high"  # the first run's values
    told = [str(w.message) for w in caught if "while another run in this process holds" in str(w.message)]
    assert len(told) == 2, told  # one per setting, from B only
    assert any("AllocatorSettings asked for `cuda.allocator_settings` = 'max_split_size_mb:128'" in m for m in told)
    assert any("MemoryPrecision asked for `torch.float32_matmul_precision` = 'medium'" in m for m in told)
    assert process_state() == before
